"""UT (no processes): what the boolean-mask rules plan (csrc/ops/masked.cpp): with self sharded on dim 0
only, masked_scatter and index_put keep that sharding (the mask follows it, source/values whole) and
run their own implementation (one all-gather of the per-rank counts gives the GLOBAL offset);
self[mask] gathers the selected rows into a Replicate result; any other sharding is planned whole.
A mask that is not self's leading dims (or does not broadcast) is not covered."""

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh, plan

A = torch.ops.aten


def test_masked_scatter_keeps_dim0_sharding():
    m = PlanningMesh({"dp": 2, "tp": 2})
    x = m.dtensor([5, 4, 3], ["S(0)", "R"])
    p = plan(A.masked_scatter.default, x, m.dtensor([5, 4, 1], ["S(0)", "R"], dtype=torch.bool), m.dtensor([60], ["R", "R"]))
    assert p.input_specs == [["S(0)", "R"], ["S(0)", "R"], ["R", "R"]] and p.output_specs == [["S(0)", "R"]]
    assert p.expands
    # another dim sharded: everything whole, the plain kernel
    p = plan(A.masked_scatter.default, m.dtensor([5, 4], ["R", "S(1)"]), m.dtensor([5, 4], ["R", "R"], dtype=torch.bool),
             m.dtensor([20], ["R", "R"]))
    assert p.input_specs == [["R", "R"]] * 3 and p.output_specs == [["R", "R"]] and not p.expands


def test_index_with_a_mask_gathers_the_selected_rows():
    m = PlanningMesh({"dp": 4})
    x, mask = m.dtensor([5, 4, 3], ["S(0)"]), m.dtensor([5, 4], ["S(0)"], dtype=torch.bool)
    p = plan(A.index.Tensor, x, [mask])
    assert p.input_specs == [["S(0)"], ["S(0)"]] and p.output_specs == [["R"]] and p.expands


def test_index_put_with_a_mask_keeps_self_sharded():
    m = PlanningMesh({"dp": 2})
    x, mask = m.dtensor([5, 4, 3], ["S(0)"]), m.dtensor([5, 4], ["R"], dtype=torch.bool)
    p = plan(A.index_put.default, x, [mask], m.dtensor([7, 3], ["R"]))
    assert p.input_specs == [["S(0)"], ["S(0)"], ["R"]] and p.output_specs == [["S(0)"]] and p.expands


def test_partial_write_is_refused_and_odd_masks_not_covered():
    m = PlanningMesh({"dp": 2})
    with pytest.raises(hs.LayoutError, match="aten::index_put: argument self"):
        plan(A.index_put.default, m.dtensor([4, 3], [hs.Partial()]), [m.dtensor([4], ["R"], dtype=torch.bool)],
             m.dtensor([3], ["R"]))
    with pytest.raises(Exception, match="not self's leading dims"):
        plan(A.index.Tensor, m.dtensor([4, 3], ["S(0)"]), [m.dtensor([3], ["R"], dtype=torch.bool)])
