"""Level 0: the elementwise losses (csrc/ops/elementwise_loss.cpp) -- mse, smooth_l1, huber,
soft_margin, binary_cross_entropy (with a weight), binary_cross_entropy_with_logits (with weight
and pos_weight), and the per-sample multi_margin / multilabel_margin losses -- and their gradients, on real multi-process meshes against one process, in
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


def multilabel_targets(shape, dtype, generator):
    """Two target classes per row, then -1 (the end of each row's list)."""
    rows, classes = shape
    t = torch.full(shape, -1, dtype=torch.int64)
    t[:, 0] = torch.randint(0, classes, (rows,), generator=generator)
    t[:, 1] = (t[:, 0] + 1 + torch.randint(0, classes - 1, (rows,), generator=generator)) % classes
    return t


def class_targets(classes):
    return lambda shape, dtype, generator: torch.randint(0, classes, shape, generator=generator)


def per_sample_cases():
    """multi_margin_loss and multilabel_margin_loss: a loss per row of classes, reduced over the
    GLOBAL row count (5 rows over 2 and 4 ranks, 3 over 4: an empty shard); rows sharded, the class
    dim sharded (made whole), a class weight whole."""
    out = []
    layouts = ((M2, ["S(0)"]), (M4, ["S(0)"]), (M4, ["S(1)"]), (M22, ["S(0)", "S(1)"]))
    for mesh, sp in layouts:
        rows_only = [p if p == "S(0)" else "R" for p in sp]  # the [N] target: the rows' sharding
        for rows in (5, 3):
            tag = f"{rows}_{''.join(sp)}_{mesh[0]}"
            for r in REDUCTIONS:
                out.append(Case(f"multi_margin_{r}_{tag}", lambda x, y, r=r: F.multi_margin_loss(x, y, reduction=r),
                                [Input((rows, 6), placements=sp),
                                 Input((rows,), torch.int64, placements=rows_only, init=class_targets(6))], mesh))
                out.append(Case(f"multi_margin_p2_weight_{r}_{tag}",
                                lambda x, y, w, r=r: F.multi_margin_loss(x, y, p=2, margin=0.7, weight=w, reduction=r),
                                [Input((rows, 6), placements=sp),
                                 Input((rows,), torch.int64, placements=rows_only, init=class_targets(6)),
                                 Input((6,), init=uniform(0.5, 1.5), requires_grad=False)], mesh))
                out.append(Case(f"multilabel_margin_{r}_{tag}",
                                lambda x, y, r=r: F.multilabel_margin_loss(x, y, reduction=r),
                                [Input((rows, 6), placements=sp),
                                 Input((rows, 6), torch.int64, placements=sp, init=multilabel_targets)], mesh))
    return out


def test_elementwise_losses_match_one_device():
    assert_all_passed(run_cases(cases() + per_sample_cases(), backend="hypershard", timeout=600))


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
