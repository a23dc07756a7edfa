"""Level0: default mode's fallback for ops without a rule, on real meshes, against one device.

Every DTensor input is gathered to Replicate (Partial reduced), the op computed on the global
values, the outputs Replicate; in-place and out= arguments get the result back in their own
layouts; autograd runs through it (the backward ops reach the fallback too); a view of a
gathered input refuses writes. Each case checks inside the distributed run that the fallback
really served it (dispatch_stats()['fallback_calls'] grew): when one of these ops gets a rule,
the case says so and needs another rule-less op. Strict mode (what the rest of the suite runs
in) raises "Missing operator" for the same calls, and the fallback warns once per op.
"""

import warnings

import torch
import torch.nn.functional as F

import hypershard as hs
from hypershard.testing import (
    Case,
    DefaultModeAdapter,
    Input,
    assert_all_passed,
    counting,
    in_distributed_run,
    run_cases,
)
from hypershard.testing.spec import randint

M2 = ((2,), ("dp",))
M4 = ((4,), ("dp",))
M22 = ((2, 2), ("dp", "tp"))


def through_fallback(fn):
    """fn, asserting in the distributed run that the fallback served at least one call."""
    return counting("fallback_calls", fn)


def in_place(fn):
    """An in-place op on a copy of the input (leaves cannot be written), result and copy returned."""
    def run(x):
        y = x.detach().clone()
        out = fn(y)
        assert out is y, "an in-place op must return its own argument"
        return y
    return run


def out_variant(fn, like_placements):
    """fn(x, out=y) into a DTensor y laid out like the input, in the distributed run."""
    def run(x):
        y = torch.empty_like(x.detach())
        if in_distributed_run():
            y = hs.distribute_tensor(torch.zeros(x.shape), x.device_mesh, like_placements)
        result = fn(x.detach(), out=y)
        assert result is y
        if in_distributed_run():
            assert y.placements == tuple(like_placements), y.placements
        return y
    return run


def _embedding_bag_sum(weight):
    """Bags of rows of `weight` (the table: no rule for aten::_embedding_bag and its backward)."""
    return F.embedding_bag(torch.tensor([[0, 2], [1, 4], [3, 3]]), weight, mode="sum")


def fallback_cases():
    S0, S1, P = ["S(0)"], ["S(1)"], ["P"]
    cases = []

    def add(name, fn, inputs, mesh=M2, **kw):
        cases.append(Case(name, through_fallback(fn), inputs, mesh, **kw))

    for mesh, place in ((M2, S0), (M4, S1), (M22, ["S(0)", "S(1)"]), (M2, P)):
        tag = f"{'x'.join(map(str, mesh[0]))}_{''.join(place).replace('(', '').replace(')', '')}"
        add(f"embedding_bag_{tag}", _embedding_bag_sum, [Input((5, 6), placements=place)], mesh)
        add(f"lstsq_{tag}", lambda x: torch.linalg.lstsq(x, torch.linspace(-1, 1, 16).view(8, 2)).solution,
            [Input((8, 5), placements=place)], mesh)
        add(f"segment_reduce_{tag}", lambda x: torch.segment_reduce(x, "sum", lengths=torch.tensor([2, 3, 1])),
            [Input((6, 5), placements=place)], mesh)
        add(f"dist_{tag}", lambda x: torch.dist(x, torch.ones_like(x), p=3), [Input((7, 4), placements=place)], mesh)
    # several outputs, integer outputs, data-dependent sizes
    add("histogram_counts_and_edges", lambda x: torch.histogram(x, bins=4),
        [Input((6, 5), placements=S0, requires_grad=False)], M2)
    add("unique_counts", lambda x: torch.unique(torch.round(x), return_counts=True),
        [Input((7, 4), placements=S1, requires_grad=False)], M4)
    add("unique_consecutive", lambda x: torch.unique_consecutive(torch.round(x), return_counts=True),
        [Input((6, 5), placements=S0, requires_grad=False)], M2)
    add("geqrf", torch.geqrf, [Input((6, 5), placements=S0, requires_grad=False)], M2)
    # an op with a rule that does not cover these arguments: a boolean mask index (data-dependent size)
    # a mask over a trailing dim (x[:, m]): not covered (masks over the leading dims are, masked.cpp)
    add("mask_index_not_covered", lambda x: x[:, x[0] > 0] * 2, [Input((6, 5), placements=S0)], M2)
    add("nonzero_static_int64", lambda x: torch.nonzero_static(x, size=12),
        [Input((3, 3), torch.int64, init=randint(-5, 5), placements=S0)], M4)
    # fallback output feeding rule ops, and gradients through both
    add("embedding_bag_then_matmul", lambda x, w: _embedding_bag_sum(x) @ w,
        [Input((6, 6), placements=S0), Input((6, 4), placements=["S(1)"])], M2)
    # in-place and out=: the result written back in the argument's own layout
    add("cumprod_inplace_sharded", in_place(lambda y: y.cumprod_(1)), [Input((6, 5), placements=S0)], M2,
        check_grad=False)
    add("cumsum_inplace_2d_mesh", in_place(lambda y: y.cumsum_(0)), [Input((5, 6), placements=["S(1)", "S(0)"])],
        M22, check_grad=False)
    add("cumsum_out_sharded", out_variant(lambda x, out: torch.cumsum(x, 1, out=out), [hs.Shard(0)]),
        [Input((5, 4), placements=S0)], M2, check_grad=False)
    return cases


def test_fallback_matches_one_device():
    assert_all_passed(run_cases(fallback_cases(), backend=DefaultModeAdapter(), timeout=600))


def _view_write_refused(x):
    if not in_distributed_run():
        return torch.zeros(1)
    v = x.detach().clone().unfold(0, 2, 1)  # a view op without a rule, of a gathered input
    v.add_(1)  # must raise: the write would not reach the sharded base
    return torch.zeros(1)


def _strict_mask_index(x):
    with hs.strict():
        return x[:, x[0] > 0]


def _strict_refuses(x):
    with hs.strict():
        return _embedding_bag_sum(x)


def _warns_once_and_counts_bytes(x):
    if not in_distributed_run():
        return torch.geqrf(torch.geqrf(x)[0])
    before = hs._C.dispatch_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.geqrf(torch.geqrf(x)[0])
    texts = [str(w.message) for w in caught if "aten::geqrf" in str(w.message)]
    assert len(texts) == 1 and "has no distributed rule" in texts[0] and "set_strict" in texts[0], texts
    after = hs._C.dispatch_stats()
    assert after["fallback_calls"] - before["fallback_calls"] == 2, (before, after)
    # the first call gathers the sharded [6, 5] float32 input (120 bytes); the second's is Replicate
    assert after["fallback_bytes"] - before["fallback_bytes"] == 6 * 5 * 4, (before, after)
    return out


def test_fallback_warns_views_refuse_writes_and_strict_mode_raises():
    cases = [
        Case("warns_once_per_op_and_counts_bytes", _warns_once_and_counts_bytes,
             [Input((6, 5), placements=["S(0)"], requires_grad=False)], M2),
        Case("view_of_gathered_input_refuses_writes", _view_write_refused, [Input((6, 5), placements=["S(0)"])], M2,
             expect_error="does not alias its base"),
        Case("strict_mask_index_raises_missing_operator_for_these_arguments", _strict_mask_index,
             [Input((6, 5), placements=["S(0)"])], M2,
             expect_error="Missing operator aten::index.Tensor for these arguments (a boolean mask index"),
        Case("strict_context_raises_missing_operator", _strict_refuses, [Input((6, 5), placements=["S(0)"])], M2,
             expect_error="Missing operator aten::_embedding_bag"),
    ]
    assert_all_passed(run_cases(cases, backend=DefaultModeAdapter(), timeout=300))
