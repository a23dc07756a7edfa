"""A call of an op as the document probes it: its overload and its arguments, tensors replaced
by their shape and dtype (TensorMeta); where it came from; and the helpers every source of calls
shares (binding arguments to the schema, scoring a call as a probe, resolving an op name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class TensorMeta:
    """A traced tensor argument: what the rule sees of it (no data)."""

    shape: tuple
    dtype: torch.dtype


@dataclass
class Call:
    op: Any  # the OpOverload
    bound: dict  # argument name -> value (TensorMeta for tensors), as passed
    outs: list  # TensorMeta of each returned tensor (out= overloads borrow them)
    source: str  # where the call came from (an OpInfo name, or a sibling overload)


def op_key(op) -> str:
    """ "aten::add.Tensor" / "aten::abs": the name the registry uses (rule_registrations())."""
    schema = op._schema
    return schema.name + (f".{schema.overload_name}" if schema.overload_name else "")


def to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return [to_meta(v) for v in value]
    if isinstance(value, dict):
        return {k: to_meta(v) for k, v in value.items()}
    return value


def _tensors(value: Any) -> list:
    if isinstance(value, TensorMeta):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def bind(op, args: tuple, kwargs: dict) -> dict:
    bound = {}
    positional = [a for a in op._schema.arguments if not a.kwarg_only]
    for argument, value in zip(positional, args):
        bound[argument.name] = value
    bound.update(kwargs)
    return bound


def first_tensor(op, bound: dict) -> Optional[TensorMeta]:
    for argument in op._schema.arguments:
        found = _tensors(bound.get(argument.name))
        if found:
            return found[0]
    return None


def score(call: Call) -> int:
    """Prefer calls whose first tensor has >= 2 dims of >= 2 elements each (Shard(0) and
    Shard(last) are different dims, no rank holds an empty shard, no size-1 broadcast dim)."""
    t = first_tensor(call.op, call.bound)
    if t is None or not t.shape or 0 in t.shape:
        return 0
    sized = t.shape[0] >= 2 and t.shape[-1] >= 2
    if sized and len(t.shape) >= 2:
        return 4 if min(t.shape) >= 2 else 3
    return 2 if sized else 1


def meta_outputs(op, bound: dict) -> list:
    """TensorMeta of what `op` returns for `bound` (meta tensors: no data); [] when it cannot
    run on meta."""

    def real(value):
        if isinstance(value, TensorMeta):
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        if isinstance(value, list):
            return [real(v) for v in value]
        return value

    try:
        out = op(**{name: real(value) for name, value in bound.items()})
    except Exception:  # noqa: BLE001 -- the outputs only serve out= siblings
        return []
    return [to_meta(t) for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]


PROBED_NAMESPACES = ("aten", "hypershard")  # always loaded here: the document is the same
# whether torch_npu or transformers is imported


def resolve(key: str):
    """The OpOverload of "ns::name.overload"; None for another library's op (npu::,
    transformers::), whether or not it is loaded."""
    namespace, _, rest = key.partition("::")
    if namespace not in PROBED_NAMESPACES:
        return None
    name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
    except (AttributeError, RuntimeError):
        return None
