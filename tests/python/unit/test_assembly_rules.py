"""UT (no processes): what the assembly rules plan (csrc/ops/assembly.cpp) and the *_copy forms of
the slicing views (views.cpp): select_scatter keeps a sharded dim sharded (an expand writes on the
rank holding the GLOBAL index), slice/diagonal_scatter make the scattered dims whole, src follows
self's other dims; block_diag reads everything whole; _chunk_cat keeps the batch dims before dim;
every op is linear, so a sum Partial passes (a whole operand is filled); the *_copy views plan as
their views; errors raise on every rank alike before anything runs."""

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


def test_select_scatter_keeps_a_sharded_dim(m):
    p = plan(A.select_scatter.default, m.dtensor([5, 7, 3], S(0, 1)), m.dtensor([5, 3], R2), 1, 3)
    assert p.input_specs == [S(0, 1), S(0, None)] and p.output_specs == [S(0, 1)] and p.expands
    # along a whole dim: torch's kernel on the blocks, src sharded like self's other dims
    p = plan(A.select_scatter.default, m.dtensor([5, 7, 3], S(0, 1)), m.dtensor([5, 7], R2), 2, -1)
    assert p.input_specs == [S(0, 1), S(0, 1)] and p.output_specs == [S(0, 1)] and not p.expands


def test_select_scatter_partial(m):
    # a sum Partial self: a Replicate src is filled; on the axis sharding dim a Partial src is reduced
    p = plan(A.select_scatter.default, m.dtensor([5, 7, 3], ["P", "S(1)"]), m.dtensor([5, 3], R2), 1, 3)
    assert p.input_specs == [["P", "S(1)"], ["P", "R"]] and p.output_specs == [["P", "S(1)"]]
    p = plan(A.select_scatter.default, m.dtensor([5, 7, 3], ["R", "S(1)"]), m.dtensor([5, 3], ["R", "P"]), 1, 3)
    assert p.input_specs == [["R", "S(1)"], ["R", "R"]] and p.output_specs == [["R", "S(1)"]]


def test_slice_and_diagonal_scatter_make_their_dims_whole(m):
    p = plan(A.slice_scatter.default, m.dtensor([5, 7, 3], S(0, 1)), m.dtensor([5, 3, 3], S(0, 1)), 1, 2, 5)
    assert p.input_specs == [S(0, None), S(0, None)] and p.output_specs == [S(0, None)] and not p.expands
    p = plan(A.diagonal_scatter.default, m.dtensor([5, 7, 3], S(0, 2)), m.dtensor([3, 5], R2), 0, 0, 1)
    assert p.input_specs == [S(None, 2), ["R", "S(0)"]] and p.output_specs == [S(None, 2)]
    # a sum Partial src, a whole self: both Partial (self filled), the result too
    p = plan(A.diagonal_scatter.default, m.dtensor([5, 7], R2), m.dtensor([5], ["P", "R"]))
    assert p.input_specs == [["P", "R"], ["P", "R"]] and p.output_specs == [["P", "R"]]


def test_block_diag_and_chunk_cat(m):
    p = plan(A.block_diag.default, [m.dtensor([5, 7], S(0, 1)), m.dtensor([3, 2], R2)])
    assert p.input_specs == [R2, R2] and p.output_specs == [R2]
    assert list(p.outputs[0].global_shape) == [8, 9]
    p = plan(A._chunk_cat.default, [m.dtensor([5, 7, 3], S(0, 1)), m.dtensor([5, 4], S(1, 0))], 1, 3)
    assert p.input_specs == [S(0, None), S(0, None)] and p.output_specs == [S(0, None)]
    assert list(p.outputs[0].global_shape) == [5, 3, 11]  # chunks of 3 * 3 and 2 (4 padded to 6)


def test_scatter_argument_errors_raise_before_anything_runs(m):
    # src's GLOBAL shape and the GLOBAL index (torch's kernel would see only the blocks)
    with pytest.raises(hs.LayoutError) as raised:
        plan(A.select_scatter.default, m.dtensor([5, 7, 3], S(0, 1)), m.dtensor([5, 4], R2), 1, 3)
    assert str(raised.value).startswith("hypershard: aten::select_scatter: argument src (#1) [5, 4]")
    assert "has the shape [5, 4]; allowed: the shape [5, 3] of the view of self it replaces" in str(raised.value)
    with pytest.raises(hs.LayoutError, match=r"aten::select_scatter: index 7 is out of range for dim 1 of size 7"):
        plan(A.select_scatter.default, m.dtensor([5, 7, 3], S(0, 1)), m.dtensor([5, 3], R2), 1, 7)
    with pytest.raises(hs.LayoutError, match=r"argument src \(#1\).*the shape \[5, 2, 3\] of the view"):
        plan(A.slice_scatter.default, m.dtensor([5, 7, 3], S(0, 1)), m.dtensor([5, 3, 3], R2), 1, 2, 6, 2)
    with pytest.raises(hs.LayoutError, match=r"argument src \(#1\).*the shape \[3, 4\] of the view"):
        plan(A.diagonal_scatter.default, m.dtensor([5, 7, 3], S(0, 1)), m.dtensor([3, 5], R2), -1, 0, 1)


def test_view_copies_plan_as_their_views(m):
    p = plan(A.t_copy.default, m.dtensor([5, 7], S(0, 1)))
    assert p.output_specs == [S(1, 0)]
    p = plan(A.narrow_copy.default, m.dtensor([5, 7, 3], S(0, 1)), 1, 2, 4)
    assert p.input_specs == [S(0, None)] and p.output_specs == [S(0, None)]
    assert list(p.outputs[0].global_shape) == [5, 4, 3]
    p = plan(A.unbind_copy.int, m.dtensor([5, 7], S(0, 1)), 0)
    assert p.input_specs == [S(None, 1)] and p.output_specs == [["R", "S(0)"]] * 5
    p = plan(A.split_with_sizes_copy.default, m.dtensor([5, 7], S(0, 1)), [3, 4], 1)
    assert p.input_specs == [S(0, None)] and p.output_specs == [S(0, None)] * 2
    assert [list(o.global_shape) for o in p.outputs] == [[5, 3], [5, 4]]
    p = plan(A.slice_copy.Tensor, m.dtensor([5, 7], S(0, 1)), 1, 1, 6, 2)
    assert p.input_specs == [S(0, None)] and list(p.outputs[0].global_shape) == [5, 3] and not p.expands
    p = plan(A.unfold_copy.default, m.dtensor([5, 7], S(0, 1)), 1, 3, 2)
    assert p.input_specs == [S(0, None)] and p.output_specs == [S(0, None)]
    p = plan(A.as_strided_copy.default, m.dtensor([5, 7], ["P", "R"]), [4, 3], [2, 5], 1)
    assert p.output_specs == [["P", "R"]]


def test_as_strided_copy_of_a_sharded_tensor_is_refused(m):
    with pytest.raises(hs.LayoutError) as raised:
        plan(A.as_strided_copy.default, m.dtensor([5, 7], S(0, None)), [4, 3], [2, 5], 1)
    text = str(raised.value)
    assert text.startswith("hypershard: aten::as_strided_copy: argument self (#0)")
    assert "as_strided on a sharded tensor cannot be mapped to the local shards" in text


def test_unfold_backward_keeps_the_other_dims(m):
    # the gradient of unfold(1, 3, 2) of a [5, 7, 3] input: the unfolded dim and the window dim whole
    p = plan(A.unfold_backward.default, m.dtensor([5, 3, 3, 3], S(0, 1)), [5, 7, 3], 1, 3, 2)
    assert p.input_specs == [S(0, None)] and p.output_specs == [S(0, None)] and p.localizes
    p = plan(A.unfold_backward.default, m.dtensor([5, 3, 3, 3], ["P", "S(2)"]), [5, 7, 3], 1, 3, 2)
    assert p.input_specs == [["P", "S(2)"]] and p.output_specs == [["P", "S(2)"]]
