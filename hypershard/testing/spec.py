"""Declarative test cases for the multi-process harness: inputs, placements, meshes, sweeps.

Everything here is plain Python + torch; nothing imports hypershard, so the harness can be
imported (and its own tests run with the torch backend) before hypershard's runtime exists.

Placement notation -- one entry per MESH axis, like torch's ``placements``:

    "R", "Replicate", "Replicate()"         Replicate
    "S(d)", "Sd", "Shard(d)"                Shard on tensor dim d (negative d counts from the end)
    "P", "P(op)", "Partial", "Partial(op)"  Partial; op: sum (default), avg, max, min, product

torch or hypershard placement objects are accepted as well (they are read through their printed
form, e.g. torch's ``S(0)`` / ``R`` / ``P(sum)``).

Alias notation (Hyper-Parallel) -- one entry per TENSOR dim: ``"None"`` (or None), a mesh axis
name, or a tuple of axis names (major -> minor), e.g. ``("dp", "None")`` or
``(("dp", "tp"), "None")``.  A placements value is read as alias notation when one of its entries
is None/"None", a tuple/list, or a string that is not a placement token (so an axis must not be
named like a placement token, e.g. "R" or "P").  The hypershard adapter passes alias tuples
through unchanged; the torch adapter translates them to Shard placements.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

__all__ = [
    "Case",
    "Input",
    "LayoutSpec",
    "PlacementSpec",
    "arange",
    "constant",
    "default_tolerance",
    "normalize_layout",
    "normalize_mesh",
    "parse_placement",
    "placement_sweep",
    "randint",
    "randn",
    "sweep_cases",
    "uniform",
]

# ---------------------------------------------------------------------------------------------
# placements

_SHARD = re.compile(r"^(?:Shard|S)(?:\(\s*(?:dim\s*=\s*)?(-?\d+)\s*\)|(-?\d+))$")
_REPLICATE = re.compile(r"^(?:Replicate|R)(?:\(\s*\))?$")
_PARTIAL = re.compile(r"^(?:Partial|P)(?:\(\s*(?:reduce_op\s*=\s*)?['\"]?(\w*)['\"]?\s*\))?$")
_REDUCE_OPS = {"sum": "sum", "avg": "avg", "max": "max", "min": "min", "prod": "product", "product": "product"}


@dataclass(frozen=True)
class PlacementSpec:
    """A backend-neutral placement: kind "R", "S" (with dim) or "P" (with reduce op)."""

    kind: str
    dim: Optional[int] = None
    op: Optional[str] = None

    def __str__(self) -> str:
        if self.kind == "S":
            return f"S({self.dim})"
        if self.kind == "P":
            return f"P({self.op})"
        return "R"


def is_placement_token(item: Any) -> bool:
    """True when `item` is a string in the placement notation (not an axis name)."""
    if not isinstance(item, str):
        return False
    text = item.strip()
    return bool(_SHARD.match(text) or _REPLICATE.match(text) or _PARTIAL.match(text))


def parse_placement(item: Any) -> PlacementSpec:
    """A PlacementSpec from the string notation or a torch/hypershard placement object."""
    if isinstance(item, PlacementSpec):
        return item
    # Objects are read through their printed form: torch prints S(0)/R/P(sum), hypershard prints
    # Shard(0)/Replicate()/Partial(sum); torch's _StridedShard prints _S(..) and is rejected.
    text = (item if isinstance(item, str) else str(item)).strip()
    if match := _SHARD.match(text):
        return PlacementSpec("S", dim=int(match.group(1) or match.group(2)))
    if _REPLICATE.match(text):
        return PlacementSpec("R")
    if match := _PARTIAL.match(text):
        op = (match.group(1) or "sum").lower()
        if op not in _REDUCE_OPS:
            raise ValueError(f"placement {item!r}: unknown reduce op {op!r}; allowed: {', '.join(sorted(_REDUCE_OPS))}")
        return PlacementSpec("P", op=_REDUCE_OPS[op])
    raise ValueError(
        f"placement {item!r}: not a placement; allowed: R, S(d), Sd, P, P(op), "
        "Replicate(), Shard(d), Partial(op) or a placement object"
    )


@dataclass(frozen=True)
class LayoutSpec:
    """How one input is distributed, validated against its mesh and tensor rank.

    kind "placements": `items` holds one PlacementSpec per mesh axis (Shard dims made
    non-negative).  kind "alias": `items` holds, per tensor dim, the tuple of mesh axis names that
    shard it (major -> minor), and `raw` the alias tuple as written (passed through to
    hypershard)."""

    kind: str
    items: tuple
    mesh_names: tuple
    raw: Any = None

    def __str__(self) -> str:
        if self.kind == "alias":
            return repr(self.raw)
        return ",".join(str(p) for p in self.items)


def _looks_like_alias(items: Sequence[Any]) -> bool:
    return any(
        item is None or isinstance(item, (tuple, list)) or (isinstance(item, str) and not is_placement_token(item))
        for item in items
    )


def normalize_layout(placements: Any, mesh_names: Sequence[str], ndim: int) -> LayoutSpec:
    """Validate `placements` (placement or alias notation, see the module docstring) for a tensor
    of rank `ndim` on a mesh with axes `mesh_names`; None means Replicate on every axis."""
    names = tuple(mesh_names)
    if placements is None:
        return LayoutSpec("placements", (PlacementSpec("R"),) * len(names), names)
    if isinstance(placements, str) or not isinstance(placements, Sequence):
        placements = (placements,)  # a single placement for a 1-D mesh
    items = list(placements)
    if _looks_like_alias(items) or (not items and ndim == 0):
        dims = []
        for item in items:
            if item is None or item == "None":
                dims.append(())
            elif isinstance(item, str):
                dims.append((item,))
            else:
                dims.append(tuple(str(name) for name in item))
        if len(dims) != ndim:
            raise ValueError(
                f"alias layout {tuple(placements)!r} has {len(dims)} entries but the tensor has {ndim} dims"
            )
        used = [name for axes in dims for name in axes]
        unknown = [name for name in used if name not in names]
        if unknown:
            raise ValueError(
                f"alias layout {tuple(placements)!r}: unknown mesh axis {unknown[0]!r}; the mesh axes are {names}"
            )
        if len(set(used)) != len(used):
            raise ValueError(f"alias layout {tuple(placements)!r}: a mesh axis is used twice")
        return LayoutSpec("alias", tuple(dims), names, raw=tuple(placements))
    specs = []
    for item in items:
        spec = parse_placement(item)
        if spec.kind == "S":
            if not -ndim <= spec.dim < max(ndim, 1) or ndim == 0:
                raise ValueError(f"placement {item!r}: dim out of range for a {ndim}-d tensor")
            spec = PlacementSpec("S", dim=spec.dim % ndim)
        specs.append(spec)
    if len(specs) != len(names):
        raise ValueError(f"placements {items!r}: {len(specs)} entries for a mesh with {len(names)} axes {names}")
    return LayoutSpec("placements", tuple(specs), names)


# ---------------------------------------------------------------------------------------------
# meshes

MeshLike = Union[None, int, Mapping[str, int], Sequence[Any]]


def normalize_mesh(mesh: MeshLike, world_size: Optional[int] = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, axis names) from ``((2, 2), ("dp", "tp"))``, ``{"dp": 2, "tp": 2}``, a bare shape
    ``(2, 2)`` (axes named d0, d1, ...) or an int; None means a 1-D mesh "dp" over the world."""
    if mesh is None:
        if world_size is None:
            raise ValueError("a case without a mesh needs run_cases(world_size=...)")
        return (int(world_size),), ("dp",)
    if isinstance(mesh, int):
        shape, names = (mesh,), ("dp",)
    elif isinstance(mesh, Mapping):
        shape, names = tuple(mesh.values()), tuple(mesh.keys())
    elif len(mesh) == 2 and isinstance(mesh[0], (tuple, list)):
        shape, names = tuple(mesh[0]), mesh[1]
        names = tuple(f"d{i}" for i in range(len(shape))) if names is None else tuple(names)
    else:
        shape = tuple(mesh)
        names = tuple(f"d{i}" for i in range(len(shape)))
    shape = tuple(int(size) for size in shape)
    names = tuple(str(name) for name in names)
    if not shape or any(size < 1 for size in shape):
        raise ValueError(f"mesh {mesh!r}: the shape must have positive sizes")
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ValueError(f"mesh {mesh!r}: needs one distinct name per axis")
    return shape, names


def mesh_size(shape: Sequence[int]) -> int:
    size = 1
    for extent in shape:
        size *= extent
    return size


# ---------------------------------------------------------------------------------------------
# input values: an init is a callable (shape, dtype, generator) -> tensor


def _wide(dtype: torch.dtype) -> torch.dtype:
    # Draw low-precision values in float32 then round: the same seed gives the same values
    # whatever the target precision, and CPU kernels for half generators are not needed.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def randn(std: float = 1.0, mean: float = 0.0) -> Callable:
    """Normal values (the default for floating inputs)."""

    def init(shape, dtype, generator):
        values = torch.randn(shape, generator=generator, dtype=_wide(dtype))
        return (values * std + mean).to(dtype)

    return init


def uniform(low: float = 0.0, high: float = 1.0) -> Callable:
    """Uniform values in [low, high), e.g. ``uniform(0.5, 2.0)`` for log/sqrt/division."""

    def init(shape, dtype, generator):
        values = torch.rand(shape, generator=generator, dtype=_wide(dtype))
        return (values * (high - low) + low).to(dtype)

    return init


def randint(low: int, high: int) -> Callable:
    """Integers in [low, high), e.g. class targets: ``Input((8,), torch.int64,
    init=randint(0, 10))``."""

    def init(shape, dtype, generator):
        return torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(dtype)

    return init


def arange(start: float = 0, step: float = 1) -> Callable:
    """start, start+step, ... in row-major order (handy for debugging layouts)."""

    def init(shape, dtype, generator):
        count = mesh_size(shape)
        return (torch.arange(count, dtype=torch.float64) * step + start).reshape(shape).to(dtype)

    return init


def constant(value: float) -> Callable:
    """Every element equal to `value`."""

    def init(shape, dtype, generator):
        return torch.full(shape, value, dtype=dtype)

    return init


def _default_init(dtype: torch.dtype) -> Callable:
    if dtype == torch.bool:
        return lambda shape, _dtype, gen: randint(0, 2)(shape, torch.int64, gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return randn()
    return randint(0, 10)


@dataclass
class Input:
    """One positional argument of a case's function: ``Input(shape, dtype, placements=...)``.

    shape, dtype: of the GLOBAL tensor.  placements: placement or alias notation (module
    docstring); None = Replicate on every mesh axis.  seed: of the torch.Generator the values come
    from (None = derived from the case name and the argument position), identical in the
    reference and the distributed run.  requires_grad: None = True for floating/complex dtypes.
    init: None (randn for floats, randint(0, 10) for integers, coin flips for bool), a callable
    ``(shape, dtype, generator) -> Tensor`` (see randn/uniform/randint/arange/constant), or a
    fixed tensor.  plain: pass a plain torch.Tensor to the distributed run too (no DTensor).
    """

    shape: Sequence[int]
    dtype: torch.dtype = torch.float32
    placements: Any = None
    seed: Optional[int] = None
    requires_grad: Optional[bool] = None
    init: Any = None
    plain: bool = False

    def __post_init__(self):
        self.shape = tuple(int(size) for size in self.shape)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"Input dtype must be a torch.dtype, got {self.dtype!r} (give "
                "placements by keyword: Input(shape, placements=[...]))"
            )

    @property
    def wants_grad(self) -> bool:
        if self.requires_grad is None:
            return self.dtype.is_floating_point or self.dtype.is_complex
        return bool(self.requires_grad)

    def make(self, seed: int) -> torch.Tensor:
        """The global value (a fresh tensor, no grad) from `seed`."""
        if isinstance(self.init, torch.Tensor):
            value = self.init.detach().clone()
        else:
            init = self.init if self.init is not None else _default_init(self.dtype)
            generator = torch.Generator().manual_seed(int(seed))
            value = init(self.shape, self.dtype, generator)
        value = value.to(self.dtype).contiguous()
        if tuple(value.shape) != self.shape:
            raise ValueError(f"Input init made shape {tuple(value.shape)}, expected {self.shape}")
        return value


# ---------------------------------------------------------------------------------------------
# cases

# (rtol, atol) per dtype; float32 follows the project's "rtol 1e-5 or tighter" target.
_TOLERANCES = {
    torch.float32: (1e-5, 1e-6),
    torch.float64: (1e-7, 1e-9),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.complex64: (1e-5, 1e-6),
    torch.complex128: (1e-7, 1e-9),
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) used when a case gives none; (0, 0) (exact) for integer and bool dtypes."""
    return _TOLERANCES.get(dtype, (0.0, 0.0))


@dataclass
class Case:
    """One declarative check: ``fn(*inputs)`` distributed vs single-process.

    mesh: ``((shape...), (names...))``, ``{"dp": 2}``, a bare shape, or None (1-D "dp" over
    run_cases' world_size); its size decides the launch the case joins.  dist_fn: run instead of
    fn in the distributed half (to inject faults, or when the distributed call differs).
    expect_error: the distributed run must raise on every rank with this text in
    ``"<ExceptionType>: <message>"`` (the reference is not run) and the process group must still
    work afterwards.  rtol/atol: None = per-dtype defaults (default_tolerance).  check_grad:
    backward of a seeded random cotangent per differentiable output, compared per input.
    check_inputs: also compare the inputs after fn (in-place ops).  grad_placements: "match"
    (cotangent laid out like its output, Partial -> Replicate) or "replicate".  seed: of the
    cotangents (None = derived from the name).  build_on_device: on a device launch
    (run_cases(device_type="cuda")) fn runs under ``torch.device(device)``, so the tensors it
    builds itself (an index, an ``out=``, ``found_inf``) are made on the device beside its inputs,
    as a user's code there would make them; False for a fn that Dynamo compiles (it would trace
    the context's function mode).
    """

    name: str
    fn: Callable
    inputs: Sequence[Input] = ()
    mesh: MeshLike = None
    dist_fn: Optional[Callable] = None
    expect_error: Optional[str] = None
    rtol: Optional[float] = None
    atol: Optional[float] = None
    check_grad: bool = True
    check_inputs: bool = False
    grad_placements: str = "match"
    seed: Optional[int] = None
    build_on_device: bool = True

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a Case needs a non-empty name")
        if not callable(self.fn):
            raise TypeError(f"case {self.name!r}: fn is not callable")
        self.inputs = list(self.inputs)
        for i, item in enumerate(self.inputs):
            if not isinstance(item, Input):
                raise TypeError(f"case {self.name!r}: input {i} is not an Input")
        if self.grad_placements not in ("match", "replicate"):
            raise ValueError(f"case {self.name!r}: grad_placements must be 'match' or 'replicate'")


def stable_seed(*parts: Any) -> int:
    """A seed that is the same in every process and run (unlike hash())."""
    return zlib.crc32("/".join(str(part) for part in parts).encode()) & 0x7FFFFFFF


def make_cotangent(seed: int, index: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The fixed random cotangent for differentiable output `index` of a case."""
    generator = torch.Generator().manual_seed(stable_seed(seed, "cotangent", index))
    return randn()(tuple(shape), dtype, generator)


@dataclass
class PreparedCase:
    """A Case validated and resolved for one launch (what the rank processes execute)."""

    index: int
    case: Case
    world_size: int
    mesh_shape: tuple
    mesh_names: tuple
    layouts: list  # LayoutSpec per input (None for plain inputs)
    seeds: list  # generator seed per input
    cotangent_seed: int

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        rtol, atol = default_tolerance(dtype)
        return (
            self.case.rtol if self.case.rtol is not None else rtol,
            self.case.atol if self.case.atol is not None else atol,
        )


def prepare(case: Case, default_world_size: Optional[int]) -> PreparedCase:
    """Validate a case (mesh, every input's layout) in the parent, before anything launches."""
    shape, names = normalize_mesh(case.mesh, default_world_size)
    layouts = []
    for i, item in enumerate(case.inputs):
        try:
            layouts.append(None if item.plain else normalize_layout(item.placements, names, len(item.shape)))
        except ValueError as exc:
            raise ValueError(f"case {case.name!r}, input {i}: {exc}") from None
    seeds = [
        item.seed if item.seed is not None else stable_seed(case.name, "input", i) for i, item in enumerate(case.inputs)
    ]
    cot_seed = case.seed if case.seed is not None else stable_seed(case.name)
    return PreparedCase(-1, case, mesh_size(shape), shape, names, layouts, seeds, cot_seed)


# ---------------------------------------------------------------------------------------------
# sweeps


def _as_list(value: Any, count: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{what}: {len(value)} entries for {count} inputs")
        return list(value)
    return [value] * count


def placement_sweep(
    mesh_shape: Union[int, Sequence[int]],
    ndim_per_input: Union[int, Sequence[int]],
    allow_partial: Union[bool, Sequence[bool]] = False,
) -> list[tuple]:
    """Every combination of placements for each input on a mesh.

    Returns a list of combinations; a combination is a tuple with one placements tuple per
    input, each holding one string per mesh axis from R, S(0)..S(ndim-1) and, where
    `allow_partial` (a bool, or one per input), P.  An int `ndim_per_input` means one input.
    ``placement_sweep((2,), [2, 1])`` -> 3 * 2 = 6 combinations such as
    ``(("S(1)",), ("R",))``.
    """
    axes = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    ndims = [ndim_per_input] if isinstance(ndim_per_input, int) else list(ndim_per_input)
    partial = _as_list(allow_partial, len(ndims), "allow_partial")
    per_input = []
    for ndim, with_partial in zip(ndims, partial):
        options = ["R"] + [f"S({dim})" for dim in range(ndim)] + (["P"] if with_partial else [])
        per_input.append(list(itertools.product(options, repeat=len(axes))))
    return list(itertools.product(*per_input))


def sweep_cases(
    name: str,
    fn: Callable,
    inputs: Sequence[Input],
    mesh: MeshLike = None,
    allow_partial: Union[bool, Sequence[bool]] = False,
    world_size: Optional[int] = None,
    **case_kwargs: Any,
) -> list[Case]:
    """One Case per placement combination of `inputs` on `mesh` (their own placements are
    ignored), named ``name[S(0),R|R,R]`` (inputs separated by '|').  The inputs keep their seeds
    (derived from `name` when unset), so every case of a sweep sees the same values."""
    shape, names = normalize_mesh(mesh, world_size)
    seed = case_kwargs.pop("seed", None)
    seed = stable_seed(name) if seed is None else seed
    inputs = list(inputs)
    seeded = [
        item if item.seed is not None else dataclasses.replace(item, seed=stable_seed(name, "input", i))
        for i, item in enumerate(inputs)
    ]
    cases = []
    for combo in placement_sweep(shape, [len(item.shape) for item in inputs], allow_partial):
        label = "|".join(",".join(p) for p in combo)
        case_inputs = [
            item if item.plain else dataclasses.replace(item, placements=p) for item, p in zip(seeded, combo)
        ]
        cases.append(Case(f"{name}[{label}]", fn, case_inputs, mesh=(shape, names), seed=seed, **case_kwargs))
    return cases
