"""Regions of user code on local shards: `local_map` and `DFunction`.

A user's op that hypershard has no rule for -- a Triton kernel inside an ``autograd.Function``
(flash-linear-attention's ``chunk_gated_delta_rule``), a custom NPU or CUDA kernel, any Python --
runs on this rank's shards when the user says what layouts it takes and gives:

    mesh = hs.init_device_mesh("cpu", (2,), ("tp",))
    heads_sharded = [hs.Shard(1)]                # (batch, heads, seq, dim): heads over tp

    @hs.local_map(out_placements=heads_sharded, in_placements=(heads_sharded, heads_sharded))
    def gated(q, k):                             # q, k: this rank's heads, plain tensors
        return my_kernel(q, k)

    out = gated(q_dtensor, k_dtensor)            # a DTensor, Shard(1) on tp

On entry every DTensor argument is redistributed to its declared placements (the framework's
differentiable redistribution: its backward is the transposed one), then its local shard is
taken (``to_local``, differentiable); on exit every returned tensor becomes a DTensor with its
declared placements (``from_local``, differentiable). So gradients flow through the region: the
backward of the user's local code runs on the local gradients, and the inputs' gradients come
back with the layouts the inputs were redistributed to, as torch's ``local_map`` does.

`DFunction` is the same for a user who writes an ``autograd.Function``: static ``forward(ctx,
*locals)`` and ``backward(ctx, *local_grads)`` on local tensors, with class attributes
``in_placements`` / ``out_placements``; ``MyFunction.apply(*dtensors)`` runs it (Hyper-Parallel's
DFunction).

Placements are written as for ``distribute_tensor``: a list per tensor of torch-style placements
(``hs.Shard(0)``, ``"S(0)"``, ``hs.Partial()``, ``"P"``) or a Hyper-Parallel alias tuple
(``("dp", "None")``). ``None`` for a non-tensor argument or output.

Debug mode (``hs.set_debug_checks(True)``) checks each output declared Replicate on an axis
against the other ranks of that axis (an all-reduce of its min and max per axis): a region whose
outputs differ where they are declared Replicate raises the same error on every rank of the axis,
naming the region and the axis.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from .. import _C
from .axes import laid_out_axes
from .dtensor import _infer_global_shape
from .layout import make_layout

__all__ = ["local_map", "DFunction"]


def _error(region: str, message: str) -> ValueError:
    return ValueError(f"hypershard: local_map({region}): {message}")


def _mesh_of(args, device_mesh):
    if device_mesh is not None:
        return device_mesh
    for a in args:
        if isinstance(a, torch.Tensor) and _C.is_dtensor(a):
            return _C.device_mesh_of(a)
    return None


class _RegionInput(torch.autograd.Function):
    """A DTensor argument -> its local shard; the local gradient comes back as a DTensor whose layout
    the region decides once its outputs are known (`grad_layouts[index]`, filled after the call):
    the input's own layout, Partial(sum) on the axes where the input is Replicate but the outputs are
    not (each rank's gradient is then its part of a sum over those ranks)."""

    @staticmethod
    def forward(ctx, t, grad_layouts, index):
        ctx.mesh, ctx.grad_layouts, ctx.index = _C.device_mesh_of(t), grad_layouts, index
        return _C.local_of(t).detach()

    @staticmethod
    def backward(ctx, grad):
        return _C.from_local(grad.contiguous(), ctx.mesh, ctx.grad_layouts[ctx.index]), None, None


def _to_local(region: str, index: int, arg: Any, spec: Any, mesh, redistribute_inputs: bool, grad_layouts: dict):
    """The local shard of `arg` in the declared layout `spec` (None: as it is)."""
    if not (isinstance(arg, torch.Tensor) and _C.is_dtensor(arg)):
        return arg  # a plain tensor or a non-tensor: given to the region as it is
    current = _C.layout_of(arg)
    if _C.device_mesh_of(arg).mesh != mesh.mesh:
        raise _error(
            region, f"argument {index} lives on mesh {_C.device_mesh_of(arg)}; allowed: the region's mesh {mesh}"
        )
    if spec is not None:
        wanted = make_layout(mesh.mesh, list(current.global_shape), spec)
        if wanted != current:
            if not redistribute_inputs:
                raise _error(
                    region,
                    f"argument {index} has layout {current} but the region declares {wanted}; allowed: that "
                    "layout, or redistribute_inputs=True",
                )
            arg = _C.redistribute(arg, wanted)
    if not arg.requires_grad:
        return _C.local_of(arg)
    grad_layouts[index] = _C.layout_of(arg)  # refined once the outputs are known (_decide_grad_layouts)
    return _RegionInput.apply(arg, grad_layouts, index)


def _entry(table: Any, key: Any) -> Any:
    """`table`'s entry for an argument (position or keyword name): a Mapping by key, a sequence by
    position; None where it has none."""
    if table is None:
        return None
    if isinstance(table, Mapping):
        return table.get(key)
    return table[key] if isinstance(key, int) and key < len(table) else None


def _decide_grad_layouts(region: str, grad_layouts: dict, out_layouts: list, in_grad: Optional[Sequence[Any]], mesh):
    """Each differentiable input's gradient layout (see _RegionInput): `in_grad_placements` where given;
    else the input's layout without Partial, made Partial(sum) on the axes it is Replicate on and
    every output is laid out on (sharded or Partial). Where some outputs are Replicate on such an
    axis and others are not, the local gradient mixes a per-rank part and a shared part, and no
    layout says that: refused, asking for in_grad_placements."""
    names = mesh.mesh_dim_names
    for index, layout in list(grad_layouts.items()):
        shape = list(layout.global_shape)
        given = _entry(in_grad, index)
        if given is not None:
            grad_layouts[index] = make_layout(mesh.mesh, shape, given)
            continue
        partial = [None] * len(layout.partial)
        for axis in range(len(partial)):
            if not layout.is_replicate(axis) or layout.is_partial(axis):
                continue
            laid = [axis in laid_out_axes(o) for o in out_layouts]
            if laid and all(laid):
                partial[axis] = _C.ReduceOp.Sum
            elif any(laid):
                raise _error(
                    region,
                    f"argument {index} is Replicate on mesh axis {names[axis]!r}, where some outputs are laid out "
                    "and others are Replicate: its local gradient is neither one rank's part of a sum nor the "
                    "same on every rank; allowed: in_grad_placements for it",
                )
        grad_layouts[index] = _C.Layout.create(layout.mesh, shape, layout.dim_axes, partial)


def _check_replicated(region: str, index: int, local: torch.Tensor, layout, mesh) -> None:
    """Debug mode: an output declared Replicate on an axis must be equal across that axis's ranks."""
    names = mesh.mesh_dim_names
    for axis in range(mesh.ndim):
        if mesh.shape[axis] == 1 or not layout.is_replicate(axis) or layout.is_partial(axis):
            continue
        values = local.detach().to(torch.float64).reshape(-1)
        high, low = values.clone(), values.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=mesh.group(axis))
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=mesh.group(axis))
        spread = (high - low).abs().max().item() if values.numel() else 0.0
        if spread != spread or spread > 0:  # NaN or a difference
            raise _error(
                region,
                f"output {index} is declared Replicate on mesh axis {names[axis]!r}, but its values differ "
                f"across that axis's ranks (largest difference {spread:.3g}; rank {dist.get_rank()} checked); "
                "allowed: declare the layout the region really gives (Shard, or Partial for per-rank "
                "partial sums)",
            )


def local_map(
    fn: Optional[Callable] = None,
    out_placements: Any = None,
    in_placements: Optional[Sequence[Any]] = None,
    *,
    in_grad_placements: Optional[Sequence[Any]] = None,
    device_mesh=None,
    redistribute_inputs: bool = True,
    name: Optional[str] = None,
):
    """Wraps `fn` (code on local tensors) to run on DTensors: each DTensor argument is redistributed
    to its entry of `in_placements` (None, or `in_placements` None: its own layout) and passed as its
    local shard (`in_placements` may be a Mapping keyed by position and by keyword name, for tensors
    passed by keyword; `in_grad_placements` likewise); each returned tensor becomes a DTensor with its entry of `out_placements` (one
    placements for a single returned tensor, a sequence for a tuple). Differentiable both ways (module
    docstring). `device_mesh`: default the first DTensor argument's mesh. `redistribute_inputs`: False
    refuses a DTensor argument in another layout instead of redistributing it. `in_grad_placements`
    (torch's name): per argument, the layout of its local gradient; default: the argument's own,
    Partial(sum) on the axes where it is Replicate and the outputs are laid out (module docstring).
    Usable as a
    decorator: ``@local_map(out_placements=..., in_placements=...)``."""
    if fn is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
            name=name,
        )
    region = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    if out_placements is None:
        raise _error(region, "out_placements is required; allowed: the placements of each returned tensor")

    @functools.wraps(fn)
    @torch._dynamo.disable
    def run(*args, **kwargs):
        # Under hs.compile the region is a graph break: Dynamo hands it the traced program's
        # DTensors (TracedDTensor); it runs eagerly on the real ones, its results traced again.
        from .traced import TracedDTensor, from_traced, to_traced

        if any(isinstance(a, TracedDTensor) for a in list(args) + list(kwargs.values())):
            args, kwargs = pytree.tree_map(from_traced, (args, kwargs))
            return pytree.tree_map(to_traced, run(*args, **kwargs))
        mesh = _mesh_of(list(args) + list(kwargs.values()), device_mesh)
        if mesh is None:
            return fn(*args, **kwargs)  # no DTensor and no mesh: one device, the plain function
        if isinstance(in_placements, Mapping):  # by position and by keyword name
            specs, kw_specs = [in_placements.get(i) for i in range(len(args))], in_placements
        else:
            specs, kw_specs = list(in_placements) if in_placements is not None else [None] * len(args), {}
            if len(specs) != len(args):
                raise _error(
                    region, f"{len(args)} arguments but {len(specs)} in_placements; allowed: one entry per argument"
                )
        grad_layouts: dict = {}
        locals_ = [
            _to_local(region, i, a, s, mesh, redistribute_inputs, grad_layouts)
            for i, (a, s) in enumerate(zip(args, specs))
        ]
        kwargs = {
            k: _to_local(region, k, v, kw_specs.get(k), mesh, redistribute_inputs, grad_layouts)
            for k, v in kwargs.items()
        }
        out = fn(*locals_, **kwargs)
        single = not isinstance(out, (tuple, list))
        outs = [out] if single else list(out)
        out_specs = [out_placements] if single else list(out_placements)
        if len(out_specs) != len(outs):
            raise _error(region, f"{len(outs)} outputs but {len(out_specs)} out_placements; allowed: one per output")
        wrapped, out_layouts = [], []
        for i, (o, spec) in enumerate(zip(outs, out_specs)):
            if spec is None or not isinstance(o, torch.Tensor):
                wrapped.append(o)
                continue
            if _C.is_dtensor(o):
                raise _error(region, f"output {i} is a DTensor; allowed: local tensors (the region wraps them)")
            # the global shape from every rank's local size (uneven shards work), as DTensor.from_local
            layout = make_layout(mesh.mesh, _infer_global_shape(o, mesh, spec, None), spec)
            if _C.check_replicas():
                _check_replicated(region, i, o, layout, mesh)
            wrapped.append(_C.from_local(o, mesh, layout))
            out_layouts.append(layout)
        _decide_grad_layouts(region, grad_layouts, out_layouts, in_grad_placements, mesh)
        return wrapped[0] if single else type(out)(wrapped)

    return run


class DFunction:
    """A distributed autograd function: subclass it with static ``forward(ctx, *locals)`` and
    ``backward(ctx, *local_grads)`` written for local tensors (as a torch.autograd.Function), and
    class attributes ``in_placements`` (one per forward argument; None: as given) and
    ``out_placements`` (of forward's result). ``MyFunction.apply(*args)`` redistributes the DTensor
    arguments to ``in_placements``, runs forward on their shards, and wraps the results with
    ``out_placements``; backward runs on the local gradients. On plain tensors it is the plain
    autograd.Function."""

    in_placements: Optional[Sequence[Any]] = None
    out_placements: Any = None

    @staticmethod
    def forward(ctx, *args):  # pragma: no cover - the subclass's
        raise NotImplementedError

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - the subclass's
        raise NotImplementedError

    @classmethod
    def _local_function(cls):
        made = cls.__dict__.get("_hs_local_function")
        if made is None:
            made = type(
                f"{cls.__name__}Local",
                (torch.autograd.Function,),
                {"forward": staticmethod(cls.forward), "backward": staticmethod(cls.backward)},
            )
            cls._hs_local_function = made
        return made

    @classmethod
    def apply(cls, *args):
        region = local_map(cls._local_function().apply, cls.out_placements, cls.in_placements, name=cls.__qualname__)
        return region(*args)
