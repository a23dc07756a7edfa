"""UT (no processes): what the spatial rules plan (csrc/ops/spatial.cpp): 3-d and fractional pools
and max_unpool keep batch/channel sharding and make the spatial dims whole, their other tensors
(a backward's self, indices, random_samples) following; grid_sampler keeps the batch, the input's
channels and the grid's output positions, its backward's grad_input Partial over the position
axes and grad_grid over the channel axes; im2col/col2im keep the batch and an evenly split
channel dim; the Partial algebra; torch's argument errors raise before anything runs."""

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh, plan

A = torch.ops.aten


def test_pool3d_keeps_batch_and_channels():
    m = PlanningMesh({"dp": 2, "tp": 2})
    x = m.dtensor([4, 6, 5, 6, 7], ["S(0)", "S(1)"])
    p = plan(A.max_pool3d_with_indices.default, x, [2, 2, 2])
    assert p.input_specs == [["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "S(1)"]] * 2
    assert list(p.outputs[0].global_shape) == [4, 6, 2, 3, 3]
    p = plan(A.avg_pool3d.default, m.dtensor([4, 6, 5, 6, 7], ["S(0)", "S(4)"]), [2, 2, 2])
    assert p.input_specs == [["S(0)", "R"]] and p.output_specs == [["S(0)", "R"]]  # spatial gathered
    p = plan(A.adaptive_max_pool3d.default, m.dtensor([6, 5, 6, 7], ["S(0)", "R"]), [3, 2, 2])  # unbatched
    assert p.input_specs == [["S(0)", "R"]] and p.output_specs == [["S(0)", "R"]] * 2


def test_pool3d_backward_takes_self_and_indices_along():
    m = PlanningMesh({"dp": 2, "tp": 2})
    grad, self = m.dtensor([4, 6, 2, 3, 3], ["S(0)", "S(1)"]), m.dtensor([4, 6, 5, 6, 7], ["R", "S(3)"])
    indices = m.dtensor([4, 6, 2, 3, 3], ["R", "R"], dtype=torch.int64)
    p = plan(A.max_pool3d_with_indices_backward.default, grad, self, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1],
             False, indices)
    assert p.input_specs == [["S(0)", "S(1)"]] * 3 and p.output_specs == [["S(0)", "S(1)"]]
    p = plan(A.adaptive_max_pool3d_backward.default, grad, self, indices)
    assert p.input_specs == [["S(0)", "S(1)"]] * 3 and p.output_specs == [["S(0)", "S(1)"]]


def test_fractional_samples_follow_batch_and_channels():
    m = PlanningMesh({"dp": 2, "tp": 2})
    x, samples = m.dtensor([4, 6, 9, 8], ["S(0)", "S(1)"]), m.dtensor([4, 6, 2], ["R", "R"])
    p = plan(A.fractional_max_pool2d.default, x, [2, 2], [4, 3], samples)
    assert p.input_specs == [["S(0)", "S(1)"], ["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "S(1)"]] * 2
    # unbatched input [C, H, W]: samples [1, C, 2], their dim 1 follows the channels
    p = plan(A.fractional_max_pool2d.default, m.dtensor([6, 9, 8], ["S(0)", "R"]), [2, 2], [4, 3],
             m.dtensor([1, 6, 2], ["R", "R"]))
    assert p.input_specs == [["S(0)", "R"], ["S(1)", "R"]]


def test_max_unpool_keeps_leading_dims():
    m = PlanningMesh({"tp": 4})
    v, i = m.dtensor([2, 3, 3, 4], ["S(1)"]), m.dtensor([2, 3, 3, 4], ["R"], dtype=torch.int64)
    p = plan(A.max_unpool2d.default, v, i, [6, 8])
    assert p.input_specs == [["S(1)"], ["S(1)"]] and p.output_specs == [["S(1)"]]
    assert list(p.outputs[0].global_shape) == [2, 3, 6, 8]
    assert p.expands  # 3 channels over 4 ranks: the empty block is made without the kernel
    assert not plan(A.max_unpool2d.default, m.dtensor([2, 4, 3, 4], ["S(1)"]), m.dtensor([2, 4, 3, 4], ["R"], dtype=torch.int64),
                    [6, 8]).expands


def test_pool_partial_algebra():
    m = PlanningMesh({"dp": 2, "tp": 2})
    x = m.dtensor([4, 6, 5, 6, 7], [hs.Partial(), "S(1)"])
    p = plan(A.avg_pool3d.default, x, [2, 2, 2])  # linear: passes
    assert p.input_specs == [["P", "S(1)"]] and p.output_specs == [["P", "S(1)"]]
    p = plan(A.avg_pool3d.default, m.dtensor([4, 6, 5, 6, 7], [hs.Partial("max"), "S(1)"]), [2, 2, 2])
    assert p.input_specs == [["R", "S(1)"]]  # reduced first
    with pytest.raises(Exception, match=r"hypershard: aten::max_pool3d_with_indices: argument self \(#0\) .*"
                                        r"Partial\(sum\) input is not supported by this op; allowed: Replicate or Shard"):
        plan(A.max_pool3d_with_indices.default, x, [2, 2, 2])


def test_pool_argument_errors():
    m = PlanningMesh({"dp": 2})
    with pytest.raises(Exception, match="non-empty 4D or 5D"):  # torch's check, on every rank alike
        plan(A.avg_pool3d.default, m.dtensor([4, 6, 5], ["S(0)"]), [2, 2, 2])
    with pytest.raises(Exception, match="should be a 3d or 4d Tensor"):
        plan(A.max_unpool2d.default, m.dtensor([3, 4], ["S(0)"]), m.dtensor([3, 4], ["R"], dtype=torch.int64), [6, 8])
    # a backward takes self's shape (fractional_max_pool3d_backward has no meta kernel): its rank is checked here
    g = m.dtensor([4, 2, 2], ["S(0)"])
    with pytest.raises(Exception, match=r"hypershard: aten::fractional_max_pool3d_backward: needs a 4-d or 5-d input, "
                                        r"not 3-d"):
        plan(A.fractional_max_pool3d_backward.default, g, m.dtensor([4, 4, 4], ["R"]), [2, 2, 2], [2, 2, 2],
             m.dtensor([4, 2, 2], ["R"], dtype=torch.int64))


def test_grid_sampler_keeps_batch_channels_and_positions():
    m = PlanningMesh({"dp": 2, "tp": 2})
    x, g = m.dtensor([4, 6, 5, 7], ["S(1)", "R"]), m.dtensor([4, 3, 8, 2], ["R", "S(2)"])
    p = plan(A.grid_sampler_2d.default, x, g, 0, 0, False)
    assert p.input_specs == [["S(1)", "R"], ["R", "S(2)"]] and p.output_specs == [["S(1)", "S(3)"]]
    # the batch: the input's, the grid follows; a sharded input plane is gathered
    x, g = m.dtensor([4, 6, 5, 7], ["S(0)", "S(2)"]), m.dtensor([4, 3, 8, 2], ["R", "R"])
    p = plan(A.grid_sampler_2d.default, x, g, 0, 0, False)
    assert p.input_specs == [["S(0)", "R"], ["S(0)", "R"]] and p.output_specs == [["S(0)", "R"]]
    # the grid's batch when the input's is whole; 3-d
    x, g = m.dtensor([4, 6, 5, 7, 3], ["R", "S(1)"]), m.dtensor([4, 3, 8, 2, 3], ["S(0)", "R"])
    p = plan(A.grid_sampler_3d.default, x, g, 0, 0, False)
    assert p.input_specs == [["S(0)", "S(1)"], ["S(0)", "R"]] and p.output_specs == [["S(0)", "S(1)"]]


def test_grid_sampler_backward_partials():
    m = PlanningMesh({"dp": 2, "tp": 2})
    go, x, g = (m.dtensor([4, 6, 3, 8], ["S(1)", "S(3)"]), m.dtensor([4, 6, 5, 7], ["S(1)", "R"]),
                m.dtensor([4, 3, 8, 2], ["R", "S(2)"]))
    p = plan(A.grid_sampler_2d_backward.default, go, x, g, 0, 0, False, [True, True])
    assert p.input_specs == [["S(1)", "S(3)"], ["S(1)", "R"], ["R", "S(2)"]]
    # grad_input sums the positions (sharded on tp), grad_grid the channels (sharded on dp)
    assert p.output_specs == [["S(1)", "P"], ["P", "S(2)"]]
    p = plan(A.grid_sampler_2d_backward.default, go, x, g, 0, 0, False, [False, True])
    assert p.output_specs[1] == ["P", "S(2)"] and list(p.outputs[0].global_shape) == []


def test_grid_sampler_partial_algebra():
    m = PlanningMesh({"dp": 2, "tp": 2})
    x, g = m.dtensor([4, 6, 5, 7], [hs.Partial(), "S(1)"]), m.dtensor([4, 3, 8, 2], ["R", "R"])
    p = plan(A.grid_sampler_2d.default, x, g, 0, 0, False)  # linear in input
    assert p.input_specs[0] == ["P", "S(1)"] and p.output_specs == [["P", "S(1)"]]
    # the input's Partial axis shards the grid's positions: reduced first
    p = plan(A.grid_sampler_2d.default, x, m.dtensor([4, 3, 8, 2], ["S(1)", "R"]), 0, 0, False)
    assert p.input_specs == [["R", "S(1)"], ["S(1)", "R"]] and p.output_specs == [["S(2)", "S(1)"]]
    with pytest.raises(Exception, match=r"hypershard: aten::grid_sampler_2d: argument grid \(#1\) .*Partial\(sum\) "
                                        r"input is not supported by this op; allowed: Replicate or Shard"):
        plan(A.grid_sampler_2d.default, m.dtensor([4, 6, 5, 7], ["R", "R"]),
             m.dtensor([4, 3, 8, 2], [hs.Partial(), "R"]), 0, 0, False)


def test_grid_sampler_argument_errors():
    m = PlanningMesh({"dp": 2})
    with pytest.raises(Exception, match="grid"):  # torch's check: the grid's last dim must be 2
        plan(A.grid_sampler_2d.default, m.dtensor([4, 6, 5, 7], ["S(0)"]), m.dtensor([4, 3, 8, 3], ["S(0)"]),
             0, 0, False)


def test_im2col_col2im_channels():
    m = PlanningMesh({"dp": 2, "tp": 2})
    x = m.dtensor([4, 4, 6, 7], ["S(0)", "S(1)"])
    p = plan(A.im2col.default, x, [2, 3], [1, 1], [1, 1], [1, 2])
    assert p.input_specs == [["S(0)", "S(1)"]] and p.output_specs == [["S(0)", "S(1)"]]
    assert list(p.outputs[0].global_shape) == [4, 24, 28]
    p = plan(A.im2col.default, m.dtensor([4, 3, 6, 7], ["S(0)", "S(1)"]), [2, 3], [1, 1], [1, 1], [1, 2])
    assert p.input_specs == [["S(0)", "R"]]  # 3 channels over 2 ranks: the rows would not split at channels
    cols = m.dtensor([4, 24, 28], ["S(1)", "S(0)"])
    p = plan(A.col2im.default, cols, [6, 7], [2, 3], [1, 1], [1, 1], [1, 2])
    assert p.input_specs == [["S(1)", "S(0)"]] and p.output_specs == [["S(1)", "S(0)"]]
    p = plan(A.col2im.default, m.dtensor([4, 24, 28], ["S(2)", "R"]), [6, 7], [2, 3], [1, 1], [1, 1], [1, 2])
    assert p.input_specs == [["R", "R"]]
    # linear: a sum Partial passes
    p = plan(A.im2col.default, m.dtensor([4, 4, 6, 7], [hs.Partial(), "S(0)"]), [2, 3], [1, 1], [1, 1], [1, 2])
    assert p.output_specs == [["P", "S(0)"]]


def test_col2im_argument_errors():
    m = PlanningMesh({"dp": 2})
    with pytest.raises(Exception, match="divisible"):  # torch's check: 25 rows are not C * 2 * 3
        plan(A.col2im.default, m.dtensor([4, 25, 28], ["S(0)"]), [6, 7], [2, 3], [1, 1], [1, 1], [1, 2])
