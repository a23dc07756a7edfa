"""Probing: a rule planned (hypershard.testing.planning, no processes) with the call's first tensor
argument laid out Shard(0), Shard(last) and Partial(sum) on a 2-rank mesh, and what each plan
means for the document's cells."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Optional

from .calls import Call, TensorMeta, first_tensor, resolve
from .siblings import sibling_calls

MESH_SHAPE = {"tp": 2}
PROBES = ("S(0)", "S(last)", "P")


@dataclass
class Probe:
    cells: dict = field(default_factory=dict)  # probe -> cell text
    kinds: dict = field(default_factory=dict)  # probe -> "local" | "moved" | "kept" | "refused" | ...
    expands: bool = False  # for any probe
    expanded: dict = field(default_factory=dict)  # probe -> the plan expands
    sample: str = ""  # the first tensor's shape and the call's source


def _house_clause(message: str) -> Optional[str]:
    """The problem of a hypershard error message, short: "self: Partial(sum) input is not
    supported by this op"; None for a message that is not hypershard's."""
    text = " ".join(message.split())
    if not text.startswith("hypershard: "):
        return None
    text = text[len("hypershard: ") :]
    missing = re.match(r"Missing operator \S+ for these arguments \((.*?)\): no distributed rule", text)
    if missing:
        return "not covered: " + missing.group(1)
    if text.startswith("Missing operator"):
        return "no rule"
    text = text.split(": ", 1)[1] if ": " in text else text  # the op name
    argument = re.match(r"argument (\S+) \(#\d+\) \[[^\]]*\] \([^)]*\)(?: partial\([^)]*\))?: (.*)$", text)
    if argument:
        text = f"{argument.group(1)}: {argument.group(2)}"
    text = text.split("; allowed:", 1)[0].split(" (inputs:", 1)[0]
    return text if len(text) <= 90 else text[:87].rstrip() + "..."


def _spec_text(spec: Optional[list], ndim: Optional[int], negative: bool) -> str:
    if spec is None:
        return "none"
    text = spec[0]
    if negative and ndim and text.startswith("S("):
        text = f"S({int(text[2:-1]) - ndim})"
    return text


def _outputs_text(plan, negative: bool) -> str:
    texts = [
        _spec_text(spec, len(layout.global_shape) if layout is not None else None, negative)
        for spec, layout in zip(plan.output_specs, plan.outputs)
    ]
    if not texts:
        return "—"
    runs = [(text, len(list(group))) for text, group in itertools.groupby(texts)]
    return ", ".join(text if count == 1 else f"{text} ×{count}" for text, count in runs)


def _movement(given: str, planned: str) -> Optional[str]:
    """The communication that takes `given` to `planned` on the one mesh axis, None for none
    (a Replicate cut to a shard or filled as a Partial moves nothing)."""
    if given == planned or given == "R":
        return None
    if given.startswith("P"):
        return "reduce-scattered" if planned.startswith("S(") else "reduced"
    if planned == "R":
        return "gathered"
    return f"resharded to {planned}" if planned.startswith("S(") else f"moved to {planned}"


def _tensor_items(call: Call) -> list:
    """[(argument name, item index or None, TensorMeta, is out=)] in schema order."""
    items = []
    for argument in call.op._schema.arguments:
        value = call.bound.get(argument.name)
        if isinstance(value, TensorMeta):
            items.append((argument.name, None, value, argument.is_out))
        elif isinstance(value, (list, tuple)):
            items.extend(
                (argument.name, i, v, argument.is_out) for i, v in enumerate(value) if isinstance(v, TensorMeta)
            )
    return items


def _given_spec(probe: str, meta: TensorMeta) -> str:
    if probe == "S(last)":
        return f"S({len(meta.shape) - 1})" if meta.shape else "R"
    if probe == "S(0)":
        return "S(0)" if meta.shape else "R"
    return probe  # "P", "R"


class Prober:
    """Plans a call with its first tensor argument laid out as a probe (every item of it, for a
    tensor list), the other tensor arguments shaped like it (item by item) laid out the same for
    the Shard probes, the rest Replicate."""

    def __init__(self):
        from ...testing.planning import PlanningMesh

        self.mesh = PlanningMesh(MESH_SHAPE)

    def _run(self, call: Call, probe: str):
        """(plan or None, error text or None, [(argument, communication, planned spec)])."""
        from ...testing.planning import plan

        items = _tensor_items(call)
        first_name = items[0][0]
        firsts = [meta for name, _, meta, _ in items if name == first_name]
        given = []
        for name, index, meta, _ in items:
            if name == first_name:
                spec = _given_spec(probe, meta)
            else:
                like = firsts[index] if index is not None and index < len(firsts) else firsts[0]
                spec = _given_spec(probe, meta) if probe.startswith("S") and meta.shape == like.shape else "R"
            given.append(spec)
        specs = iter(given)

        def realize(value):
            if isinstance(value, TensorMeta):
                return self.mesh.dtensor(list(value.shape), [next(specs)], value.dtype)
            if isinstance(value, (list, tuple)):
                return [realize(v) for v in value]
            return value

        # Schema order, the same order _tensor_items walks.
        args = {a.name: realize(call.bound[a.name]) for a in call.op._schema.arguments if a.name in call.bound}
        try:
            result = plan(call.op, **args)
        except Exception as exc:  # noqa: BLE001 -- the rule's refusal is the cell
            clause = _house_clause(str(exc))
            return None, (clause if clause is not None else "!" + type(exc).__name__), []
        moves = []
        planned = result.input_specs
        if len(planned) != len(given):  # not expected: the plan lists every tensor argument
            return None, f"!{len(planned)} input layouts for {len(given)} tensors", []
        for (name, _, _, is_out), spec, got in zip(items, given, planned):
            move = _movement(spec, got[0]) if got is not None and not is_out else None
            if move and not any(m[0] == name for m in moves):
                moves.append((name, move, got[0]))
        return result, None, moves

    def candidate_ok(self, call: Call) -> bool:
        """The rule plans the call all Replicate (the traced arguments fit the schema)."""
        if first_tensor(call.op, call.bound) is None:
            return False
        _, error, _ = self._run(call, "R")
        return error is None or not error.startswith("!")

    def probe(self, call: Call) -> Probe:
        items = _tensor_items(call)
        first_name = items[0][0]
        firsts = [meta for name, _, meta, _ in items if name == first_name]
        shapes = ", ".join(f"`{list(meta.shape)}`" for meta in firsts)
        out = Probe(sample=f"{shapes} {call.source}")
        for probe in PROBES:
            if probe != "P" and not firsts[0].shape:
                out.cells[probe], out.kinds[probe] = "0-d", "n/a"
                continue
            shown = {"S(0)": "S(0)", "S(last)": "S(-1)", "P": "P"}[probe]
            result, error, moves = self._run(call, probe)
            if result is None:
                if error.startswith("!"):
                    out.cells[probe], out.kinds[probe] = f"probe failed ({error[1:]})", "failed"
                elif error.startswith("not covered") or error == "no rule":
                    out.cells[probe], out.kinds[probe] = error, "not covered"
                else:
                    out.cells[probe], out.kinds[probe] = f"refused: {error}", "refused"
                continue
            out.expanded[probe] = bool(result.expands)
            out.expands = out.expands or bool(result.expands)
            own = [move for name, move, _ in moves if name == first_name]
            others = [f"{name} {move}" for name, move, _ in moves if name != first_name]
            cell = f"{own[0] if own else shown} → {_outputs_text(result, probe == 'S(last)')}"
            if others:
                cell += "; " + ", ".join(others)
            if result.refused:
                cell += " (strict: refused)"
            out.cells[probe] = cell
            out.kinds[probe] = "moved" if moves else "kept"
        return out


@dataclass
class Row:
    op: str
    family: str
    probe: Optional[Probe]  # None: no sample
    why: str = "no sample"


def probe_rules(rules: list, samples: dict) -> list:
    """A Row per (op, family) of `rules`: probed with the first candidate call the rule plans."""
    from ...tensor.dtensor import strict

    prober = Prober()
    with strict(False):  # plans do not depend on the mode; fixed all the same
        rows = [_probe_row(prober, op, family, samples) for op, family in sorted(rules)]
    return rows


def _probe_row(prober: Prober, op: str, family: str, samples: dict) -> Row:
    candidates = [*samples.get(op, []), *sibling_calls(op, samples)]
    chosen = next((c for c in candidates if prober.candidate_ok(c)), None)
    if chosen is not None:
        return Row(op, family, prober.probe(chosen))
    return Row(op, family, None, "no sample" if resolve(op) is not None else f"not probed: {op.split('::')[0]}'s op")
