"""UT (no processes): what the rules of hardswish, log_sigmoid_forward, _prelu_kernel, polar,
complex (pointwise.cpp), glu, renorm, rot90, the channel/pixel shuffles, hash_tensor
(along_dims.cpp), trace, equal, allclose (reductions.cpp) and isin (lookups.cpp) plan: the
sharding each keeps, the dims made whole, the Partial algebra (complex linear, polar linear in abs
only, trace's Partial(sum) of the blocks' diagonal parts, the permutations passing a Partial) and
the house errors for a Partial they refuse."""

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh, plan
from hypershard.testing.planning import spec as S

A = torch.ops.aten
R2 = ["R", "R"]


@pytest.fixture
def m():
    return PlanningMesh({"dp": 2, "tp": 2})


def test_pointwise_like_ops_keep_the_sharding(m):
    p = plan(A.hardswish.default, m.dtensor([5, 7], S(0, 1)))
    assert p.input_specs == [S(0, 1)] and p.output_specs == [S(0, 1)] and not p.expands
    p = plan(A.log_sigmoid_forward.default, m.dtensor([5, 7], S(1, 0)))
    assert p.output_specs == [S(1, 0), S(1, 0)]  # output and buffer
    # prelu's weight, reshaped to broadcast along the channels, follows the channel dim's sharding
    p = plan(A._prelu_kernel.default, m.dtensor([5, 3, 7], S(0, 1)), m.dtensor([1, 3, 1], R2))
    assert p.input_specs == [S(0, 1), ["R", "S(1)"]] and p.output_specs == [S(0, 1)]
    p = plan(A._prelu_kernel_backward.default, m.dtensor([5, 3, 7], S(0, 1)), m.dtensor([5, 3, 7], S(0, 1)),
             m.dtensor([1, 3, 1], R2))
    assert p.output_specs == [S(0, 1), S(0, 1)]  # grad_weight comes in the broadcast shape (autograd sums it)


def test_pointwise_like_partial_algebra(m):
    # complex(re, im) is linear in both: a Replicate imaginary part is filled
    p = plan(A.complex.default, m.dtensor([5, 7], ["P", "S(1)"]), m.dtensor([5, 7], ["R", "S(1)"]))
    assert p.input_specs == [["P", "S(1)"], ["P", "S(1)"]] and p.output_specs == [["P", "S(1)"]]
    # polar(abs, angle) is linear in abs only
    p = plan(A.polar.default, m.dtensor([5, 7], ["P", "S(1)"]), m.dtensor([5, 7], ["R", "S(1)"]))
    assert p.output_specs == [["P", "S(1)"]]
    with pytest.raises(hs.LayoutError, match=r"aten::polar: argument angle \(#1\).*Partial\(sum\) input is not supported"):
        plan(A.polar.default, m.dtensor([5, 7], R2), m.dtensor([5, 7], ["P", "R"]))
    with pytest.raises(hs.LayoutError, match=r"aten::hardswish: argument self \(#0\).*Partial\(sum\) input is not supported"):
        plan(A.hardswish.default, m.dtensor([5, 7], ["P", "R"]))


def test_along_dims_ops(m):
    p = plan(A.glu.default, m.dtensor([5, 8], S(0, 1)), 1)
    assert p.input_specs == [S(0, None)] and p.output_specs == [S(0, None)]
    p = plan(A.glu_backward.default, m.dtensor([5, 4], S(0, 1)), m.dtensor([5, 8], S(0, 1)), 1)
    assert p.input_specs == [S(0, None), S(0, None)] and p.output_specs == [S(0, None)]
    # renorm: one norm per slice of dim, which keeps its sharding
    p = plan(A.renorm.default, m.dtensor([5, 7], S(0, 1)), 2, 0, 1.0)
    assert p.input_specs == [S(0, None)] and p.output_specs == [S(0, None)]
    p = plan(A.renorm.default, m.dtensor([5, 7], S(0, 1)), 2, 1, 1.0)
    assert p.input_specs == [S(None, 1)] and p.output_specs == [S(None, 1)]
    # rot90: its two dims whole, the others keep their sharding; a Partial passes (a permutation)
    p = plan(A.rot90.default, m.dtensor([5, 7, 3], S(0, 2)), 1, [0, 1])
    assert p.input_specs == [S(None, 2)] and p.output_specs == [S(None, 2)]
    assert list(p.outputs[0].global_shape) == [7, 5, 3]
    p = plan(A.rot90.default, m.dtensor([5, 7, 3], ["P", "S(2)"]), 1, [0, 1])
    assert p.output_specs == [["P", "S(2)"]]
    # the shuffles: batch dims keep their sharding
    p = plan(A.pixel_shuffle.default, m.dtensor([5, 8, 3, 2], S(0, 1)), 2)
    assert p.input_specs == [S(0, None)] and p.output_specs == [S(0, None)]
    p = plan(A.pixel_unshuffle.default, m.dtensor([3, 5, 2, 4, 6], S(1, 2)), 2)
    assert p.input_specs == [S(1, None)] and p.output_specs == [S(1, None)]
    p = plan(A.channel_shuffle.default, m.dtensor([5, 6, 3, 4], S(1, 2)), 2)
    assert p.input_specs == [S(None, 2)] and p.output_specs == [S(None, 2)]
    p = plan(A.hash_tensor.default, m.dtensor([5, 7], S(0, 1)), [1])
    assert p.input_specs == [S(0, None)] and p.output_specs == [S(0, None)]


def test_along_dims_errors(m):
    with pytest.raises(hs.LayoutError, match=r"aten::glu: argument self \(#0\).*Partial\(sum\) input is not supported"):
        plan(A.glu.default, m.dtensor([5, 8], ["P", "R"]), 1)
    with pytest.raises(hs.LayoutError, match=r"aten::pixel_shuffle: argument self \(#0\) .*has 2 dims; allowed: at least 3"):
        plan(A.pixel_shuffle.default, m.dtensor([8, 3], S(0, None)), 2)


def test_trace_is_a_partial_sum_of_the_global_diagonal():
    for rank in range(4):
        m = PlanningMesh({"dp": 2, "tp": 2}, rank=rank)
        p = plan(A.trace.default, m.dtensor([5, 7], S(0, 1)))
        assert p.input_specs == [S(0, 1)] and p.output_specs == [["P", "P"]] and p.expands
    m = PlanningMesh({"dp": 2, "tp": 2})
    p = plan(A.trace.default, m.dtensor([5, 7], ["P", "S(0)"]))  # linear: a sum Partial passes
    assert p.input_specs == [["P", "S(0)"]] and p.output_specs == [["P", "P"]]
    p = plan(A.trace.default, m.dtensor([5, 7], ["P(max)", "R"]))  # reduced first
    assert p.input_specs == [R2] and p.output_specs == [R2] and not p.expands
    with pytest.raises(hs.LayoutError, match=r"aten::trace: argument self \(#0\).*has 3 dims; allowed: a matrix"):
        plan(A.trace.default, m.dtensor([5, 7, 3], S(0, 1)))


def test_equal_and_allclose_compare_blocks_then_and_them(m):
    p = plan(A.equal.default, m.dtensor([5, 7], S(0, 1)), m.dtensor([5, 7], S(0, 1)))
    assert p.input_specs == [S(0, 1), S(0, 1)] and p.outputs == [] and p.expands
    # operands laid out differently are laid out alike first
    p = plan(A.equal.default, m.dtensor([5, 7], S(0, 1)), m.dtensor([5, 7], S(1, 0)))
    assert p.input_specs[0] == p.input_specs[1] and p.expands
    # different global shapes: False with no collective, nothing redistributed
    p = plan(A.equal.default, m.dtensor([5, 7], S(0, 1)), m.dtensor([5, 6], S(1, 0)))
    assert p.input_specs == [S(0, 1), S(1, 0)] and p.expands
    p = plan(A.allclose.default, m.dtensor([5, 7], S(0, 1)), m.dtensor([7], R2))
    assert p.input_specs == [S(0, 1), ["R", "S(0)"]] and p.expands
    p = plan(A.allclose.default, m.dtensor([5, 7], R2), m.dtensor([5, 7], R2))
    assert not p.expands  # nothing sharded: torch's call on the whole tensors
    with pytest.raises(hs.LayoutError, match=r"aten::equal: argument self \(#0\).*Partial\(sum\) input is not supported"):
        plan(A.equal.default, m.dtensor([5, 7], ["P", "R"]), m.dtensor([5, 7], R2))


def test_isin_keeps_the_elements_layout(m):
    p = plan(A.isin.Tensor_Tensor, m.dtensor([5, 7], S(0, 1), torch.int64), m.dtensor([6], S(0, None), torch.int64))
    assert p.input_specs == [S(0, 1), R2] and p.output_specs == [S(0, 1)]
    p = plan(A.isin.Tensor_Scalar, m.dtensor([5, 7], S(1, 0), torch.int64), 3)
    assert p.input_specs == [S(1, 0)] and p.output_specs == [S(1, 0)]
    p = plan(A.isin.Scalar_Tensor, 3, m.dtensor([9], S(0, None), torch.int64))
    assert p.input_specs == [R2] and p.output_specs == [R2]
    with pytest.raises(hs.LayoutError, match=r"aten::isin.Tensor_Tensor: argument elements \(#0\).*Partial\(sum\)"):
        plan(A.isin.Tensor_Tensor, m.dtensor([5, 7], ["P", "R"]), m.dtensor([6], R2))
