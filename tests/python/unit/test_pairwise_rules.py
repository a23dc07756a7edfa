"""UT (no processes): what the pairwise rules plan (csrc/ops/pairwise.cpp): cdist keeps the batch
and both row dims (on distinct axes), the feature dim whole, its backward Partial(sum) over x2's
row axes, p = 2's algorithm pinned to the global row counts; pdist whole; _trilinear keeps the
kept dims of every operand that has them and makes the summed dims whole; no Partial passes."""

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh, plan

A = torch.ops.aten


def test_cdist_rows_and_batch():
    m = PlanningMesh({"dp": 2, "tp": 2})
    p = plan(A._cdist_forward.default, m.dtensor([3, 7, 5], ["S(1)", "R"]), m.dtensor([3, 6, 5], ["R", "S(1)"]), 1.0, None)
    assert p.input_specs == [["S(1)", "R"], ["R", "S(1)"]] and p.output_specs == [["S(1)", "S(2)"]]
    assert not p.localizes  # p = 1: one algorithm
    # the same axis on both row dims: x1's rows keep it, x2's are whole
    p = plan(A._cdist_forward.default, m.dtensor([3, 7, 5], ["S(0)", "S(1)"]), m.dtensor([3, 6, 5], ["S(0)", "S(1)"]),
             2.0, None)
    assert p.input_specs == [["S(0)", "S(1)"], ["S(0)", "R"]] and p.output_specs == [["S(0)", "S(1)"]]
    assert p.localizes  # p = 2 with sharded rows: compute_mode pinned to the global choice
    # the feature dim is gathered
    p = plan(A._cdist_forward.default, m.dtensor([3, 7, 5], ["S(2)", "R"]), m.dtensor([3, 6, 5], ["R", "R"]), 2.0, None)
    assert p.input_specs == [["R", "R"], ["R", "R"]] and not p.localizes
    # a broadcast batch is whole
    p = plan(A._cdist_forward.default, m.dtensor([3, 7, 5], ["S(0)", "R"]), m.dtensor([1, 6, 5], ["R", "R"]), 1.0, None)
    assert p.input_specs == [["R", "R"], ["R", "R"]] and list(p.outputs[0].global_shape) == [3, 7, 6]


def test_cdist_backward_sums_over_x2_rows():
    m = PlanningMesh({"dp": 2, "tp": 2})
    grad, dist = m.dtensor([3, 7, 6], ["S(1)", "S(2)"]), m.dtensor([3, 7, 6], ["R", "R"])
    x1, x2 = m.dtensor([3, 7, 5], ["R", "R"]), m.dtensor([3, 6, 5], ["R", "R"])
    p = plan(A._cdist_backward.default, grad, x1, x2, 2.0, dist)
    assert p.input_specs == [["S(1)", "S(2)"], ["S(1)", "R"], ["R", "S(1)"], ["S(1)", "S(2)"]]
    assert p.output_specs == [["S(1)", "P"]]


def test_cdist_refuses_partial():
    m = PlanningMesh({"dp": 2})
    with pytest.raises(Exception, match=r"hypershard: aten::_cdist_forward: argument x1 \(#0\) .*Partial\(sum\) input "
                                        r"is not supported by this op; allowed: Replicate or Shard"):
        plan(A._cdist_forward.default, m.dtensor([3, 7, 5], [hs.Partial()]), m.dtensor([3, 6, 5], ["R"]), 2.0, None)
    with pytest.raises(Exception, match="X1 and X2 must have the same number of columns"):  # torch's, before anything runs
        plan(A._cdist_forward.default, m.dtensor([3, 7, 5], ["S(0)"]), m.dtensor([3, 6, 4], ["R"]), 2.0, None)


def test_pdist_is_whole():
    m = PlanningMesh({"dp": 2})
    p = plan(A._pdist_forward.default, m.dtensor([7, 5], ["S(0)"]), 2.0)
    assert p.input_specs == [["R"]] and p.output_specs == [["R"]] and list(p.outputs[0].global_shape) == [21]


def test_trilinear_bilinear_layout():
    m = PlanningMesh({"dp": 2, "tp": 2})
    x1, w, x2 = m.dtensor([5, 4], ["S(0)", "R"]), m.dtensor([6, 4, 3], ["R", "S(0)"]), m.dtensor([5, 3], ["R", "R"])
    p = plan(A._trilinear.default, x1, w, x2, [1, 3], [0], [1, 2], [2, 3])
    assert p.input_specs == [["S(0)", "R"], ["R", "S(0)"], ["S(0)", "R"]] and p.output_specs == [["S(0)", "S(1)"]]
    # a summed (in-feature) dim sharded: whole
    p = plan(A._trilinear.default, m.dtensor([5, 4], ["S(1)", "R"]), m.dtensor([6, 4, 3], ["R", "R"]), x2,
             [1, 3], [0], [1, 2], [2, 3])
    assert p.input_specs == [["R", "R"]] * 3 and p.output_specs == [["R", "R"]]
    with pytest.raises(Exception, match=r"argument i2 \(#1\) .*Partial\(sum\) input is not supported by this op"):
        plan(A._trilinear.default, x1, m.dtensor([6, 4, 3], [hs.Partial(), "R"]), x2, [1, 3], [0], [1, 2], [2, 3])
