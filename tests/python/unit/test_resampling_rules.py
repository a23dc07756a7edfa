"""UT (no processes): what the resampling rules plan (csrc/ops/resampling.cpp): reflect/replicate
pads keep every sharding, a padded dim sharded over one axis included (exchanged in their expand),
over two axes it is made whole; every Partial passes a pad's forward, sum/avg its backward;
upsampling and 3-d area make the spatial dims whole and keep batch/channel sharding, a sum Partial
passing and a max Partial reduced; a backward's input_size is localised; torch's argument errors
raise on every rank alike before anything runs."""

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh, plan

A = torch.ops.aten


@pytest.mark.parametrize("op", [A.reflection_pad1d.default, A.replication_pad1d.default])
def test_pad_keeps_batch_and_channel_sharding_locally(op):
    m = PlanningMesh({"dp": 2, "tp": 2})
    p = plan(op, m.dtensor([4, 6, 7], ["S(0)", "S(1)"]), [2, 1])
    assert p.input_specs == [["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "S(1)"]]
    assert not p.expands and not p.localizes  # the padded dim is whole: torch's kernel on the block


@pytest.mark.parametrize("op", [A.reflection_pad2d.default, A.replication_pad2d.default])
def test_a_sharded_padded_dim_stays_sharded(op):
    m = PlanningMesh({"dp": 2, "tp": 2})
    p = plan(op, m.dtensor([4, 3, 7, 6], ["S(2)", "S(3)"]), [2, 1, 1, 3])
    assert p.input_specs == [["S(2)", "S(3)"]] and p.output_specs == [["S(2)", "S(3)"]] and p.expands
    assert list(p.outputs[0].global_shape) == [4, 3, 11, 9]
    # over two axes: the padded dim is made whole instead
    p = plan(op, m.dtensor([4, 3, 7, 6], ["S(3)", "S(3)"]), [2, 1, 1, 3])
    assert p.input_specs == [["R", "R"]] and p.output_specs == [["R", "R"]] and not p.expands


def test_pad_backward_mirrors_the_forward():
    m = PlanningMesh({"dp": 4})
    grad, self = m.dtensor([2, 3, 10], ["S(2)"]), m.dtensor([2, 3, 7], ["S(2)"])
    p = plan(A.reflection_pad1d_backward.default, grad, self, [2, 1])
    assert p.input_specs == [["S(2)"], ["S(2)"]] and p.output_specs == [["S(2)"]] and p.expands
    p = plan(A.replication_pad1d_backward.default, m.dtensor([4, 3, 10], ["S(0)"]), m.dtensor([4, 3, 7], ["R"]), [2, 1])
    assert p.input_specs == [["S(0)"], ["S(0)"]] and p.output_specs == [["S(0)"]] and not p.expands


def test_pad_partial_algebra():
    m = PlanningMesh({"dp": 2, "tp": 2})
    # forward: copies, so every Partial passes (the padded dim sharded on the other axis)
    for partial in (hs.Partial(), hs.Partial("max")):
        x = m.dtensor([2, 3, 7], [partial, "S(2)"])
        p = plan(A.reflection_pad1d.default, x, [2, 1])
        assert p.output_specs[0][0].startswith("P") and p.input_specs[0][0] == p.output_specs[0][0]
    # backward: linear, so a sum Partial passes and a max Partial is reduced (inside a backward
    # pass; planned here outside one, the max Partial is dropped from the required layout)
    self = m.dtensor([2, 3, 7], ["R", "S(2)"])
    p = plan(A.reflection_pad1d_backward.default, m.dtensor([2, 3, 10], [hs.Partial(), "S(2)"]), self, [2, 1])
    assert p.input_specs[0] == ["P", "S(2)"] and p.output_specs == [["P", "S(2)"]]
    p = plan(A.reflection_pad1d_backward.default, m.dtensor([2, 3, 10], [hs.Partial("max"), "S(2)"]), self, [2, 1])
    assert p.input_specs[0] == ["R", "S(2)"] and p.output_specs == [["R", "S(2)"]]


def test_pad_argument_errors_raise_before_anything_runs():
    m = PlanningMesh({"dp": 2})
    with pytest.raises(Exception, match="Padding size should be less than the corresponding input dimension"):
        plan(A.reflection_pad1d.default, m.dtensor([2, 3, 4], ["S(2)"]), [4, 1])
    with pytest.raises(Exception, match=r"hypershard: aten::replication_pad1d: a 1-d pad needs a 2-d or 3-d input, not 4-d"):
        plan(A.replication_pad1d.default, m.dtensor([2, 3, 4, 5], ["S(2)"]), [1, 1])


@pytest.mark.parametrize("op,shape,size", [
    (A.upsample_nearest1d.default, [4, 6, 5], [10]),
    (A._upsample_nearest_exact2d.default, [4, 6, 5, 6], [10, 3]),
    (A.upsample_nearest3d.default, [4, 6, 5, 6, 4], [10, 3, 8]),
])
def test_upsampling_makes_spatial_dims_whole(op, shape, size):
    m = PlanningMesh({"dp": 2, "tp": 2})
    n = len(shape)
    p = plan(op, m.dtensor(shape, ["S(0)", f"S({n - 1})"]), size)
    assert p.input_specs == [["S(0)", "R"]] and p.output_specs == [["S(0)", "R"]] and not p.expands
    assert list(p.outputs[0].global_shape) == shape[:2] + size
    p = plan(op, m.dtensor(shape, ["S(0)", "S(1)"]), size)  # batch and channels: local
    assert p.input_specs == [["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "S(1)"]]


def test_interpolation_partial_algebra():
    m = PlanningMesh({"dp": 2, "tp": 2})
    op = A.upsample_bilinear2d.default
    p = plan(op, m.dtensor([4, 6, 5, 6], [hs.Partial(), "S(1)"]), [9, 7], False)
    assert p.input_specs == [["P", "S(1)"]] and p.output_specs == [["P", "S(1)"]]  # linear
    p = plan(op, m.dtensor([4, 6, 5, 6], [hs.Partial("max"), "S(1)"]), [9, 7], False)
    assert p.input_specs == [["R", "S(1)"]] and p.output_specs == [["R", "S(1)"]]  # reduced first


def test_upsampling_backward_localises_input_size():
    m = PlanningMesh({"dp": 2})
    grad = m.dtensor([4, 6, 10, 12], ["S(0)"])
    p = plan(A.upsample_bicubic2d_backward.default, grad, [10, 12], [4, 6, 5, 6], False)
    assert p.input_specs == [["S(0)"]] and p.output_specs == [["S(0)"]] and p.localizes
    assert list(p.outputs[0].global_shape) == [4, 6, 5, 6]
    p = plan(A.upsample_bicubic2d_backward.default, m.dtensor([4, 6, 10, 12], ["S(2)"]), [10, 12], [4, 6, 5, 6], False)
    assert p.input_specs == [["R"]] and p.output_specs == [["R"]]  # (input_size stands: nothing split)


def test_area_3d_backward_takes_self_along():
    m = PlanningMesh({"dp": 2, "tp": 2})
    grad, self = m.dtensor([4, 6, 3, 2, 2], ["S(0)", "S(1)"]), m.dtensor([4, 6, 7, 6, 5], ["R", "S(4)"])
    p = plan(A._adaptive_avg_pool3d_backward.default, grad, self)
    assert p.input_specs == [["S(0)", "S(1)"], ["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "S(1)"]]


def test_an_empty_channel_block_skips_the_kernel():
    # 3 channels over 4 ranks: rank 3's block is empty, which torch's kernels refuse; the plan
    # makes that block itself (an expand with no collectives); 4 over 4 is the plain call
    m = PlanningMesh({"tp": 4})
    assert plan(A.upsample_nearest2d.default, m.dtensor([2, 3, 5, 5], ["S(1)"]), [10, 10]).expands
    assert not plan(A.upsample_nearest2d.default, m.dtensor([2, 4, 5, 5], ["S(1)"]), [10, 10]).expands
    assert plan(A.replication_pad1d.default, m.dtensor([2, 3, 5], ["S(1)"]), [1, 1]).expands


def test_upsampling_argument_errors():
    m = PlanningMesh({"dp": 2})
    with pytest.raises(Exception, match="output_size"):  # torch's check, on every rank alike
        plan(A.upsample_nearest2d.default, m.dtensor([4, 3, 5, 5], ["S(0)"]), [9])
