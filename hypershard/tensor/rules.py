"""A distributed rule for a user's op, in hypershard's own terms: `register_rule`.

A user's op -- a ``torch.library.custom_op`` (a CUDA, Triton or NPU kernel) or an ATen overload
hypershard has no rule for -- is described by its dimension factors, einsum style:

    @torch.library.custom_op("mylib::scaled_matmul", mutates_args=())
    def scaled_matmul(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor: ...

    hs.register_rule(scaled_matmul, "mk,kn,.->mn", linear=(0, 1))

Every tensor argument gets one label per dim (in the schema's order; ``.`` for a dim that is never
sharded), every returned tensor its labels. hypershard then plans each call as it plans matmul,
embedding or attention (csrc/ops/sharding_search.h), per mesh axis:

- **shard a label**: every operand carrying the label is sharded alike on that axis, the others
  whole; a result carrying it is sharded the same way, a result without it is a sum over it --
  Partial(sum) on that axis (a contraction: ``k`` above);
- **carry**: ONE operand listed in `linear` may arrive Partial(sum|avg) with every other operand
  whole; every result is then Partial the same way (the op must be linear in that operand);
- **replicate**: everything whole on that axis.

Labels in `whole` are never sharded (an input sharded on one is gathered first). The cheapest
choice wins by the tie-break every native rule uses (fewest elements moved, then fewest inputs
redistributed, then fewest Partial results). The plan is cached per call signature in C++ like a
native rule's, so a repeat call costs what a native rule's does; the rule works in strict mode.

Why factors rather than torch's ``register_sharding`` (a function returning the acceptable
placement lists per mesh dim): both state the per-axis algebra, but a factor string states it
once for every mesh and layout -- torch's strategies must enumerate each (shard dim i of input j
and dim k of the output, replicate, ...) and leave Partial to the author; here Partial follows from
which labels a result lacks and which operands are linear, which is the algebra the C++ families
are written in. What it cannot say: an op whose output dims are not input dims, or whose
sharded dims need an exchange (a scan along a dim): mark those dims whole or use `hs.local_map`.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch

from .. import _C

__all__ = ["register_rule"]


def op_name(op: Any) -> str:
    """ "mylib::op" / "aten::add.Tensor" of a custom op, an OpOverload (or its packet's default) or a string."""
    if isinstance(op, str):
        return op
    op = getattr(op, "_opoverload", op)  # torch.library.custom_op's CustomOpDef
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    if isinstance(op, torch._ops.OpOverload):
        schema = op._schema
        return schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
    raise TypeError(f"hypershard: register_rule: {op!r} is not an op; allowed: a custom op, an OpOverload or a name")


def register_rule(op: Any, factors: str, *, linear: Union[bool, Sequence[int]] = (), whole: str = "") -> None:
    """Gives `op` the distributed rule `factors` ("mk,kn->mn": labels per tensor argument, then per
    result; module docstring). `linear`: the operand indices whose Partial(sum) may be carried into
    every result (True: all). `whole`: labels never sharded. Raises a LayoutError (a ValueError)
    for a malformed rule, an op with a native rule, or, at the call, shapes the labels do not fit.
    Register before the op runs (an op called before gets the rule and loses its cached plans)."""
    name = op_name(op)
    text = factors.replace(" ", "")
    lhs, arrow, rhs = text.partition("->")
    if not arrow:
        raise ValueError(
            f'hypershard: register_rule: {name}: "{factors}" has no "->"; allowed: "labels,labels->labels", '
            'e.g. "mk,kn->mn"'
        )
    inputs = lhs.split(",")
    outputs = rhs.split(",") if rhs else []
    count = len(inputs)
    chosen = set(range(count)) if linear is True else set(linear or ())
    if any(not 0 <= i < count for i in chosen):
        raise ValueError(
            f"hypershard: register_rule: {name}: linear operand(s) {sorted(chosen)} out of range; allowed: 0..{count - 1}"
        )
    _C.register_factor_rule(name, text, inputs, outputs, whole, [i in chosen for i in range(count)])
