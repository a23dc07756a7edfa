"""UT (no processes): what the elementwise-loss rules plan (csrc/ops/elementwise_loss.cpp): the most
sharded of self/target wins and the other is cut locally; none keeps the sharding; sum and mean give
a Partial(sum) scalar over the sharding axes (mean divides by the GLOBAL count in its expand); the
backward takes grad_output whole for sum/mean; Partial inputs are refused, a broadcast target is not
covered."""

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh, plan

A = torch.ops.aten
MEAN, SUM, NONE = 1, 2, 0


@pytest.mark.parametrize("op", [A.mse_loss.default, A.smooth_l1_loss.default, A.huber_loss.default,
                                A.soft_margin_loss.default, A.binary_cross_entropy.default])
def test_forward_layouts(op):
    m = PlanningMesh({"dp": 2, "tp": 2})
    x, y = m.dtensor([5, 6], ["S(0)", "R"]), m.dtensor([5, 6], ["R", "S(1)"])
    p = plan(op, x, y, reduction=NONE)  # equally sharded: self's wins, target is cut locally
    assert p.input_specs[:2] == [["S(0)", "R"], ["S(0)", "R"]] and p.output_specs == [["S(0)", "R"]]
    p = plan(op, x, m.dtensor([5, 6], ["S(0)", "S(1)"]), reduction=NONE)  # target more sharded: its
    assert p.input_specs[:2] == [["S(0)", "S(1)"], ["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "S(1)"]]
    x2 = m.dtensor([5, 6], ["S(0)", "S(1)"])
    for reduction in (SUM, MEAN):
        p = plan(op, x2, y, reduction=reduction)
        assert p.input_specs[:2] == [["S(0)", "S(1)"], ["S(0)", "S(1)"]]
        assert p.output_specs == [["P", "P"]] and p.expands
    p = plan(op, m.dtensor([5, 6], ["R", "R"]), m.dtensor([5, 6], ["R", "R"]), reduction=MEAN)
    assert p.output_specs == [["R", "R"]] and not p.expands  # whole inputs: torch's own mean


def test_backward_takes_a_whole_scalar_grad():
    m = PlanningMesh({"dp": 4})
    x, y = m.dtensor([5, 6], ["S(0)"]), m.dtensor([5, 6], ["S(0)"])
    p = plan(A.mse_loss_backward.default, m.dtensor([], ["R"]), x, y, MEAN)
    assert p.input_specs == [["R"], ["S(0)"], ["S(0)"]] and p.output_specs == [["S(0)"]] and p.expands
    p = plan(A.mse_loss_backward.default, m.dtensor([5, 6], ["S(0)"]), x, y, NONE)
    assert p.input_specs[0] == ["S(0)"] and not p.expands


def test_weights_broadcast_into_the_sharding():
    m = PlanningMesh({"dp": 2})
    x, y = m.dtensor([5, 6], ["S(1)"]), m.dtensor([5, 6], ["S(1)"])
    w, pw = m.dtensor([6], ["R"]), m.dtensor([6], ["R"])
    p = plan(A.binary_cross_entropy_with_logits.default, x, y, w, pw, reduction=MEAN)
    assert p.input_specs == [["S(1)"], ["S(1)"], ["S(0)"], ["S(0)"]] and p.output_specs == [["P"]]  # [C] along dim 1


def test_partial_input_is_refused():
    m = PlanningMesh({"dp": 2})
    x = m.dtensor([4, 4], [hs.Partial()])
    with pytest.raises(hs.LayoutError, match=r"hypershard: aten::mse_loss: argument self .*Partial\(sum\) input is not "
                                           r"supported: the loss term is not linear in it"):
        plan(A.mse_loss.default, x, m.dtensor([4, 4], ["R"]))


def test_broadcast_target_is_not_covered():
    m = PlanningMesh({"dp": 2})
    with pytest.raises(Exception, match="target of shape \\[6\\] broadcast to self's \\[4, 6\\]"):
        plan(A.mse_loss.default, m.dtensor([4, 6], ["S(0)"]), m.dtensor([6], ["R"]))
