"""Level0: custom ops with rules registered from Python (hs.register_rule), strict, on real 1-D and
2-D meshes: forward AND gradients against one device (the custom op's autograd formula runs on
DTensors through native rules), the plan cached after the first call (repeat calls never reach
Python: the rule lives in C++), a repeat call on the typed fast path, and the debug check: a planted wrong rule (row_norm's normalised
dim left shardable) runs silently without it and is refused with it."""

import torch

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, debug_checked, replicated, run_cases


@torch.library.custom_op("hs_l0::scaled_matmul", mutates_args=())
def scaled_matmul(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (a @ b) * s


@scaled_matmul.register_fake
def _(a, b, s):
    return a.new_empty(a.shape[0], b.shape[1])


def _scaled_matmul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _scaled_matmul_backward(ctx, grad):
    a, b, s = ctx.saved_tensors
    g = grad * s
    return g @ b.t(), a.t() @ g, (grad * (a @ b)).sum().reshape(s.shape)


scaled_matmul.register_autograd(_scaled_matmul_backward, setup_context=_scaled_matmul_setup)


@torch.library.custom_op("hs_l0::row_norm", mutates_args=())
def row_norm(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


@row_norm.register_fake
def _(x):
    return torch.empty_like(x)


def _row_norm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output)


def _row_norm_backward(ctx, grad):
    x, y = ctx.saved_tensors
    return (grad - y * (grad * y).sum(dim=-1, keepdim=True)) / x.norm(dim=-1, keepdim=True)


row_norm.register_autograd(_row_norm_backward, setup_context=_row_norm_setup)


@torch.library.custom_op("hs_l0::row_norm_wrong", mutates_args=())
def row_norm_wrong(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


@row_norm_wrong.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("hs_l0::sum_of_four", mutates_args=())
def sum_of_four(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return a + b + c + d


@sum_of_four.register_fake
def _(a, b, c, d):
    return torch.empty_like(a)


hs.register_rule(scaled_matmul, "mk,kn,.->mn", linear=(0, 1))
# a signature the typed fast path does not read: the op keeps the boxed fallback kernel
hs.register_rule(sum_of_four, "ab,ab,ab,ab->ab", linear=True)
hs.register_rule(row_norm, "bd->bd", whole="d")
hs.register_rule(row_norm_wrong, "bd->bd")  # planted: d must be whole, the op normalises over it

TP2 = ((2,), ("tp",))
DP_TP = ((2, 2), ("dp", "tp"))


def cached(fn):
    """dist_fn: fn twice; the second call must take the cached plan (no new plan for the op)."""

    def run(*inputs):
        out = fn(*inputs)
        before = dict(hs._C.cached_op_plans())
        again = fn(*inputs)
        after = dict(hs._C.cached_op_plans())
        for name in ("hs_l0::scaled_matmul", "hs_l0::row_norm"):
            assert after.get(name) == before.get(name), (name, before.get(name), after.get(name))
        assert torch.equal(again.full_tensor(), out.full_tensor())
        return out

    return run


def fast(fn, op):
    """dist_fn: fn once (its plan made), then again: the repeat must run on the typed fast path (a
    registered op of a signature the fast path reads gets a typed kernel, like an ATen op)."""

    def run(*inputs):
        assert op in hs._C.fast_path_ops(), op
        out = fn(*inputs)
        before = hs._C.dispatch_stats()["fast_calls"]
        again = fn(*inputs)
        assert hs._C.dispatch_stats()["fast_calls"] > before, "the repeat call did not take the fast path"
        assert torch.equal(again.full_tensor(), out.full_tensor())
        return out

    return run


def boxed_only(*inputs):
    assert "hs_l0::sum_of_four" not in hs._C.fast_path_ops()
    return sum_of_four(*inputs)


def matmul_then_norm(a, b, s):
    return row_norm(replicated(scaled_matmul(a, b, s)))


def rows_and_columns(a, b, s):
    return scaled_matmul(a, b, s)


def cases():
    s = Input((1,), placements=["R"])
    s2 = Input((1,), placements=["R", "R"])
    return [
        Case("rows_and_columns_tp", rows_and_columns, [Input((4, 6), placements=["S(0)"]), Input((6, 8), placements=["R"]), s], TP2, dist_fn=cached(rows_and_columns)),
        Case("contraction_partial_tp", matmul_then_norm, [Input((4, 6), placements=["S(1)"]), Input((6, 8), placements=["S(0)"]), s], TP2),
        Case("dp_tp_mesh", matmul_then_norm, [Input((4, 6), placements=["S(0)", "S(1)"]), Input((6, 8), placements=["R", "S(0)"]), s2], DP_TP),
        Case("whole_label_gathered", row_norm, [Input((4, 6), placements=["S(0)", "S(1)"])], DP_TP),
        Case("no_typed_signature_boxed", sum_of_four, [Input((4, 6), placements=["S(0)"])] * 4, TP2,
             dist_fn=boxed_only, check_grad=False),
        Case("typed_fast_path", row_norm, [Input((4, 6), placements=["S(0)"])], TP2,
             dist_fn=fast(row_norm, "hs_l0::row_norm")),
        Case("debug_check_refuses_wrong_rule", row_norm, [Input((4, 6), placements=["S(1)"])], TP2,
             dist_fn=debug_checked(row_norm_wrong), check_grad=False,
             expect_error='the registered rule "bd->bd" gives output 0 differing from the op on whole inputs'),
    ]


def test_registered_rules_on_meshes():
    assert_all_passed(run_cases(cases(), timeout=240))  # strict, as every harness run


def test_wrong_rule_without_debug_check_gives_wrong_values():
    """The planted fault is real: without the debug check the wrong rule runs (strict mode: no
    fallback, no error) and its values differ from one device."""
    case = Case("wrong_rule_unchecked", row_norm, [Input((4, 6), placements=["S(1)"])], TP2,
                dist_fn=row_norm_wrong, check_grad=False)
    results = run_cases([case], timeout=240)
    assert not results["wrong_rule_unchecked"].passed
    assert "differ" in results["wrong_rule_unchecked"].message, results["wrong_rule_unchecked"].message
