"""Level 0: the elementwise losses (csrc/ops/elementwise_loss.cpp) -- mse, smooth_l1, huber,
soft_margin, binary_cross_entropy (with a weight), binary_cross_entropy_with_logits (with weight
and pos_weight) -- and their gradients, on real multi-process meshes against one process, in
strict mode (the harness), every reduction.

The point is the mean: a sharded loss must divide by the GLOBAL element count. Shapes are uneven
(5 rows over 2 and 4 ranks, 3 rows over 4: an empty shard) so a local mean would be wrong; the
inputs are sharded on rows, on columns, on both (2x2), or only one of self/target is sharded
(the other is cut locally). Sum and mean give a Partial(sum) scalar (checked); none keeps the
sharding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

hs = pytest.importorskip("hypershard")
from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases, uniform  # noqa: E402

M2 = ((2,), ("x",))
M4 = ((4,), ("x",))
M22 = ((2, 2), ("x", "y"))
REDUCTIONS = ("none", "sum", "mean")


def sign_init(shape, dtype, generator):
    return torch.randint(0, 2, shape, generator=generator).to(dtype) * 2 - 1


LOSSES = {  # name: (fn(x, y, *extra, reduction), extra inputs (shape of x -> list of Input), target init)
    "mse": (lambda x, y, r: F.mse_loss(x, y, reduction=r), None, None),
    "smooth_l1": (lambda x, y, r: F.smooth_l1_loss(x, y, reduction=r, beta=0.5), None, None),
    "huber": (lambda x, y, r: F.huber_loss(x, y, reduction=r, delta=0.7), None, None),
    "soft_margin": (lambda x, y, r: F.soft_margin_loss(x, y, reduction=r), None, sign_init),
    "bce": (lambda x, y, r: F.binary_cross_entropy(torch.sigmoid(x), y, reduction=r), None, uniform()),
    "bce_weight": (lambda x, y, w, r: F.binary_cross_entropy(torch.sigmoid(x), y, weight=w, reduction=r),
                   "full_weight", uniform()),
    "bce_logits": (lambda x, y, w, pw, r: F.binary_cross_entropy_with_logits(x, y, weight=w, pos_weight=pw, reduction=r),
                   "row_weights", uniform()),
}

LAYOUTS = {  # mesh: [(shape, self placements, target placements)]
    M2: [((5, 6), ["S(0)"], ["S(0)"]), ((5, 6), ["S(1)"], ["S(1)"]), ((5, 6), ["S(0)"], ["R"]),
         ((5, 6), ["R"], ["S(1)"])],
    M4: [((5, 6), ["S(0)"], ["S(0)"]), ((3, 6), ["S(0)"], ["S(0)"]), ((5, 6), ["R"], ["S(1)"])],
    M22: [((5, 6), ["S(0)", "S(1)"], ["S(0)", "S(1)"]), ((5, 6), ["S(1)", "R"], ["S(1)", "S(0)"])],
}


def extras(kind, shape, placements):
    if kind == "full_weight":  # a weight of self's shape, sharded like self
        return [Input(shape, placements=placements, init=uniform(0.5, 1.5), requires_grad=False)]
    if kind == "row_weights":  # weight and pos_weight broadcast along rows: [C], whole
        return [Input(shape[-1:], init=uniform(0.5, 1.5), requires_grad=False),
                Input(shape[-1:], init=uniform(0.5, 2.0), requires_grad=False)]
    return []


def expects_partial_scalar(fn, reduction):
    """The distributed run: the loss and, for sum/mean on a sharded input, its Partial(sum) layout."""
    def run(x, y, *rest):
        out = fn(x, y, *rest, reduction)
        if reduction != "none" and any(hs.layout_of(t).dim_axes != [[]] * t.dim() for t in (x, y)
                                       if isinstance(t, hs.DTensor)):
            assert hs.layout_of(out).has_partial(), hs.layout_of(out)
        return out
    return run


def cases():
    out = []
    for mesh, layouts in LAYOUTS.items():
        for shape, sp, tp in layouts:
            for name, (fn, extra, target_init) in LOSSES.items():
                for reduction in REDUCTIONS:
                    inputs = [Input(shape, placements=sp),
                              Input(shape, placements=tp, init=target_init, requires_grad=False)]
                    inputs += extras(extra, shape, sp)
                    label = f"{name}_{reduction}_{'x'.join(map(str, shape))}_{''.join(sp)}_{''.join(tp)}_{mesh[0]}"
                    out.append(Case(label, lambda *a, fn=fn, r=reduction: fn(*a, r), inputs, mesh,
                                    dist_fn=expects_partial_scalar(fn, reduction), check_grad=True))
    return out


def test_elementwise_losses_match_one_device():
    assert_all_passed(run_cases(cases(), backend="hypershard", timeout=600))


def _local_mean_is_wrong(x, y):
    """A planted fault: each rank's LOCAL mean, summed -- what a rule dividing by the local count gives."""
    mesh = current_mesh()
    local = F.mse_loss(x.to_local(), y.to_local(), reduction="mean")
    return hs.DTensor.from_local(local / mesh.size(), mesh, [hs.Partial()], shape=[])


def test_a_local_mean_would_be_caught():
    """5 rows over 4 ranks: a mean of local means differs from the global mean, and the harness sees it."""
    case = Case("planted_local_mean", lambda x, y: F.mse_loss(x, y),
                [Input((5, 6), placements=["S(0)"]), Input((5, 6), placements=["S(0)"], requires_grad=False)],
                M4, dist_fn=_local_mean_is_wrong, check_grad=False)
    result = run_cases([case], backend="hypershard", timeout=300)
    assert not result.ok, "the planted local mean passed"
