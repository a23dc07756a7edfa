"""The check both compile tests make (tests/python/level0/test_compile*.py): a compiled call's
outputs, and the gradients of their sum with respect to every differentiable input, against the
same function run eagerly on the same DTensors."""

from __future__ import annotations

from typing import Any, Callable


def full(value: Any) -> Any:
    """A DTensor's global value (a plain tensor or anything else: itself)."""
    return value.full_tensor() if _is_dtensor(value) else value


def leaves(value: Any) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _is_dtensor(value: Any) -> bool:
    import torch

    from hypershard import _C  # lazily, as the rest of this package (see its docstring)

    return isinstance(value, torch.Tensor) and _C.is_dtensor(value)


def check_against_eager(got: Any, want: Any, inputs: list, close: Callable[[Any, Any, str], None]) -> None:
    """Asserts, output by output: the same kind (DTensor or not) and placements, and
    close(global got, global want, what); then the same for the gradients of the outputs' sum
    with respect to every input that requires grad (both graphs are kept until both are read)."""
    import torch

    for index, (g, w) in enumerate(zip(leaves(got), leaves(want))):
        assert _is_dtensor(g) == _is_dtensor(w), f"output {index}: kind differs"
        if _is_dtensor(g):
            assert g.placements == w.placements, (index, g.placements, w.placements)
        close(full(g), full(w), f"output {index}")
    differentiable = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not differentiable:
        return

    def total(outputs):
        return sum(o.sum() for o in leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad)

    g_grads = torch.autograd.grad(total(got), differentiable, retain_graph=True, allow_unused=True)
    w_grads = torch.autograd.grad(total(want), differentiable, allow_unused=True)
    for index, (g, w) in enumerate(zip(g_grads, w_grads)):
        assert (g is None) == (w is None), f"grad {index}: present in one run only"
        if g is not None:
            close(full(g), full(w), f"grad {index}")
