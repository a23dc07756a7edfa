"""Python conveniences over the C++ layout core (``hypershard._C``).

They only translate what users write into the C++ types; every check and every conversion is
done in C++ and fails with ``hypershard.LayoutError``.

    import hypershard as hs
    m = hs.mesh({"dp": 2, "tp": 2})
    hs.make_layout(m, [6, 5], ("dp", "None"))                     # alias notation
    hs.make_layout(m, [6, 5], (("dp", "tp"), "None"))             # dim 0 over dp, then tp
    hs.make_layout(m, [6, 5], ("None", "tp"), partial={"dp": "sum"})
    hs.make_layout(m, [6, 5], ["S(0)", "R"])                      # torch-style placements
    hs.make_layout(m, [6, 5], [Shard(0), Partial("sum")])         # torch placement objects
    hs.from_tensor_map(m, [6, 5], [1, -1])                        # MindSpore tensor_map
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

from .. import _C

__all__ = [
    "alias",
    "from_alias",
    "from_placements",
    "from_tensor_map",
    "make_layout",
    "mesh",
    "placement",
    "placements",
    "reduce_op",
]

_SHARD = re.compile(r"^(?:Shard|S)\(\s*(-?\d+)\s*\)$")
_REPLICATE = re.compile(r"^(?:Replicate|R)(?:\(\s*\))?$")
_PARTIAL = re.compile(r"^(?:Partial|P)(?:\(\s*(\w*)\s*\))?$")

ReduceOpLike = Union[_C.ReduceOp, str]
PartialLike = Optional[Union[Mapping[str, ReduceOpLike], Iterable[str]]]


def reduce_op(op: ReduceOpLike) -> _C.ReduceOp:
    """A ReduceOp from itself or its name ("sum", "avg", "max", "min", "prod"/"product")."""
    return op if isinstance(op, _C.ReduceOp) else _C.parse_reduce_op(str(op))


def mesh(
    shape: Union[Mapping[str, int], Sequence[int]],
    axis_names: Optional[Sequence[str]] = None,
    ranks: Optional[Sequence[int]] = None,
) -> _C.Mesh:
    """``mesh({"dp": 2, "tp": 2})`` or ``mesh([2, 2], ["dp", "tp"], ranks=[...])``."""
    if isinstance(shape, Mapping):
        if axis_names is not None:
            raise TypeError("mesh(): give the axis names either as dict keys or as axis_names")
        axis_names, shape = list(shape.keys()), list(shape.values())
    return _C.Mesh.create(list(shape), list(axis_names or []), list(ranks or []))


def _is_placement_like(item: Any) -> bool:
    if isinstance(item, _C.Placement):
        return True
    if isinstance(item, str):
        item = item.strip()
        return bool(_SHARD.match(item) or _REPLICATE.match(item) or _PARTIAL.match(item))
    return type(item).__name__ in ("Shard", "Replicate", "Partial")


def placement(item: Any) -> _C.Placement:
    """A Placement from a hypershard Placement, a string ("Shard(0)", "S(-1)", "Replicate()",
    "R", "Partial()", "Partial(max)", "P(avg)") or a torch.distributed.tensor placement object
    (Shard, Replicate, Partial)."""
    if isinstance(item, _C.Placement):
        return item
    if isinstance(item, str):
        text = item.strip()
        if match := _SHARD.match(text):
            return _C.Placement.shard(int(match.group(1)))
        if _REPLICATE.match(text):
            return _C.Placement.replicate()
        if match := _PARTIAL.match(text):
            return _C.Placement.partial(reduce_op(match.group(1) or "sum"))
        raise _C.LayoutError(
            f"hypershard: placement {item!r}: not a placement; "
            "allowed: Shard(d), S(d), Replicate(), R, Partial(op), P(op)"
        )
    kind = type(item).__name__
    if kind == "Shard":  # torch's _StridedShard has another class name and is rejected below
        return _C.Placement.shard(int(item.dim))
    if kind == "Replicate":
        return _C.Placement.replicate()
    if kind == "Partial":
        return _C.Placement.partial(reduce_op(getattr(item, "reduce_op", "sum")))
    raise _C.LayoutError(
        f"hypershard: placement {item!r}: unsupported placement type {kind}; allowed: Shard, Replicate, Partial"
    )


def placements(
    items: Union[_C.Placements, Iterable[Any]],
    shard_order: Optional[Union[Mapping[int, Sequence[int]], Iterable[tuple[int, Sequence[int]]]]] = None,
) -> _C.Placements:
    """Placements from one placement per mesh axis, plus an optional shard order
    ``{dim: [major axis, ..., minor axis]}`` for multi-axis dims not in ascending axis order."""
    if isinstance(items, _C.Placements):
        if shard_order is not None:
            raise TypeError("placements(): shard_order given twice")
        return items
    order = shard_order.items() if isinstance(shard_order, Mapping) else (shard_order or [])
    return _C.Placements([placement(p) for p in items], [(int(dim), [int(a) for a in axes]) for dim, axes in order])


def _partial_map(partial: PartialLike) -> dict:
    if partial is None:
        return {}
    if isinstance(partial, str):
        return {partial: _C.ReduceOp.Sum}
    if isinstance(partial, Mapping):
        return {str(name): reduce_op(op) for name, op in partial.items()}
    return {str(name): _C.ReduceOp.Sum for name in partial}


def alias(dims: Union[_C.AliasLayout, str, Sequence[Any]], partial: PartialLike = None) -> _C.AliasLayout:
    """An AliasLayout from Hyper-Parallel alias notation: per tensor dim "None" (or None), an
    axis name, or a tuple of axis names (major -> minor), e.g. ("dp", "None") or
    (("dp", "tp"), "None"); or its printed form '("dp", "None") partial(sum: tp)'.
    `partial`: {"tp": "sum"} or ["tp"] (sum)."""
    if isinstance(dims, _C.AliasLayout):
        result = dims
    elif isinstance(dims, str):
        result = _C.parse_alias(dims)
    else:
        per_dim = []
        for item in dims:
            if item is None or item == "None":
                per_dim.append([])
            elif isinstance(item, str):
                per_dim.append([item])
            else:
                per_dim.append([str(name) for name in item])
        result = _C.AliasLayout(per_dim)
    if partial is None:
        return result
    merged = dict(result.partial)
    merged.update(_partial_map(partial))
    return _C.AliasLayout(result.dims, merged)


def from_placements(mesh: _C.Mesh, global_shape: Sequence[int], items: Any, shard_order: Any = None) -> _C.Layout:
    """Layout from torch-style placements (see `placements`)."""
    return _C.from_placements(mesh, list(global_shape), placements(items, shard_order))


def from_alias(mesh: _C.Mesh, global_shape: Sequence[int], dims: Any, partial: PartialLike = None) -> _C.Layout:
    """Layout from alias notation (see `alias`)."""
    return _C.from_alias(mesh, list(global_shape), alias(dims, partial))


def from_tensor_map(
    mesh: _C.Mesh,
    global_shape: Sequence[int],
    tensor_map: Sequence[Union[int, Sequence[int]]],
    partial: PartialLike = None,
) -> _C.Layout:
    """Layout from a MindSpore / Hyper-Parallel tensor_map: per tensor dim a mesh axis counted
    from the right (-1 = not split) or a tuple of them (major -> minor). `partial` names axes."""
    entries = [[int(e)] if isinstance(e, int) else [int(a) for a in e] for e in tensor_map]
    per_axis: list = [None] * mesh.ndim
    for name, op in _partial_map(partial).items():
        per_axis[mesh.axis_index(name)] = op
    return _C.from_tensor_map(mesh, list(global_shape), entries, per_axis)


def make_layout(mesh: _C.Mesh, global_shape: Sequence[int], spec: Any, partial: PartialLike = None) -> _C.Layout:
    """Layout from whichever notation `spec` is written in: a Layout (returned as is),
    Placements, AliasLayout, the printed alias form (str), a list of placements (hypershard or
    torch objects, or strings such as "S(0)", "R", "P(sum)"), or an alias tuple."""
    if isinstance(spec, _C.Layout):
        return spec
    if isinstance(spec, _C.Placements) or (
        not isinstance(spec, (str, _C.AliasLayout)) and len(spec) > 0 and all(_is_placement_like(item) for item in spec)
    ):
        if partial is not None:
            raise TypeError("make_layout(): with placements, Partial is one of the placements")
        return from_placements(mesh, global_shape, spec)
    return from_alias(mesh, global_shape, spec, partial)
