"""Process-free rule tests: what an operator's rule plans, without processes or collectives.

A `PlanningMesh` is a mesh with no process groups; its `dtensor(shape, spec)` is a DTensor on
the meta device (no data) whose layout is `spec` (torch-style placements like ``["S(0)", "R"]``
or Hyper-Parallel alias dims). `plan(op, *args, **kwargs)` runs the C++ rule of `op` (an
OpOverload such as ``torch.ops.aten.mm.default``) on those arguments, exactly as the per-op path
would before any redistribution, and returns the layouts it asks for::

    mesh = PlanningMesh({"dp": 2, "tp": 2})
    p = plan(torch.ops.aten.mm.default, mesh.dtensor([4, 6], ["S(0)", "R"]), mesh.dtensor([6, 8], ["R", "S(1)"]))
    assert p.output_specs == [["S(0)", "S(1)"]]

Rule errors raise as they would on a real mesh (hypershard.LayoutError or RuntimeError, the same
house-format message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from .. import _C
from ..tensor.layout import make_layout
from ..tensor.layout import mesh as make_mesh

__all__ = [
    "Arg",
    "PlanningMesh",
    "Plan",
    "check_error_pieces",
    "check_row_plan",
    "plan",
    "plan_row",
    "realise",
    "short_spec",
    "spec",
]


def short_spec(layout: Optional[_C.Layout]) -> Optional[list]:
    """Per mesh axis: "R", "S(d)", "P" (sum) or "P(op)"; None for a missing layout. The shard
    order of a dim sharded by several axes is not shown (compare `layout.sharding_string()`)."""
    if layout is None:
        return None
    out = []
    for placement in _C.to_placements(layout).per_axis:
        text = str(placement)
        if text == "Replicate()":
            out.append("R")
        elif text.startswith("Shard("):
            out.append("S" + text[len("Shard") :])
        elif text == "Partial(sum)":
            out.append("P")
        else:
            out.append("P" + text[len("Partial") :])
    return out


@dataclass
class Plan:
    inputs: list  # layouts per tensor argument, in schema order
    outputs: list  # layouts per returned tensor
    localizes: bool  # rewrites non-tensor arguments (sizes, counts) into local terms
    expands: bool  # runs its own implementation (collectives inside the op)
    refused: str = ""  # non-empty: strict mode raises this text for the plan (default mode
    # runs it, e.g. a replicated operand cut locally to match a shard)

    @property
    def input_specs(self) -> list:
        return [short_spec(layout) for layout in self.inputs]

    @property
    def output_specs(self) -> list:
        return [short_spec(layout) for layout in self.outputs]


class PlanningMesh:
    """A mesh without process groups, seen from `rank`."""

    def __init__(self, shape: Mapping[str, int], rank: int = 0):
        self.mesh = make_mesh(shape)
        self.rank = rank
        self.device_mesh = _C.DeviceMesh.without_groups(self.mesh, rank)

    def layout(self, shape: Sequence[int], spec: Any, partial: Any = None) -> _C.Layout:
        return make_layout(self.mesh, list(shape), spec, partial)

    def dtensor(
        self, shape: Sequence[int], spec: Any, dtype: torch.dtype = torch.float32, partial: Any = None
    ) -> torch.Tensor:
        layout = self.layout(shape, spec, partial)
        local = torch.empty(layout.local_shape_at(self.device_mesh.position), dtype=dtype, device="meta")
        return _C.from_local(local, self.device_mesh, layout)


def plan(op: Any, *args: Any, **kwargs: Any) -> Plan:
    """The plan `op`'s rule makes for these arguments (see the module docstring)."""
    schema = op._schema
    result = _C.infer_plan(schema.name, schema.overload_name, *args, **kwargs)
    return Plan(
        list(result["inputs"]), list(result["outputs"]), result["localizes"], result["expands"], result["refused"]
    )


# ---------------------------------------------------------------------------------- rule-test rows


class Arg:
    """A DTensor argument of a rule-test row (global shape, placements, dtype), made on the row's
    mesh by `realise` -- rows are written before their mesh exists."""

    def __init__(self, shape: Sequence[int], spec: Any, dtype: torch.dtype = torch.float32):
        self.shape, self.spec, self.dtype = list(shape), spec, dtype

    def make(self, mesh: PlanningMesh) -> torch.Tensor:
        return mesh.dtensor(self.shape, self.spec, self.dtype)


def realise(value: Any, mesh: PlanningMesh) -> Any:
    """`value` with every Arg (alone, in a list, or a dict's value) made on `mesh`."""
    if isinstance(value, Arg):
        return value.make(mesh)
    if isinstance(value, list) and value and isinstance(value[0], Arg):
        return [item.make(mesh) for item in value]
    if isinstance(value, dict):
        return {key: realise(item, mesh) for key, item in value.items()}
    return value


def spec(*dims: Any) -> list:
    """Placements per mesh axis: an int d is Shard(d), None Replicate, a str itself ("P", "P(max)")."""
    return [d if isinstance(d, str) else (f"S({d})" if d is not None else "R") for d in dims]


def plan_row(op: Any, args: Sequence[Any], shape: Mapping[str, int], rank: int = 0) -> Plan:
    """The plan of `op` on a rule-test row's positional `args`, realised on a PlanningMesh of `shape`
    seen from `rank`."""
    mesh = PlanningMesh(shape, rank=rank)
    return plan(op, *[realise(a, mesh) for a in args])


def check_row_plan(result: Plan, args: Sequence[Any], inputs: Optional[list], outputs: list) -> None:
    """Asserts a rule-test row's plan: it asks for `inputs` (None: the specs the row's Args were
    given, i.e. nothing moves), gives `outputs`, is not refused and runs no implementation of its
    own (`expands`: collectives inside the op)."""
    want_inputs = inputs if inputs is not None else [a.spec for a in args if isinstance(a, Arg)]
    assert result.input_specs == want_inputs, (result.input_specs, want_inputs)
    assert result.output_specs == outputs, (result.output_specs, outputs)
    assert result.refused == "", result.refused
    assert not result.expands


def check_error_pieces(text: str, pieces: Sequence[str]) -> None:
    """Asserts a rule error's message `text` of a rule-test error row: it starts with "hypershard: "
    and the first piece (the start of the house-format message), and holds every other piece."""
    assert text.startswith("hypershard: " + pieces[0]), text
    for piece in pieces[1:]:
        assert piece in text, (piece, text)
