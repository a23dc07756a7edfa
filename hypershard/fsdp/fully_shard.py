"""Fully sharded data parallelism on hypershard DTensors: ``hs.fully_shard``.

    model = hs.parallelize(model, mesh)                  # tensor / expert parallelism first (optional)
    for layer in model.model.layers:
        hs.fully_shard(layer, mesh)                      # one group per transformer block
    hs.fully_shard(model, mesh)                          # the root: everything not in a block

Each parameter is stored sharded on dim 0 over the data-parallel axis (``dp_axis``), on top of
the layout tensor or expert parallelism gave it (its rows on this tp rank, split once more over
dp; uneven and empty chunks work). The optimizer sees only those shards. Per module and pass:

- before forward (and before its backward, when ``reshard_after_forward`` freed them), the
  module's parameters are all-gathered in ONE flattened collective (csrc/runtime/fully_shard.cpp)
  and put in place of the shards while it runs; the next module's gather is issued ahead
  (prefetch, in the order the first forward ran them, reversed for backward) so it overlaps
  compute; after forward the gathered copies are freed (except the root's, which backward needs
  at once);
- after backward the gradients are reduce-scattered in ONE collective into the shards' ``.grad``
  (then the gathered copies are freed); with ``set_requires_gradient_sync(False)`` they accumulate
  unreduced instead (gradient accumulation without communication) and the next synchronized
  backward reduces the sum.

``mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
gathers and computes in bf16 from fp32 shards (the master weights the optimizer updates) and sums
gradients in fp32. Model code stays unmodified; the collectives and buffers are C++, the hooks
here run once per module and pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .. import _C
from ..tensor.axes import note_axes_used, warn_unused_axes_at_first_forward
from ..tensor.dtensor import distribute_tensor
from ..tensor.traced import TracedDTensor

__all__ = ["FullyShardedModule", "MixedPrecisionPolicy", "fully_shard"]


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: dtype of the gathered parameters (compute); ``reduce_dtype``: dtype
    gradients are summed in (default: param_dtype); ``output_dtype``: cast floating outputs of the
    module to it; ``cast_forward_inputs``: cast floating tensor inputs to param_dtype."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


def _error(message: str) -> ValueError:
    return ValueError(f"hypershard: fully_shard: {message}")


class _Context:
    """Shared by the groups under one root: the forward order (for prefetching) and the root."""

    def __init__(self, root: "_Group"):
        self.root = root
        self.order: list = []
        self.recorded = False

    def neighbour(self, group: "_Group", step: int) -> Optional["_Group"]:
        if not self.recorded or group not in self.order:
            return None
        i = self.order.index(group) + step
        return self.order[i] if 0 <= i < len(self.order) else None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Unshard(torch.autograd.Function):
    """sharded parameters -> gathered ones; backward: one reduce-scatter of their gradients."""

    @staticmethod
    def forward(ctx, group: "_Group", *sharded):
        ctx.group = group
        ctx.set_materialize_grads(False)
        return tuple(group.cgroup.finish_gather())

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        # The shards back in place: a forward that did not finish (activation checkpointing's
        # recomputation stops as soon as it has what backward needs) skipped post_forward.
        group.put(group.params)
        # Every node that read the gathered parameters has run (each has an edge into this one),
        # so they are freed before the reduce-scatter allocates its buffers, not after: the two
        # never coexist (the root's 248k-vocab embedding: 0.5 GB of bf16 less at the peak).
        if group.reshard_after_backward:
            group.cgroup.free_unsharded()
        sharded_grads = group.cgroup.reduce_scatter(list(grads), group.requires_sync)
        return (None, *sharded_grads)


class _PreBackward(torch.autograd.Function):
    """Identity on a module's outputs; its backward runs before the module's own: gather the
    parameters again if forward freed them, and issue the gather of the module before it."""

    @staticmethod
    def forward(ctx, group: "_Group", *outputs):
        ctx.group = group
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        if not group.cgroup.gathered:
            group.cgroup.finish_gather()
        before = group.context.neighbour(group, -1)
        if before is not None and not before.cgroup.gathered:
            before.cgroup.start_gather()
        return (None, *grads)


class _Group:
    def __init__(
        self,
        module: nn.Module,
        entries: list,
        params: list,
        layouts: list,
        axis: int,
        reshard_after_forward: bool,
        mp: Optional[MixedPrecisionPolicy],
    ):
        self.module = module
        self.entries = entries  # per parameter: [(owner module, attribute name), ...]
        self.params = params  # the sharded nn.Parameters
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_sync = True
        self.layouts, self.axis = layouts, axis
        self.set_mp(mp)
        self.context = _Context(self)

    def set_mp(self, mp: Optional[MixedPrecisionPolicy]) -> None:
        """The group's policy (hs.mixed_precision gives one to a group made without): the C++ half
        allocates its buffers in param_dtype / reduce_dtype, so it is made again (between steps)."""
        self.mp = mp
        self.cgroup = _C.FullyShardGroup(
            self.params,
            self.layouts,
            self.axis,
            mp.param_dtype if mp else None,
            (mp.reduce_dtype or mp.param_dtype) if mp else None,
        )

    def put(self, tensors: list) -> None:
        for owners, tensor in zip(self.entries, tensors):
            for owner, name in owners:
                owner._parameters[name] = tensor

    def pre_forward(self, module, args, kwargs):
        owner, name = self.entries[0][0]
        if isinstance(owner._parameters[name], TracedDTensor):
            # hypershard.compile swapped this group's parameters for traced ones: it compiled a
            # module around this group before the group was made, and would trace these hooks
            raise _error(
                f"{type(module).__name__}'s gather runs inside a program hypershard.compile made before "
                "fully_shard was applied; allowed: fully_shard first, then hypershard.compile (it then "
                "compiles each block and keeps the groups' hooks eager)"
            )
        context = self.context
        if not context.recorded and self not in context.order:
            context.order.append(self)
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.params):
            gathered = _Unshard.apply(self, *self.params)
        else:
            gathered = self.cgroup.finish_gather()
        self.put(list(gathered))
        after = context.neighbour(self, +1)
        if after is not None and not _in_backward():
            after.cgroup.start_gather()
        if self.mp is not None and self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), self.mp.param_dtype)
        return args, kwargs

    def post_forward(self, module, args, kwargs, output):
        self.put(self.params)
        if self is self.context.root:
            self.context.recorded = True
        elif self.reshard_after_forward and not _in_backward():
            # (A forward run again inside backward -- activation checkpointing's recomputation --
            # keeps them: the recomputed tensors are read right away; _Unshard.backward frees.)
            self.cgroup.free_unsharded()
        if self.mp is not None and self.mp.output_dtype is not None:
            output = _cast_floating(output, self.mp.output_dtype)
        if torch.is_grad_enabled():
            flat, spec = pytree.tree_flatten(output)
            positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
            if positions:
                wrapped = _PreBackward.apply(self, *[flat[i] for i in positions])
                for i, t in zip(positions, wrapped):
                    flat[i] = t
                output = pytree.tree_unflatten(flat, spec)
        return output


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


class FullyShardedModule:
    """Mixed into the class of every fully_shard'ed module (as torch's FSDPModule)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward passes accumulate the gradients unreduced (no communication); the next
        backward with True reduce-scatters the sum into the shards' .grad."""
        for group in _groups(self, recurse):
            group.requires_sync = bool(requires_gradient_sync)

    def set_reshard_after_backward(self, reshard: bool, *, recurse: bool = True) -> None:
        for group in _groups(self, recurse):
            group.reshard_after_backward = bool(reshard)

    def unshard(self) -> None:
        """Gathers this module's parameters now (they stay until reshard() or a forward/backward frees them)."""
        self._hs_fully_shard.cgroup.finish_gather()

    def reshard(self) -> None:
        """Frees this module's gathered parameters."""
        self._hs_fully_shard.cgroup.free_unsharded()


def _groups(module: nn.Module, recurse: bool) -> list:
    modules = module.modules() if recurse else [module]
    return [m._hs_fully_shard for m in modules if hasattr(m, "_hs_fully_shard")]


_CLASSES: dict = {}


def _sharded_class(cls: type) -> type:
    if issubclass(cls, FullyShardedModule):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FullyShard{cls.__name__}", (FullyShardedModule, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def _owned_parameters(module: nn.Module) -> dict:
    """id(param) -> (param, [(owner, name), ...]) for the parameters under `module` that no
    fully_shard'ed descendant owns."""
    found: dict = {}

    def visit(m: nn.Module, top: bool) -> None:
        if not top and hasattr(m, "_hs_fully_shard"):
            return
        for name, param in m._parameters.items():
            if param is not None:
                found.setdefault(id(param), (param, []))[1].append((m, name))
        for child in m._modules.values():
            if child is not None:
                visit(child, False)

    visit(module, True)
    return found


def fully_shard(
    module: nn.Module,
    mesh,
    *,
    dp_axis: str = "dp",
    replicate_axis: Optional[str] = None,
    reshard_after_forward: bool = True,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
) -> nn.Module:
    """Shards `module`'s parameters (those no fully_shard'ed descendant owns) on dim 0 over
    `dp_axis` of `mesh`, in place, and returns the module (its class gains
    FullyShardedModule's methods). Apply it to the blocks first, then to the root. Parameters
    that are plain tensors are first made Replicate DTensors on `mesh`; DTensor parameters must be
    on `mesh` and Replicate on `dp_axis`. 0-dim parameters stay Replicate (their gradients are
    summed by the usual data-parallel buckets).

    HSDP (hybrid sharding, FSDP2's fully_shard on a 2-D mesh): `replicate_axis` names a second
    data-parallel axis the parameters stay Replicate on (nodes), while `dp_axis` shards them
    (ranks within a node). The batch is split over both (parallelize(..., dp_axis=(replicate_axis,
    dp_axis))); the gradients are reduce-scattered over `dp_axis` and all-reduced over
    `replicate_axis` (still Partial there after the reduce-scatter: the data-parallel buckets)."""
    if hasattr(module, "_hs_fully_shard"):
        raise _error(f"{type(module).__name__} is already fully sharded")
    names = list(mesh.mesh_dim_names)
    if dp_axis not in names:
        raise _error(f"the mesh {mesh} has no axis {dp_axis!r}; allowed: one of {names}")
    axis = names.index(dp_axis)
    if replicate_axis is not None and (replicate_axis not in names or replicate_axis == dp_axis):
        raise _error(
            f"replicate_axis {replicate_axis!r} is not an axis of {mesh} other than dp_axis {dp_axis!r}; "
            f"allowed: one of {[n for n in names if n != dp_axis]}"
        )
    replicate = names.index(replicate_axis) if replicate_axis is not None else None
    entries, params, layouts = [], [], []
    for param, owners in _owned_parameters(module).values():
        where = f"{type(owners[0][0]).__name__}.{owners[0][1]}"
        if not _C.is_dtensor(param):
            with torch.no_grad():
                param_dt = distribute_tensor(param.detach(), mesh)
        else:
            param_dt = param
            if _C.device_mesh_of(param).mesh != mesh.mesh:
                raise _error(
                    f"parameter {where} is on mesh {_C.device_mesh_of(param)}, not {mesh}; "
                    "allowed: the mesh passed to fully_shard"
                )
        unsharded = _C.layout_of(param_dt)
        if replicate is not None and not unsharded.is_replicate(replicate):
            raise _error(
                f"parameter {where} has layout {unsharded}, which is not Replicate on the replicate axis "
                f"{replicate_axis!r}; allowed: parameters Replicate on {replicate_axis!r}"
            )
        if unsharded.has_partial() or not unsharded.is_replicate(axis):
            raise _error(
                f"parameter {where} has layout {unsharded}, which is not Replicate on {dp_axis!r}; "
                f"allowed: parameters Replicate on {dp_axis!r} (shard other axes with parallelize)"
            )
        if param.dim() == 0:
            if not _C.is_dtensor(param):
                new = nn.Parameter(param_dt, requires_grad=param.requires_grad)
                for owner, name in owners:
                    owner._parameters[name] = new
            continue
        sharded_layout = unsharded.with_minor_shard(axis, 0)
        with torch.no_grad():
            cut = _C.redistribute(param_dt.detach(), sharded_layout)  # local rows: no communication
            local = _C.local_of(cut).clone()  # own memory, not a view of the whole
            sharded = _C.from_local(local, _C.device_mesh_of(param_dt), sharded_layout)
        new = nn.Parameter(sharded, requires_grad=param.requires_grad)
        for owner, name in owners:
            owner._parameters[name] = new
        entries.append(owners)
        params.append(new)
        layouts.append(unsharded)
    if not params:
        raise _error(f"{type(module).__name__} has no parameters of its own to shard (its descendants own them all)")
    group = _Group(module, entries, params, layouts, axis, reshard_after_forward, mp_policy)
    group.replicate_axis = replicate_axis
    if replicate_axis is not None:  # the parameters' replicas: HSDP's replicate axis does not warn
        note_axes_used(mesh, [replicate_axis], replica=True)
    # Descendant groups join this root's context (the last fully_shard call is the root).
    for sub in module.modules():
        if sub is not module and hasattr(sub, "_hs_fully_shard"):
            sub._hs_fully_shard.context = group.context
    module._hs_fully_shard = group
    module.register_forward_pre_hook(group.pre_forward, with_kwargs=True, prepend=True)
    module.register_forward_hook(group.post_forward, with_kwargs=True, always_call=False)
    module.__class__ = _sharded_class(type(module))
    note_axes_used(mesh, [dp_axis])
    warn_unused_axes_at_first_forward(module, mesh, "fully_shard")
    return module
