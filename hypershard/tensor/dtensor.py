"""The user-facing DTensor API. Everything per op runs in C++ (``hypershard._C``); this module
only builds meshes and layouts from what users write and adds the DTensor methods.

A DTensor is a ``torch.Tensor`` whose implementation is hypershard's C++ ``DTensorImpl``: it
reports the GLOBAL shape and holds this rank's local shard. Ops on it reach hypershard's
dispatcher fallback, so unmodified PyTorch code runs on it. ``isinstance(x, hypershard.DTensor)``
is true for every such tensor (op outputs and parameter grads included), and these methods work
on it: ``to_local()``, ``full_tensor()``, ``redistribute(...)``, ``placements``, ``device_mesh``,
``sharding`` (hypershard's Layout, also ``hypershard.layout_of(t)``). ``layout`` keeps torch's
meaning (``torch.strided``) on DTensors too.

Printing, ``tolist()``, ``numpy()``, ``item()`` show GLOBAL values: for a sharded or Partial
DTensor they gather, which is a collective — call them on every rank of the mesh.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import types
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import _C
from . import fake_guard as _compile_support
from .layout import make_layout
from .placement_types import Partial, Replicate, Shard

__all__ = [
    "DTensor",
    "DeviceMesh",
    "distribute_tensor",
    "init_device_mesh",
    "is_strict",
    "layout_of",
    "release_process_groups",
    "set_strict",
    "strict",
]

DeviceMesh = _C.DeviceMesh


# ---------------------------------------------------------------------------------- debug checks


def set_debug_checks(enabled: bool) -> None:
    """Debug mode: check that tensors hypershard assumes equal on every rank are equal --
    distribute_tensor's input and every plain tensor operand of an op with DTensor operands
    (both count as Replicate). A mismatch raises the same error on every rank. Costs one small
    all-reduce per mesh axis and checked tensor. Also switched on by the environment variable
    HYPERSHARD_DEBUG_CHECKS=1."""
    _C.set_check_replicas(bool(enabled))


def debug_checks() -> bool:
    return _C.check_replicas()


if os.environ.get("HYPERSHARD_DEBUG_CHECKS", "") not in ("", "0"):
    set_debug_checks(True)


# ---------------------------------------------------------------------------------- strict mode


def set_strict(enabled: bool) -> None:
    """Strict mode: an op without a distributed rule raises "Missing operator" on every rank,
    before any collective. Off by default: such an op runs through the fallback (inputs gathered
    to Replicate, the op computed on the global values, outputs Replicate; a warning once per op;
    counted in ``_C.dispatch_stats()['fallback_calls']``). Rule and model tests run strict so the
    fallback can never hide a missing rule. Also switched on by HYPERSHARD_STRICT=1."""
    _C.set_strict(bool(enabled))


def is_strict() -> bool:
    return _C.strict()


@contextlib.contextmanager
def strict(enabled: bool = True):
    """``with hypershard.strict(): ...`` runs the block in strict mode (see set_strict) and
    restores the previous mode afterwards."""
    previous = _C.strict()
    _C.set_strict(bool(enabled))
    try:
        yield
    finally:
        _C.set_strict(previous)


if os.environ.get("HYPERSHARD_STRICT", "") not in ("", "0"):
    set_strict(True)


# ---------------------------------------------------------------------------------- meshes

release_process_groups = _C.release_process_groups

# Before finalization: a group dropped while the interpreter finalizes (a DTensor in a module
# global) would join its worker thread while that thread cannot get the GIL any more.
atexit.register(release_process_groups)


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    mesh_dim_names: Optional[Sequence[str]] = None,
    *,
    axis_names: Optional[Sequence[str]] = None,
    timeout: Optional[datetime.timedelta] = None,
) -> DeviceMesh:
    """A mesh over all ranks of the default process group (row-major), with one c10d process
    group per axis. Every rank must call it with the same arguments. `timeout`: of the axis
    groups' collectives; default: the default process group's (init_process_group(timeout=...)),
    so a rank that stops answering fails the others after that long instead of torch's 30
    minutes for new groups."""
    names = list(axis_names or mesh_dim_names or [f"axis{i}" for i in range(len(mesh_shape))])
    if not dist.is_initialized():
        raise RuntimeError(
            "hypershard: init_device_mesh: torch.distributed is not initialized; "
            "call torch.distributed.init_process_group first"
        )
    mesh = _C.Mesh.create(list(mesh_shape), names, [])
    if mesh.size != dist.get_world_size():
        raise _C.LayoutError(
            f"hypershard: mesh: shape {tuple(mesh_shape)} holds {mesh.size} ranks but the world "
            f"has {dist.get_world_size()}; allowed: a shape whose product is the world size"
        )
    return _mesh_with_groups(mesh, device_type, timeout)


def _default_group_timeout(device_type: str) -> Optional[datetime.timedelta]:
    """The default process group's collective timeout (None when torch does not expose it)."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device(device_type))
        return backend.options._timeout
    except Exception:  # noqa: BLE001 -- private API; new_group's own default applies then
        return None


def _mesh_with_groups(mesh: _C.Mesh, device_type: str, timeout: Optional[datetime.timedelta] = None) -> DeviceMesh:
    rank = dist.get_rank()
    timeout = timeout or _default_group_timeout(device_type)
    groups = []
    for axis in range(mesh.ndim):
        mine = None
        # new_group must be called by every rank for every group, in the same order.
        for ranks in mesh.axis_groups(axis):
            group = dist.new_group(ranks=list(ranks), timeout=timeout)
            if rank in ranks:
                mine = group
        groups.append(mine)
    return _C.DeviceMesh(mesh, rank, device_type, groups)


def _from_torch(torch_mesh) -> DeviceMesh:
    """Wraps a ``torch.distributed.device_mesh.DeviceMesh`` (reusing its process groups)."""
    names = list(torch_mesh.mesh_dim_names or [f"axis{i}" for i in range(torch_mesh.ndim)])
    mesh = _C.Mesh.create(list(torch_mesh.shape), names, torch_mesh.mesh.flatten().tolist())
    groups = [torch_mesh.get_group(i) for i in range(torch_mesh.ndim)]
    return _C.DeviceMesh(mesh, dist.get_rank(), torch_mesh.device_type, groups)


DeviceMesh.from_torch = staticmethod(_from_torch)
DeviceMesh.shape = property(lambda self: tuple(self.mesh.shape))
DeviceMesh.ndim = property(lambda self: self.mesh.ndim)
DeviceMesh.mesh_dim_names = property(lambda self: tuple(self.mesh.axis_names))
DeviceMesh.size = lambda self, axis=None: self.mesh.size if axis is None else self.mesh.shape[axis]
DeviceMesh.__getitem__ = lambda self, names: self.submesh([names] if isinstance(names, str) else list(names))
DeviceMesh.get_local_rank = lambda self, axis=0: self.coordinate(
    self.mesh.axis_index(axis) if isinstance(axis, str) else axis
)


# ---------------------------------------------------------------------------------- DTensor


class _DTensorMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor) and _C.is_dtensor(obj)


class DTensor(metaclass=_DTensorMeta):
    """``isinstance(x, DTensor)`` is true for every hypershard DTensor. Construct one with
    ``distribute_tensor`` or ``DTensor.from_local``."""

    def __init__(self, *args, **kwargs):
        raise TypeError("hypershard: use hypershard.distribute_tensor or DTensor.from_local")

    @staticmethod
    def from_local(
        local: torch.Tensor,
        device_mesh: DeviceMesh,
        placements: Any = None,
        *,
        shape: Optional[Sequence[int]] = None,
        partial: Any = None,
    ) -> torch.Tensor:
        """A DTensor whose local shard on this rank is ``local`` (differentiable).

        ``placements``: torch-style placements (one per mesh axis), or a Hyper-Parallel alias
        tuple such as ``("dp", "None")``; default all Replicate. ``shape``: the global shape; when
        omitted it is computed from every rank's local shape (a collective over the sharding
        axes), so uneven shards work."""
        spec = placements if placements is not None else [Replicate()] * device_mesh.ndim
        if shape is None:
            shape = _infer_global_shape(local, device_mesh, spec, partial)
        layout = make_layout(device_mesh.mesh, list(shape), spec, partial)
        return _C.from_local(local, device_mesh, layout)


def _infer_global_shape(local: torch.Tensor, device_mesh: DeviceMesh, spec: Any, partial: Any) -> list:
    # The sharding structure from a layout of the local shape (sizes do not matter here).
    probe = make_layout(device_mesh.mesh, list(local.shape), spec, partial)
    shape = list(local.shape)
    for dim, axes in enumerate(probe.dim_axes):
        length = torch.tensor([local.shape[dim]], dtype=torch.int64)
        # minor -> major: each sum over an axis group is the length of the parent chunk
        for axis in reversed(axes):
            dist.all_reduce(length, group=device_mesh.group(axis))
        shape[dim] = int(length.item())
    return shape


def distribute_tensor(
    tensor: torch.Tensor, device_mesh: DeviceMesh, placements: Any = None, *, partial: Any = None
) -> torch.Tensor:
    """Distributes the global ``tensor`` (the same on every rank) with the given placements or
    alias layout. Returns a leaf DTensor with ``tensor.requires_grad``."""
    spec = placements if placements is not None else [Replicate()] * device_mesh.ndim
    layout = make_layout(device_mesh.mesh, list(tensor.shape), spec, partial)
    if _C.check_replicas():
        _C.check_same_on_every_rank(tensor, device_mesh, "distribute_tensor: argument tensor")
    with torch.no_grad():
        replicated = _C.from_local(
            tensor.detach(),
            device_mesh,
            make_layout(device_mesh.mesh, list(tensor.shape), [Replicate()] * device_mesh.ndim),
        )
        result = _C.redistribute(replicated, layout)
        if result is replicated:
            result = result.detach()
    return result.requires_grad_(tensor.requires_grad)


# ---------------------------------------------------------------------------------- methods

layout_of = _C.layout_of


def _placements_of(layout: _C.Layout) -> tuple:
    out = []
    for p in _C.to_placements(layout).per_axis:
        if p.kind == _C.Placement.Kind.Shard:
            out.append(Shard(p.dim))
        elif p.kind == _C.Placement.Kind.Partial:
            out.append(Partial(_C.reduce_op_name(p.op)))
        else:
            out.append(Replicate())
    return tuple(out)


def _to_local(self: torch.Tensor) -> torch.Tensor:
    return _C.to_local(self)


def _full_tensor(self: torch.Tensor) -> torch.Tensor:
    layout = _C.layout_of(self)
    return _C.to_local(_C.redistribute(self, _C.Layout.replicate(layout.mesh, layout.global_shape)))


def _redistribute(
    self: torch.Tensor, device_mesh: Optional[DeviceMesh] = None, placements: Any = None, *, partial: Any = None
) -> torch.Tensor:
    current = _C.layout_of(self)
    if device_mesh is not None and device_mesh.mesh != current.mesh:
        raise _C.LayoutError(
            "hypershard: redistribute: moving to another mesh is not supported; allowed: the DTensor's own mesh"
        )
    target = make_layout(current.mesh, current.global_shape, placements, partial)
    return _C.redistribute(self, target)


_torch_repr = torch.Tensor.__repr__
_torch_tolist = torch.Tensor.tolist
_torch_numpy = torch.Tensor.numpy
_torch_reduce_ex = torch.Tensor.__reduce_ex__
_torch_deepcopy = torch.Tensor.__deepcopy__


def _repr(self: torch.Tensor, *, tensor_contents=None) -> str:
    if not _C.is_dtensor(self):
        return _torch_repr(self, tensor_contents=tensor_contents)
    with torch.no_grad():
        full = _full_tensor(self)
    layout = _C.layout_of(self)
    grad = ", requires_grad=True" if self.requires_grad else ""
    return f"DTensor({_torch_repr(full)}, layout={layout}, mesh={_C.device_mesh_of(self)}{grad})"


def _tolist(self: torch.Tensor):
    if not _C.is_dtensor(self):
        return _torch_tolist(self)
    with torch.no_grad():
        return _full_tensor(self).tolist()


def _numpy(self: torch.Tensor, *, force: bool = False):
    if not _C.is_dtensor(self):
        return _torch_numpy(self, force=force)
    with torch.no_grad():
        return _full_tensor(self).numpy(force=force)


def _reduce_ex(self: torch.Tensor, protocol):
    # A DTensor pickles as its GLOBAL value (a plain tensor): what torch.save writes is the whole
    # tensor, never this rank's shard. Reload it and distribute_tensor it onto a mesh.
    if not _C.is_dtensor(self):
        return _torch_reduce_ex(self, protocol)
    with torch.no_grad():
        full = _full_tensor(self).clone()
    return full.__reduce_ex__(protocol)


def _deepcopy(self: torch.Tensor, memo):
    if not _C.is_dtensor(self):
        return _torch_deepcopy(self, memo)
    if id(self) in memo:
        return memo[id(self)]
    with torch.no_grad():
        result = self.clone()
    result.requires_grad_(self.requires_grad)
    if type(self) is not torch.Tensor:  # nn.Parameter and other subclasses keep their type
        result = type(self)(result, self.requires_grad) if isinstance(self, torch.nn.Parameter) else result
    memo[id(self)] = result
    return result


def _require_dtensor(obj, name: str) -> None:
    if not _C.is_dtensor(obj):
        raise AttributeError(f"'Tensor' object has no attribute '{name}' (it is not a hypershard DTensor)")


class _DTensorMethod:
    """A torch.Tensor method that exists only on hypershard DTensors: on a plain tensor the
    attribute itself is missing (AttributeError on access), so ``hasattr(t, "full_tensor")``
    stays False for plain tensors, as code that detects DTensors that way expects. torch's own
    DTensor class defines these methods itself and is not affected."""

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        _require_dtensor(obj, self.name)
        return types.MethodType(self.fn, obj)

    def __set__(self, obj, value):
        # Read-only like the properties beside it. Also what torch.overrides expects of a
        # non-callable attribute of torch.Tensor with __get__: torch.compile indexes every such
        # attribute's __get__ and __set__ (without __set__ it failed on plain tensors too).
        raise AttributeError(f"'Tensor' attribute '{self.name}' is read-only")


def _dtensor_property(name: str, fn) -> property:
    """A read-only property that exists only on hypershard DTensors (as _DTensorMethod)."""

    def getter(self):
        _require_dtensor(self, name)
        return fn(self)

    return property(getter)


def _install_tensor_methods() -> None:
    torch.Tensor.to_local = _DTensorMethod("to_local", _to_local)
    torch.Tensor.full_tensor = _DTensorMethod("full_tensor", _full_tensor)
    torch.Tensor.redistribute = _DTensorMethod("redistribute", _redistribute)
    torch.Tensor.placements = _dtensor_property("placements", lambda t: _placements_of(layout_of(t)))
    torch.Tensor.device_mesh = _dtensor_property("device_mesh", _C.device_mesh_of)
    # hypershard's Layout is `sharding` (JAX's name for it): Tensor.layout keeps torch's meaning
    # (torch.strided), which torch.masked, assert_close and torch.compile rely on.
    torch.Tensor.sharding = _dtensor_property("sharding", layout_of)
    torch.Tensor.__repr__ = _repr
    torch.Tensor.tolist = _tolist
    torch.Tensor.numpy = _numpy
    torch.Tensor.__reduce_ex__ = _reduce_ex
    torch.Tensor.__deepcopy__ = _deepcopy


_install_tensor_methods()
_C.install_dispatch()
_compile_support.install()
