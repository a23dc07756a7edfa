"""Live bytes of tensors that allocate nothing (meta), by storage lifetime.

A meta tensor has a storage with a size (``untyped_storage().nbytes()``) but no memory, so no
allocator sees it. What a real run would hold at any moment is the sum of the storages alive at
that moment: a storage lives as long as any tensor (view, autograd saved tensor, optimizer state,
DTensor wrapper's local) refers to it, and a real allocator frees its memory exactly then. So:

- a TorchDispatchMode sees every op's outputs (DTensor ops at the DTensor level -- we take the
  local tensor's storage, which is what a rank holds -- and plain local ops that hypershard's hooks
  run, such as fully_shard's gather buffers); a storage seen for the first time is born with its
  bytes;
- ``weakref.finalize`` on the storage's Python object says when it dies (torch keeps a storage's
  Python object alive as long as the C++ storage lives, so the finalizer runs at the C++ free);
- a storage resized in place (fully_shard's gathered parameters) is re-read when an op outputs it
  again and at every fully_shard gather and free (`resync`);
- storages alive before the step (parameters, buffers) are registered as known and never counted
  as born.

The timeline of births and deaths, classified after the step (which storages became gradients,
optimizer state), gives the peak of everything else: activations, gathered fully_shard
parameters and temporaries -- the "activation" class of the report.

Model code that branches on data (``mask.all()``) reads a meta tensor's value: `_scalar` gives the
answer an ordinary training batch gives (see there).

Not seen: buffers an op allocates and frees inside one C++ call (a redistribution's gathered input
consumed by the same op, a kernel's workspace). They are transient within one op; the 4-rank
validation (tests/python/level1/test_planner.py) measures how much they matter.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _C

__all__ = ["LiveBytes", "storage_key", "local_tensor"]

_META = torch.device("meta")
_SCALAR = torch.ops.aten._local_scalar_dense.default
_BENIGN = {torch.ops.aten.all: True, torch.ops.aten.any: False}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local tensor, or `t` itself."""
    return _C.local_of(t) if _C.is_dtensor(t) else t


def storage_key(t: torch.Tensor):
    """(key, storage) of what `t` holds on this rank; key None for a tensor without storage."""
    local = local_tensor(t)
    try:
        storage = local.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None, None
    return storage._cdata, storage


def _replicate_plain(args, kwargs):
    """Plain meta tensors next to DTensors, made Replicate DTensors. A real run's plain tensors
    (masks, positions the model builds) are CPU tensors, which hypershard takes as Replicate
    (PrivateUse2 outranks CPU); a plain META tensor would outrank PrivateUse2 instead (Meta is
    torch's highest backend) and run the op as a plain meta op on the wrappers."""
    leaves = pytree.tree_leaves((args, kwargs))
    dtensor = next((t for t in leaves if isinstance(t, torch.Tensor) and _C.is_dtensor(t)), None)
    if dtensor is not None and kwargs.get("device") == _META:
        # autograd's casts (ToCopyBackward: grad.to(input.options())) name the input's device: meta
        # here, the mesh's device in a real run, where hypershard keeps the result a DTensor.
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
    if dtensor is None or not any(isinstance(t, torch.Tensor) and t.is_meta and not _C.is_dtensor(t) for t in leaves):
        return args, kwargs
    mesh = _C.device_mesh_of(dtensor)

    def wrap(t):
        if isinstance(t, torch.Tensor) and t.is_meta and not _C.is_dtensor(t):
            layout = _C.Layout.create(mesh.mesh, list(t.shape), [[] for _ in t.shape], [])
            return _C.from_local(t, mesh, layout)
        return t

    return pytree.tree_map(wrap, (args, kwargs))


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as live:`` -- records storage births and deaths (see the module
    docstring); `mark(name)` labels the timeline; `peak(exclude, start, end)` is the largest sum of
    live bytes of the storages not in `exclude` between two marks."""

    def __init__(self):
        super().__init__()
        self.known: set = set()  # storages alive before recording (never counted)
        self.live: dict = {}  # key -> bytes, storages born while recording and still alive
        self.events: list = []  # (key, +bytes) at birth, (key, -bytes) at death
        self.marks: dict = {}  # name -> index into events
        self.hints: dict = {}  # storage key -> the value `.item()` of it reads (see _scalar)
        self.refs: dict = {}  # storage key -> weakref to the storage (to see it resized)

    def know(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                key, _ = storage_key(t)
                if key is not None:
                    self.known.add(key)

    def mark(self, name: str) -> None:
        self.marks[name] = len(self.events)

    def _died(self, key) -> None:
        nbytes = self.live.pop(key, None)
        self.refs.pop(key, None)
        if nbytes:
            self.events.append((key, -nbytes))

    def _resized(self, key, nbytes: int) -> None:
        if nbytes != self.live[key]:
            self.events.append((key, nbytes - self.live[key]))
            self.live[key] = nbytes

    def see(self, t: torch.Tensor) -> None:
        key, storage = storage_key(t)
        if key is None or key in self.known:
            return
        nbytes = storage.nbytes()
        if key in self.live:
            self._resized(key, nbytes)
            return
        self.live[key] = 0
        self.refs[key] = weakref.ref(storage)
        self._resized(key, nbytes)
        weakref.finalize(storage, self._died, key)

    def resync(self) -> None:
        """Re-reads every live storage's size: fully_shard frees and reallocates its gathered
        parameters' storages in place (csrc/runtime/fully_shard.cpp, set_storage_bytes), with no op
        output to see."""
        for key, ref in list(self.refs.items()):
            storage = ref()
            if storage is not None and key in self.live:
                self._resized(key, storage.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _SCALAR and local_tensor(args[0]).is_meta:
            return self._scalar(args[0])
        args, kwargs = _replicate_plain(args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _BENIGN and isinstance(out, torch.Tensor):
            key, _ = storage_key(out)
            self.hints[key] = _BENIGN[func.overloadpacket]
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.see(leaf)
        return out

    def _scalar(self, t: torch.Tensor):
        """`.item()` of a meta tensor (model code branching on data): the benign answer a real
        batch gives -- all() True (no padding, no packed sequences), any() False (nothing
        abnormal), else 0 / False."""
        key, _ = storage_key(t)
        value = self.hints.get(key, 0)
        if t.dtype == torch.bool:
            return bool(value)
        return float(value) if t.dtype.is_floating_point else int(value)

    def peak(self, exclude: set = frozenset(), start: str = None, end: str = None) -> int:
        """Largest live bytes of non-excluded storages reached between marks `start` and `end`
        (the live bytes at `start` included)."""
        lo = self.marks.get(start, 0) if start else 0
        hi = self.marks.get(end, len(self.events)) if end else len(self.events)
        current = 0
        for key, delta in self.events[:lo]:
            if key not in exclude:
                current += delta
        best = current
        for key, delta in self.events[lo:hi]:
            if key not in exclude:
                current += delta
                best = max(best, current)
        return best
