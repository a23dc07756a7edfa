"""Level0: default mode's torch-parity implicit redistribution, on real meshes, against one device.

When an op's rule refuses the inputs' layouts, default mode asks it again with the inputs
redistributed (Partial reduced first, then shards gathered over the fewest mesh axes) instead of
raising, as PyTorch's DTensor does:
- a row-parallel Linear's Partial(sum) output fed straight to cross_entropy, relu, softmax,
  RMSNorm and SDPA (forward, and the gradients through the same path);
- views that would cut a shard (an uneven dim merged, a head dim cut by the shard boundary,
  labels.view(-1) on an uneven batch) on 1-D and 2-D meshes.
Each case checks in the distributed run that the implicit path served it
(dispatch_stats()['implicit_calls'] grew). A redistributed view does not alias its base: a write
through it, a write into its base while it lives, and a read of it after its base was written
another way all raise. Strict mode raises the rule's error for the same calls, also after
default mode cached the redistributed plan.
"""


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
M4 = ((4,), ("tp",))
M22 = ((2, 2), ("dp", "tp"))


def implicitly(fn):
    """fn, asserting in the distributed run that some rule's refusal was answered by redistributing."""
    return counting("implicit_calls", fn)


def row_parallel(x, w):
    """x @ w.T with the contracted dim sharded on both: a Partial(sum) result on the mesh."""
    y = F.linear(x, w)
    if in_distributed_run():
        assert any(p.is_partial() for p in y.placements), y.placements
    return y


def partial_cases():
    cases = []

    def add(name, fn, x_shape, out_features, mesh=M2, extra=()):
        inputs = [Input(x_shape, placements=[f"S({len(x_shape) - 1})"]),
                  Input((out_features, x_shape[-1]), placements=["S(1)"]), *extra]
        cases.append(Case(name, implicitly(fn), inputs, mesh))

    add("partial_to_relu", lambda x, w: torch.relu(row_parallel(x, w)), (6, 8), 5)
    add("partial_to_softmax", lambda x, w: torch.softmax(row_parallel(x, w), -1), (6, 8), 5)
    add("partial_to_cross_entropy", lambda x, w, t: F.cross_entropy(row_parallel(x, w), t), (6, 8), 7,
        extra=[Input((6,), torch.int64, init=randint(0, 7))])
    add("partial_to_rms_norm", lambda x, w, g: F.rms_norm(row_parallel(x, w), (5,), g, 1e-6), (3, 4, 8), 5,
        extra=[Input((5,))])
    add("partial_to_sdpa", lambda x, w, k, v: F.scaled_dot_product_attention(row_parallel(x, w), k, v),
        (2, 3, 4, 8), 6, extra=[Input((2, 3, 5, 6)), Input((2, 3, 5, 6))])
    add("partial_to_relu_4_ranks", lambda x, w: torch.relu(row_parallel(x, w)), (5, 12), 3, mesh=M4)
    return cases


def view_cases():
    cases = []

    def add(name, fn, shape, placements, mesh=M2):
        cases.append(Case(name, implicitly(fn), [Input(shape, placements=placements)], mesh))

    # labels.view(-1) on an uneven batch: rows 3 + 2 of 3 become 9 + 6 elements, not chunks 8 + 7
    add("view_flat_uneven_batch", lambda x: x.view(-1) * 2, (5, 3), ["S(0)"])
    add("view_cuts_head_dim", lambda x: x.view(4, 2, 6) * 2, (4, 12), ["S(1)"], M4)
    add("view_as_cuts_merge", lambda x: x.view_as(torch.empty(15)) * 2, (5, 3), ["S(0)"])
    add("flatten_2d_mesh", lambda x: x.flatten(0, 1) * 2, (3, 4, 5), ["S(0)", "S(1)"], M22)
    add("view_2d_mesh_one_axis_kept", lambda x: x.view(4, 3, 10) * 2, (4, 6, 5), ["S(0)", "S(1)"], M22)
    return cases


def test_partial_inputs_are_reduced_implicitly():
    assert_all_passed(run_cases(partial_cases(), backend=DefaultModeAdapter(), timeout=600))


def test_views_that_would_cut_a_shard_redistribute():
    assert_all_passed(run_cases(view_cases(), backend=DefaultModeAdapter(), timeout=600))


# ------------------------------------------------------------------ what a non-aliasing view refuses

def _only_distributed(body):
    def run(x):
        if in_distributed_run():
            body(x.detach().clone())
        return torch.zeros(1)
    return run


def _write_through_view(y):
    y.view(-1).add_(1)


def _write_base_while_view_lives(y):
    v = y.view(-1)
    y.add_(1)
    del v


def _read_view_after_base_written(y):
    v = y.view(-1)
    y[:, 0].add_(1)  # a local view of y (dim 1 is whole): it aliases y, not v
    v.sum()


def _view_dropped_then_base_written(x):
    y = x.detach().clone()
    v = y.view(-1)
    out = v * 2
    del v
    y.add_(1)  # the view is gone: nothing is lost
    return out + y.view(5, 3).sum()


def _strict_after_default(x, w):
    torch.relu(row_parallel(x, w))  # default mode caches the redistributed plan
    with hs.strict():
        return torch.relu(row_parallel(x, w))


def _strict_view(x):
    with hs.strict():
        return x.view(-1)


def test_redistributed_views_refuse_lost_writes_and_strict_mode_raises():
    S0 = ["S(0)"]
    cases = [
        Case("write_through_redistributed_view", _only_distributed(_write_through_view), [Input((5, 3), placements=S0)],
             M2, expect_error="does not alias its base"),
        Case("write_base_while_view_lives", _only_distributed(_write_base_while_view_lives),
             [Input((5, 3), placements=S0)], M2, expect_error="has a live view that had to be redistributed"),
        Case("read_view_after_base_written", _only_distributed(_read_view_after_base_written),
             [Input((5, 3), placements=S0)], M2, expect_error="its values are stale"),
        Case("view_dropped_then_base_written", _view_dropped_then_base_written, [Input((5, 3), placements=S0)], M2),
        Case("strict_raises_after_default_cached_the_plan", _strict_after_default,
             [Input((6, 8), placements=["S(1)"]), Input((5, 8), placements=["S(1)"])], M2,
             expect_error="Partial(sum) input is not supported"),
        Case("strict_view_raises", _strict_view, [Input((5, 3), placements=S0)], M2,
             expect_error="would cut through a sharded dim"),
    ]
    assert_all_passed(run_cases(cases, backend=DefaultModeAdapter(), timeout=300))
