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

It also counts floating-point operations (`flops`, `op_flops`): the matrix products (mm, addmm, bmm,
baddbmm, _grouped_mm) from this rank's output block and contraction, and the attention kernels (CPU
flash, CUDA flash / efficient / cuDNN, the PrivateUse1 hook, and their backwards) from this rank's
query rows against every key. Other ops (elementwise, norms, softmax of the math path's scores,
convolutions) are not counted: they are a few percent of a transformer's FLOPs.

Not seen: buffers an op allocates and frees inside one C++ call (a redistribution's gathered input
consumed by the same op, a kernel's workspace), but for one kind that is: the contiguous copies
softmax and log_softmax kernels (and backwards) make of a non-contiguous input
(`_CONTIGUOUS_INPUTS`), counted while the op runs. They are transient within one op; the 4-rank
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


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _product_flops(args, out) -> int:
    """mm / addmm / bmm / baddbmm / _grouped_mm: 2 x the rank's output elements x the contraction
    (a _grouped_mm over sharded groups: the share of rows balanced routing gives its local groups).
    The contraction is the smaller local one of the two operands (a dim sharded on one operand only
    is sharded on both when the op runs, or gathered: the rule's choice, not seen here); a 2-d x 2-d
    _grouped_mm (a weight gradient: (K, tokens) x (tokens, N) -> (G, K, N)) sums over all tokens."""
    tensors = [t for t in args if isinstance(t, torch.Tensor) and t.dim() >= 2]
    mats = [local_tensor(t) for t in tensors]
    a, b = mats[-2], mats[-1]
    result = local_tensor(out[0] if isinstance(out, (tuple, list)) else out)
    if a.dim() == 2 and b.dim() == 2 and result.dim() == 3:
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    else:
        flops = 2 * _numel(result.shape) * min(a.shape[-1], b.shape[-2])
    if result.dim() != a.dim() or (a.dim() == 2 and b.dim() == 3):
        # _grouped_mm with the groups (experts) sharded: a meta tensor cannot say which rows go to
        # this rank's experts, so every row is in its output; with balanced routing a fraction
        # (local groups / all groups) of them is computed here.
        groups = tensors[-1] if b.dim() == 3 else out
        local_groups, all_groups = local_tensor(groups).shape[0], groups.shape[0]
        flops = flops * local_groups // max(all_groups, 1)
    return flops


def _attention_flops(args, backward: bool) -> int:
    """A fused attention kernel: 2 x (this rank's query rows x heads x batch) x ALL key positions x
    (the q/k and v head dims); its backward 2.5 times that (five products against two). Causal
    masking's skipped half is not taken off (as torch's flop counter)."""
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    q, k, v = tensors[1:4] if backward else tensors[:3]
    lq, kv = local_tensor(q), k  # k's GLOBAL length: under cp every rank's rows meet every key
    b, h, rows = lq.shape[0], lq.shape[1], lq.shape[2]
    fwd = 2 * b * h * rows * kv.shape[-2] * (lq.shape[-1] + local_tensor(v).shape[-1])
    return fwd * 5 // 2 if backward else fwd


def _flop_rules() -> dict:
    aten = torch.ops.aten
    out = {op: "product" for op in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm)}
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    ):
        out[getattr(aten, name)] = "attention"
        out[getattr(aten, name + "_backward")] = "attention_backward"
    return out


def op_flops(func, args, out) -> int:
    """Floating-point operations of one op on this rank (0 for ops not counted: elementwise, norms)."""
    if not _FLOPS:
        _FLOPS.update(_flop_rules())
    rule = _FLOPS.get(func.overloadpacket)
    if rule == "product":
        return _product_flops(args, out)
    if rule is not None:
        return _attention_flops(args, rule == "attention_backward")
    return 0


_FLOPS: dict = {}
# Kernels that copy a non-contiguous input before computing (ATen's softmax / log_softmax and their
# backwards, CPU and CUDA alike: host_softmax takes input.contiguous()): op -> argument positions.
# The copies live inside the one C++ call, so no op output shows them; counted as a workspace.
# causal_lm_loss's cross entropy (a cp mesh) takes log_softmax of the logits moved to [B, V, L], a
# non-contiguous view: one logits-sized copy.
_CONTIGUOUS_INPUTS: dict = {}


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
        self.events: list = []  # (birth, +bytes) at birth, (birth, -bytes) at death (and resizes)
        # A storage's key is its address, which a later storage may reuse once it is freed: events name
        # the BIRTH (a number per storage seen), so excluding the storages that end up as gradients or
        # optimizer state (`births`) never excludes an earlier temporary that lived at the same address.
        self.birth: dict = {}  # key -> birth number of the storage alive at that address
        self.births_seen = 0
        self.marks: dict = {}  # name -> index into events
        self.hints: dict = {}  # storage key -> the value `.item()` of it reads (see _scalar)
        self.refs: dict = {}  # storage key -> weakref to the storage (to see it resized)
        self.flops = 0  # floating-point operations of this rank's local computation (module docstring)
        self.flops_at: dict = {}  # mark name -> flops counted before it

    def know(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                key, _ = storage_key(t)
                if key is not None:
                    self.known.add(key)

    def mark(self, name: str) -> None:
        self.marks[name] = len(self.events)
        self.flops_at[name] = self.flops

    def _died(self, key, birth) -> None:
        if self.birth.get(key) != birth:
            return
        nbytes = self.live.pop(key, None)
        self.refs.pop(key, None)
        self.birth.pop(key, None)
        if nbytes:
            self.events.append((birth, -nbytes))

    def births(self, keys) -> set:
        """The birth numbers of the live storages at these keys (storage_key): what `peak` excludes."""
        return {self.birth[k] for k in keys if k in self.birth}

    def _resized(self, key, nbytes: int) -> None:
        if nbytes != self.live[key]:
            self.events.append((self.birth[key], nbytes - self.live[key]))
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
        self.births_seen += 1
        birth = self.births_seen
        self.birth[key] = birth
        self._resized(key, nbytes)
        weakref.finalize(storage, self._died, key, birth)

    def resync(self) -> None:
        """Re-reads every live storage's size: fully_shard frees and reallocates its gathered
        parameters' storages in place (csrc/runtime/fully_shard.cpp, set_storage_bytes), with no op
        output to see."""
        for key, ref in list(self.refs.items()):
            storage = ref()
            if storage is not None and key in self.live:
                self._resized(key, storage.nbytes())

    def _workspace(self, func, args) -> int:
        """Bytes the op's kernel copies its non-contiguous inputs into (see _CONTIGUOUS_INPUTS)."""
        if not _CONTIGUOUS_INPUTS:
            aten = torch.ops.aten
            _CONTIGUOUS_INPUTS.update(
                {
                    aten._softmax: (0,),
                    aten._log_softmax: (0,),
                    aten._softmax_backward_data: (0, 1),
                    aten._log_softmax_backward_data: (0, 1),
                }
            )
        total = 0
        for i in _CONTIGUOUS_INPUTS.get(func.overloadpacket, ()):
            t = args[i] if i < len(args) else None
            if isinstance(t, torch.Tensor):
                local = local_tensor(t)
                if local.is_meta and not local.is_contiguous():
                    total += local.numel() * local.element_size()
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _SCALAR and local_tensor(args[0]).is_meta:
            return self._scalar(args[0])
        args, kwargs = _replicate_plain(args, kwargs or {})
        workspace = self._workspace(func, args)
        if workspace:  # alive while the kernel runs, with its outputs
            self.births_seen += 1
            transient = ("workspace", self.births_seen)
            self.events.append((transient, workspace))
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _BENIGN and isinstance(out, torch.Tensor):
            key, _ = storage_key(out)
            self.hints[key] = _BENIGN[func.overloadpacket]
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.see(leaf)
        if workspace:
            self.events.append((transient, -workspace))
        self.flops += op_flops(func, args, out)
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
        """Largest live bytes of the storages whose births are not in `exclude` (see `births`) reached
        between marks `start` and `end`
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
