"""The mesh axis names hypershard gives a meaning to, in one place, and the warning for an axis that
nothing uses.

Command-line tools refuse any other name before a rank starts (`check_axis_names`): a typo such as
``--mesh zz=2,dp=2`` would otherwise replicate everything over ``zz`` and train the same thing twice.
The API (``parallelize``, ``fully_shard``, ``from_pretrained``) cannot refuse -- a mesh may carry
axes for other code -- so it warns once per axis at the model's first forward when no plan, input
hook, fully_shard group, parameter or input is laid out on an axis of size > 1 (`note_axes_used`,
`warn_unused_axes_at_first_forward`). An intended replica axis (HSDP's replicate axis, or one
passed to `declare_replica_axis`) is noted as such and does not warn.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from .. import _C

# name -> what the axis does. A new parallelism adds its axis here once (pp with pipelining).
MESH_AXES = {
    "dp": "data parallel: splits the batch; fully_shard shards parameters over it",
    "tp": "tensor parallel: the model's TP plan",
    "ep": "expert parallel: the model's EP plan",
    "cp": "context parallel: splits the sequence",
    "pp": "pipeline parallel: splits the decoder layers into stages (hs.pipeline)",
}


class MeshAxisError(ValueError):
    """A mesh axis name that the tool gives no meaning to (or a name given twice)."""


def check_axis_names(tool: str, names: Sequence[str], allowed: Optional[Iterable[str]] = None) -> None:
    """Raises MeshAxisError, one line naming the axis and the allowed ones, for a name outside
    `allowed` (default: every axis of MESH_AXES) or a name given twice."""
    allowed = list(MESH_AXES if allowed is None else allowed)
    described = "; ".join(f"{a} ({MESH_AXES[a]})" if a in MESH_AXES else a for a in allowed)
    seen = set()
    for name in names:
        if name not in allowed:
            raise MeshAxisError(
                f"hypershard: {tool}: mesh axis {name!r} is not one of {', '.join(allowed)}; allowed: {described}"
            )
        if name in seen:
            raise MeshAxisError(f"hypershard: {tool}: mesh axis {name!r} is given twice; allowed: each axis once")
        seen.add(name)


# ------------------------------------------------------------------------ the API's warning

# (axis name, size) of the axes something is laid out on, in this process. Keyed by name and size,
# not by mesh object, so that a sub-mesh (mesh["dp"]) given to fully_shard counts for its parent.
_used: set = set()
_replica: set = set()
_warned: set = set()


def note_axes_used(mesh, names: Iterable[Optional[str]], *, replica: bool = False) -> None:
    """Records that something lays tensors out on these axes of `mesh` (None entries are skipped);
    `replica`: the axes are intended replicas (HSDP's replicate axis) and must not warn."""
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    for name in names:
        if name is not None and name in sizes:
            (_replica if replica else _used).add((name, sizes[name]))


def declare_replica_axis(mesh, name: str) -> None:
    """Says that `mesh`'s axis `name` is meant to hold replicas (every tensor Replicate on it), so that
    hypershard does not warn about it."""
    if name not in mesh.mesh_dim_names:
        raise MeshAxisError(
            f"hypershard: declare_replica_axis: the mesh has no axis {name!r}; allowed: {list(mesh.mesh_dim_names)}"
        )
    note_axes_used(mesh, [name], replica=True)


def laid_out_axes(layout) -> set:
    """The mesh axes `layout` is sharded or Partial on (the others hold whole replicas)."""
    return {a for a in range(len(layout.partial)) if not layout.is_replicate(a) or layout.is_partial(a)}


def _note_laid_out(tensors) -> None:
    """Notes the axes a DTensor among `tensors` is sharded or Partial on."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and _C.is_dtensor(t):
            layout = _C.layout_of(t)
            mesh = _C.device_mesh_of(t)
            note_axes_used(mesh, [mesh.mesh_dim_names[a] for a in laid_out_axes(layout)])


def unused_axes(mesh) -> list:
    """(name, size) of `mesh`'s axes of size > 1 that nothing noted is laid out on."""
    return [
        (name, size)
        for name, size in zip(mesh.mesh_dim_names, mesh.shape)
        if size > 1 and (name, size) not in _used and (name, size) not in _replica
    ]


def warn_unused_axes_at_first_forward(module: nn.Module, mesh, api: str) -> None:
    """At `module`'s first forward (when everything laid out before it is known), warns once per axis
    of `mesh` that nothing is laid out on. Installed once per module."""
    if getattr(module, "_hs_axes_check", None) is not None:
        return

    def check(mod, args, kwargs):
        mod._hs_axes_check.remove()
        mod._hs_axes_check = False  # checked; never again
        _note_laid_out(list(args) + list(kwargs.values()))
        _note_laid_out(list(mod.parameters()))
        for name, size in unused_axes(mesh):
            if (name, size) in _warned:
                continue
            _warned.add((name, size))
            warnings.warn(
                f"hypershard: {api}: mesh axis {name!r} (size {size}) is used by no plan, input hook or "
                f"fully_shard group: every tensor is replicated over it, so its {size} ranks compute the same "
                f"thing. Allowed: an axis a plan shards ({', '.join(MESH_AXES)}), or declare it a replica "
                "axis with hs.declare_replica_axis(mesh, name)",
                stacklevel=2,
            )

    module._hs_axes_check = module.register_forward_pre_hook(check, with_kwargs=True)


def forget_noted_axes() -> None:
    """Clears what this process noted (the level0 harness runs many cases per process)."""
    _used.clear()
    _replica.clear()
    _warned.clear()
