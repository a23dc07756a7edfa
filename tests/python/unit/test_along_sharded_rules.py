"""UT (no processes): what the rules that keep a sharded dim sharded plan (csrc/ops/along_sharded.cpp,
convolution.cpp's halo, views.cpp's exchanged slices): the scanned, flipped, rolled, convolved or
sliced dim stays sharded in the inputs and outputs and the op runs its own implementation (an
exchange); where the exchange does not apply (a dim sharded over two axes for the moves, a
transposed convolution, roll over the flattened tensor) the dim is planned whole. The non-linear
scans refuse a sum-Partial input; the linear ones keep it."""

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh, plan

A = torch.ops.aten


@pytest.mark.parametrize("op", [A.cumsum.default, A.cumprod.default, A.logcumsumexp.default, A.cummax.default,
                                A.cummin.default])
def test_scans_keep_the_scanned_dim_sharded(op):
    m = PlanningMesh({"dp": 2, "tp": 2})
    p = plan(op, m.dtensor([5, 11], ["S(0)", "S(1)"]), 1)
    assert p.input_specs == [["S(0)", "S(1)"]] and p.expands
    assert all(s == ["S(0)", "S(1)"] for s in p.output_specs)
    # over both axes too (one all-gather per axis)
    p = plan(op, m.dtensor([5, 11], ["S(1)", "S(1)"]), 1)
    assert p.input_specs == [["S(1)", "S(1)"]] and p.expands
    # along a whole dim: the plain local kernel
    p = plan(op, m.dtensor([5, 11], ["S(0)", "R"]), 1)
    assert p.input_specs == [["S(0)", "R"]] and not p.expands


def test_partial_through_cumsum_but_not_cumprod():
    m = PlanningMesh({"dp": 2, "tp": 2})
    x = m.dtensor([5, 11], [hs.Partial(), "S(1)"])
    p = plan(A.cumsum.default, x, 1)
    assert p.input_specs == [["P", "S(1)"]] and p.output_specs == [["P", "S(1)"]]
    with pytest.raises(hs.LayoutError, match="aten::cumprod: argument self"):
        plan(A.cumprod.default, x, 1)


def test_complex_logcumsumexp_makes_the_dim_whole():
    m = PlanningMesh({"tp": 4})
    p = plan(A.logcumsumexp.default, m.dtensor([5, 11], ["S(1)"], dtype=torch.complex64), 1)
    assert p.input_specs == [["R"]] and not p.expands


def test_flip_and_roll_exchange_over_one_axis():
    m = PlanningMesh({"dp": 2, "tp": 2})
    for op, args in ((A.flip.default, ([0, 1],)), (A.roll.default, ([2, -3], [0, 1]))):
        p = plan(op, m.dtensor([5, 11], ["S(0)", "S(1)"]), *args)
        assert p.input_specs == [["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "S(1)"]] and p.expands
        # a dim sharded over two axes is made whole
        p = plan(op, m.dtensor([5, 11], ["S(1)", "S(1)"]), *args)
        assert p.input_specs == [["R", "R"]] and not p.expands
    # roll over the flattened tensor (no dims): every dim whole
    p = plan(A.roll.default, m.dtensor([5, 11], ["S(0)", "S(1)"]), [3])
    assert p.input_specs == [["R", "R"]] and not p.expands


def test_convolution_halo_keeps_the_spatial_dim_sharded():
    m = PlanningMesh({"dp": 2, "sp": 2})
    x, w = m.dtensor([4, 3, 20], ["S(0)", "S(2)"]), m.dtensor([5, 3, 3], ["R", "R"])
    p = plan(A.convolution.default, x, w, None, [1], [1], [1], False, [0], 1)
    assert p.input_specs == [["S(0)", "S(2)"], ["R", "R"]] and p.output_specs == [["S(0)", "S(2)"]] and p.expands
    # backward: grad_input like the input, grad_weight / grad_bias Partial over batch and halo axes
    go = m.dtensor([4, 5, 20], ["S(0)", "S(2)"])
    p = plan(A.convolution_backward.default, go, x, w, [5], [1], [1], [1], False, [0], 1, [True, True, True])
    assert p.output_specs == [["S(0)", "S(2)"], ["P", "P"], ["P", "P"]] and p.expands
    # transposed: the length is gathered
    p = plan(A.convolution.default, x, m.dtensor([3, 5, 3], ["R", "R"]), None, [1], [0], [1], True, [0], 1)
    assert p.input_specs[0] == ["S(0)", "R"] and not p.expands


def test_slice_of_a_sharded_dim_stays_sharded():
    m = PlanningMesh({"tp": 4})
    x = m.dtensor([5, 11], ["S(1)"])
    p = plan(A.slice.Tensor, x, 1, 2, 10, 3)
    assert p.input_specs == [["S(1)"]] and p.output_specs == [["S(1)"]] and p.expands
    p = plan(A.slice_backward.default, m.dtensor([5, 3], ["S(1)"]), [5, 11], 1, 2, 10, 3)
    assert p.output_specs == [["S(1)"]] and p.expands
    # over two axes: gathered (the plain slice on the whole dim)
    m2 = PlanningMesh({"dp": 2, "tp": 2})
    p = plan(A.slice.Tensor, m2.dtensor([5, 11], ["S(1)", "S(1)"]), 1, 2, 10, 3)
    assert p.input_specs == [["R", "R"]] and not p.expands


def test_topk_merges_candidates_of_a_sharded_dim():
    m = PlanningMesh({"dp": 2, "tp": 2})
    p = plan(A.topk.default, m.dtensor([5, 11], ["S(0)", "S(1)"]), 3, 1)
    assert p.input_specs == [["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "R"]] * 2 and p.expands
    p = plan(A.topk.default, m.dtensor([5, 11], ["S(0)", "R"]), 3, 1)
    assert p.output_specs == [["S(0)", "R"]] * 2 and not p.expands
    with pytest.raises(Exception, match="k not in range"):
        plan(A.topk.default, m.dtensor([5, 11], ["S(0)", "S(1)"]), 12, 1)
    with pytest.raises(hs.LayoutError, match="aten::topk: argument self"):
        plan(A.topk.default, m.dtensor([5, 11], [hs.Partial(), "S(1)"]), 3, 1)


def test_sort_keeps_a_dim_sharded_over_one_axis():
    m = PlanningMesh({"dp": 2, "tp": 2})
    x = m.dtensor([5, 11], ["S(0)", "S(1)"])
    for op, args, kwargs, outputs in ((A.sort.default, (1,), {}, 2), (A.sort.stable, (), {"stable": True, "dim": 1}, 2)):
        p = plan(op, x, *args, **kwargs)
        assert p.input_specs == [["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "S(1)"]] * outputs and p.expands
    p = plan(A.msort.default, m.dtensor([11, 5], ["S(1)", "S(0)"]))  # along dim 0
    assert p.input_specs == [["S(1)", "S(0)"]] and p.output_specs == [["S(1)", "S(0)"]] and p.expands
    # along a whole dim: the local sort; over two axes: the dim made whole
    p = plan(A.sort.default, m.dtensor([5, 11], ["S(0)", "R"]), 1)
    assert p.output_specs == [["S(0)", "R"]] * 2 and not p.expands
    p = plan(A.sort.default, m.dtensor([5, 11], ["S(1)", "S(1)"]), 1)
    assert p.input_specs == [["R", "R"]] and not p.expands
    # a non-stable sort of integers (MoE expert ids): planned whole; a stable one exchanges
    ids = m.dtensor([5, 11], ["S(0)", "S(1)"], dtype=torch.int64)
    p = plan(A.sort.default, ids, 1)
    assert p.input_specs == [["S(0)", "R"]] and not p.expands
    p = plan(A.sort.stable, ids, stable=True, dim=1)
    assert p.input_specs == [["S(0)", "S(1)"]] and p.expands
    with pytest.raises(hs.LayoutError, match="aten::sort: argument self"):
        plan(A.sort.default, m.dtensor([5, 11], [hs.Partial(), "S(1)"]), 1)


def test_lookups_keep_the_query_sharded():
    m = PlanningMesh({"dp": 2, "tp": 2})
    v = m.dtensor([5, 7], ["S(0)", "S(1)"])
    p = plan(A.searchsorted.Tensor, m.dtensor([9], ["S(0)", "R"]), v)
    assert p.input_specs == [["R", "R"], ["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "S(1)"]]
    # an N-D table: its rows go with the query's rows, its searched dim whole
    p = plan(A.searchsorted.Tensor, m.dtensor([5, 6], ["R", "S(1)"]), v)
    assert p.input_specs == [["S(0)", "R"], ["S(0)", "S(1)"]]
    p = plan(A.bucketize.Tensor, v, m.dtensor([6], ["R", "S(0)"]))
    assert p.input_specs == [["S(0)", "S(1)"], ["R", "R"]] and p.output_specs == [["S(0)", "S(1)"]]
    with pytest.raises(hs.LayoutError, match="aten::bucketize.Tensor: argument self"):
        plan(A.bucketize.Tensor, m.dtensor([5, 7], [hs.Partial(), "R"]), m.dtensor([6], ["R", "R"]))
    i = m.dtensor([5, 7], ["S(0)", "S(1)"], dtype=torch.int64)
    p = plan(A.take.default, m.dtensor([4, 6], ["S(0)", "R"]), i)
    assert p.input_specs == [["R", "R"], ["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "S(1)"]]


def test_put_accumulate_is_partial_over_the_index_axes():
    m = PlanningMesh({"dp": 2, "tp": 2})
    i = m.dtensor([5, 7], ["S(0)", "R"], dtype=torch.int64)
    p = plan(A.put.default, m.dtensor([4, 6], ["R", "S(1)"]), i, m.dtensor([5, 7], ["R", "R"]), True)
    assert p.input_specs == [["P", "R"], ["S(0)", "R"], ["S(0)", "R"]] and p.output_specs == [["P", "R"]]
    p = plan(A.put.default, m.dtensor([4, 6], ["R", "S(1)"]), i, m.dtensor([5, 7], ["R", "R"]), False)
    assert p.input_specs == [["R", "R"]] * 3


def test_bincount_counts_are_partial_and_data_shaped():
    m = PlanningMesh({"dp": 4})
    p = plan(A.bincount.default, m.dtensor([13], ["S(0)"], dtype=torch.int64))
    assert p.input_specs == [["S(0)"]] and p.output_specs == [["P"]] and p.expands
    with pytest.raises(hs.LayoutError, match="aten::bincount: argument self"):
        plan(A.bincount.default, m.dtensor([13], [hs.Partial()], dtype=torch.int64))


def test_grouped_convolution_keeps_its_channels_sharded():
    m = PlanningMesh({"dp": 2, "tp": 2})
    x, w, b = m.dtensor([4, 8, 10], ["S(0)", "S(1)"]), m.dtensor([8, 1, 3], ["R", "R"]), m.dtensor([8], ["R", "R"])
    p = plan(A.convolution.default, x, w, b, [1], [1], [1], False, [0], 8)
    assert p.input_specs == [["S(0)", "S(1)"], ["R", "S(0)"], ["R", "S(0)"]] and p.output_specs == [["S(0)", "S(1)"]]
    go = m.dtensor([4, 8, 10], ["S(0)", "S(1)"])
    p = plan(A.convolution_backward.default, go, x, w, [8], [1], [1], [1], False, [0], 8, [True, True, True])
    assert p.output_specs == [["S(0)", "S(1)"], ["P", "S(0)"], ["P", "S(0)"]]
    # 3 groups over 2 ranks, or a dense convolution: the channels are gathered
    x6 = m.dtensor([4, 6, 10], ["S(0)", "S(1)"])
    p = plan(A.convolution.default, x6, m.dtensor([6, 2, 3], ["R", "R"]), None, [1], [0], [1], False, [0], 3)
    assert p.input_specs[0] == ["S(0)", "R"]
    p = plan(A.convolution.default, x6, m.dtensor([5, 6, 3], ["R", "R"]), None, [1], [0], [1], False, [0], 1)
    assert p.input_specs[0] == ["S(0)", "R"]
