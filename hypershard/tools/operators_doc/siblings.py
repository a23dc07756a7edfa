"""Siblings: an overload no sample reaches takes a traced overload's arguments (add.Tensor's call
for add_.Tensor, add.out and add.Scalar)."""

from __future__ import annotations

from typing import Any, Optional

from .calls import Call, TensorMeta, first_tensor, op_key, resolve, score


def stem(key: str) -> str:
    """aten::add_.Tensor, aten::add.out -> aten::add (one trailing "_" of an in-place name)."""
    name = key.split(".", 1)[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _type_ok(jit_type: str, value: Any) -> bool:
    if jit_type.startswith("Optional["):
        if value is None:
            return True
        jit_type = jit_type[len("Optional[") : -1]
    if jit_type == "Tensor":
        return isinstance(value, TensorMeta)
    if jit_type.startswith("List["):
        inner = jit_type[len("List[") : -1]
        if not isinstance(value, (list, tuple)):
            return inner in ("int", "SymInt") and isinstance(value, int) and not isinstance(value, bool)
        return all(_type_ok(inner, v) for v in value)
    if isinstance(value, (TensorMeta, list, tuple)) or value is None:
        return False
    if jit_type in ("int", "SymInt"):
        return isinstance(value, int) and not isinstance(value, bool)
    if jit_type == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if jit_type == "bool":
        return isinstance(value, bool)
    if jit_type == "number":
        return isinstance(value, (bool, int, float, complex))
    return True


_SCALARS = {"number": 2, "int": 2, "SymInt": 2, "float": 2.0, "bool": True}


def _rebind(call: Call, target, convert: bool) -> Optional[Call]:
    """`call`'s arguments for overload `target`, out= tensors from its outputs; None when the
    schema does not take them. convert: a tensor where `target` takes a scalar becomes the
    scalar 2 (True), a scalar where it takes a tensor a 0-d tensor (add.Tensor's call for
    add.Scalar and back)."""
    values, outs, bound = call.bound, list(call.outs), {}
    first = first_tensor(call.op, call.bound)
    for argument in target._schema.arguments:
        if argument.name in values:
            value = values[argument.name]
        elif argument.is_out:
            if not outs:
                return None
            value = outs.pop(0)
        elif argument.default_value is not None or str(argument.type).startswith("Optional["):
            continue
        else:
            return None
        jit_type = str(argument.type)
        if not _type_ok(jit_type, value):
            if not convert:
                return None
            if isinstance(value, TensorMeta) and jit_type in _SCALARS:
                value = _SCALARS[jit_type]
            elif (
                jit_type in ("Tensor", "Optional[Tensor]")
                and first is not None
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
            ):
                value = TensorMeta((), first.dtype)
            else:
                return None
        bound[argument.name] = value
    if set(values) - set(bound):
        return None
    return Call(target, bound, call.outs, f"{call.source} via {op_key(call.op).split('::')[1]}")


def sibling_calls(key: str, samples: dict) -> list:
    target = resolve(key)
    if target is None:
        return []
    base = stem(key)
    found = []
    for convert in (False, True):  # the calls that fit as they are first
        for other in sorted(k for k in samples if k != key and stem(k) == base):
            for call in samples[other]:
                rebound = _rebind(call, target, convert)
                if rebound is not None:
                    found.append((convert, -score(rebound), len(found), rebound))
    return [call for *_, call in sorted(found, key=lambda item: item[:3])]
