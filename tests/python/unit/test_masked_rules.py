"""UT (no processes): what the boolean-mask rules plan (csrc/ops/masked.cpp): self (grad) keeps its
sharding on the dims the mask covers -- the batch, the sequence or both -- the mask follows it, the
source/values are whole, and the op runs its own implementation (one all-reduce of a small grid of
run counts gives every element's GLOBAL position); self[mask] and masked_scatter_backward give a
Replicate result of the selected elements; self's dims after the mask's are planned whole, and an
unsharded call runs the plain kernel. A mask that is not self's leading dims (or does not broadcast)
is not covered."""

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh, plan

A = torch.ops.aten


def test_masked_scatter_keeps_any_sharding():
    m = PlanningMesh({"dp": 2, "cp": 2})
    src = m.dtensor([60], ["R", "R"])
    # batch over dp, sequence over cp; the [B, S, 1] mask follows both, its broadcast dim whole
    x = m.dtensor([5, 4, 3], ["S(0)", "S(1)"])
    p = plan(A.masked_scatter.default, x, m.dtensor([5, 4, 1], ["S(0)", "S(1)"], dtype=torch.bool), src)
    assert p.input_specs == [["S(0)", "S(1)"], ["S(0)", "S(1)"], ["R", "R"]] and p.output_specs == [["S(0)", "S(1)"]]
    assert p.expands
    # the hidden dim sharded: the mask broadcast along it stays whole there
    p = plan(A.masked_scatter.default, m.dtensor([5, 4, 6], ["R", "S(2)"]),
             m.dtensor([5, 4, 1], ["R", "R"], dtype=torch.bool), src)
    assert p.input_specs == [["R", "S(2)"], ["R", "R"], ["R", "R"]] and p.output_specs == [["R", "S(2)"]]
    assert p.expands
    # nothing sharded: the plain kernel
    whole = m.dtensor([5, 4], ["R", "R"])
    p = plan(A.masked_scatter.default, whole, m.dtensor([5, 4], ["R", "R"], dtype=torch.bool), m.dtensor([20], ["R", "R"]))
    assert p.input_specs == [["R", "R"]] * 3 and not p.expands


def test_masked_scatter_backward_gives_the_whole_source_gradient():
    m = PlanningMesh({"cp": 4})
    grad = m.dtensor([2, 8, 3], ["S(1)"])
    p = plan(A.masked_scatter_backward.default, grad, m.dtensor([2, 8, 1], ["R"], dtype=torch.bool), [5, 3])
    assert p.input_specs == [["S(1)"], ["S(1)"]] and p.output_specs == [["R"]] and p.expands
    assert list(p.outputs[0].global_shape) == [5, 3]  # the sizes argument, keyed: another size is another plan
    assert list(plan(A.masked_scatter_backward.default, grad, m.dtensor([2, 8, 1], ["R"], dtype=torch.bool),
                [7, 3]).outputs[0].global_shape) == [7, 3]
    # a sum-Partial gradient stays Partial (the selection is linear)
    p = plan(A.masked_scatter_backward.default, m.dtensor([2, 8, 3], [hs.Partial()]),
             m.dtensor([2, 8, 1], ["R"], dtype=torch.bool), [5, 3])
    assert p.input_specs == [["P"], ["R"]] and p.output_specs == [["P"]] and not p.expands


def test_index_with_a_mask_gathers_the_selected_rows():
    m = PlanningMesh({"dp": 2, "cp": 2})
    x, mask = m.dtensor([5, 4, 3], ["S(0)", "S(1)"]), m.dtensor([5, 4], ["R", "R"], dtype=torch.bool)
    p = plan(A.index.Tensor, x, [mask])
    assert p.input_specs == [["S(0)", "S(1)"], ["S(0)", "S(1)"]] and p.output_specs == [["R", "R"]] and p.expands
    # self's dims after the mask's are planned whole
    p = plan(A.index.Tensor, m.dtensor([5, 4, 6], ["S(1)", "S(2)"]), [mask])
    assert p.input_specs == [["S(1)", "R"], ["S(1)", "R"]] and p.expands


def test_index_put_with_a_mask_keeps_self_sharded():
    m = PlanningMesh({"cp": 2})
    x, mask = m.dtensor([2, 5, 3], ["S(1)"]), m.dtensor([2, 5], ["R"], dtype=torch.bool)
    p = plan(A.index_put.default, x, [mask], m.dtensor([7, 3], ["R"]))
    assert p.input_specs == [["S(1)"], ["S(1)"], ["R"]] and p.output_specs == [["S(1)"]] and p.expands


def test_partial_write_is_refused_and_odd_masks_not_covered():
    m = PlanningMesh({"dp": 2})
    with pytest.raises(hs.LayoutError, match="aten::index_put: argument self"):
        plan(A.index_put.default, m.dtensor([4, 3], [hs.Partial()]), [m.dtensor([4], ["R"], dtype=torch.bool)],
             m.dtensor([3], ["R"]))
    with pytest.raises(Exception, match="not self's leading dims"):
        plan(A.index.Tensor, m.dtensor([4, 3], ["S(0)"]), [m.dtensor([3], ["R"], dtype=torch.bool)])
    with pytest.raises(Exception, match="does not broadcast to grad_output's"):
        plan(A.masked_scatter_backward.default, m.dtensor([4, 3], ["S(0)"]), m.dtensor([4, 2], ["R"], dtype=torch.bool),
             [6])
