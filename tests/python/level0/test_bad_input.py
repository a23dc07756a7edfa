"""Level0: the bad-input catalogue. Every case runs on a real multi-process gloo mesh and must
raise on EVERY rank with the same clear message, before any collective of the failing call, and
leave the process group working (the harness runs an all_reduce health check after each error
and fails the case if the group had to be recreated).

`refused(fn)` wraps each case: it counts hypershard's collectives around the call (none may run
before the error) and compares the error text across the ranks (all must be identical).
Categories: meshes, layouts and placements, the DTensor API, Partial into non-linear ops,
dims a rule forbids sharded, shape and dtype mismatches, uneven sizes, out-of-range dims and
indices, rank-divergent plain tensors (debug checks), unsupported operators.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, current_mesh, randint, run_cases

MESH2 = ((2,), ("a",))
MESH22 = ((2, 2), ("a", "b"))
X46 = Input((4, 6), placements=["S(0)"])
P46 = Input((4, 6), placements=["P"])
R46 = Input((4, 6), placements=["R"])


def refused(fn):
    """Runs fn; when it raises, checks that no collective ran and every rank has the same text."""
    @functools.wraps(fn)
    def wrapped(*args):
        before = hs._C.traffic()["collectives"]
        try:
            return fn(*args)
        except Exception as exc:
            ran = hs._C.traffic()["collectives"] - before
            text = f"{type(exc).__name__}: {exc}"
            texts = [None] * dist.get_world_size()
            dist.all_gather_object(texts, text)
            if len(set(texts)) != 1:
                raise AssertionError(f"the ranks raised {len(set(texts))} different errors") from exc
            if ran and not getattr(wrapped, "collectives_allowed", False):
                # The original text is left out, so that the case's expect_error cannot match.
                raise AssertionError(f"{ran} collective(s) ran before the {type(exc).__name__}") from exc
            raise
    return wrapped


# ----------------------------------------------------------------------------- the cases

def _ops():
    m = current_mesh
    return {
        # meshes
        "mesh_rank_count": lambda x: hs.init_device_mesh("cpu", (3,), ("a",)),
        "mesh_rank_count_2d": lambda x: hs.init_device_mesh("cpu", (2, 2), ("a", "b")),
        "mesh_duplicate_names": lambda x: hs.init_device_mesh("cpu", (1, 2), ("a", "a")),
        "mesh_empty_name": lambda x: hs.init_device_mesh("cpu", (2,), ("",)),
        "mesh_none_name": lambda x: hs.init_device_mesh("cpu", (2,), ("None",)),
        "mesh_names_count": lambda x: hs.init_device_mesh("cpu", (2,), ("a", "b")),
        # layouts and placements
        "shard_missing_dim": lambda x: hs.distribute_tensor(torch.ones(4, 6), m(), [hs.Shard(2)]),
        "placements_count": lambda x: hs.distribute_tensor(torch.ones(4, 6), m(), [hs.Shard(0), hs.Shard(1)]),
        "alias_axis_twice": lambda x: hs.distribute_tensor(torch.ones(4, 6), m(), ("a", "a")),
        "alias_unknown_axis": lambda x: hs.distribute_tensor(torch.ones(4, 6), m(), ("tp", "None")),
        "alias_dims_count": lambda x: hs.distribute_tensor(torch.ones(4, 6), m(), ("a",)),
        "partial_unknown_op": lambda x: hs.distribute_tensor(torch.ones(4, 6), m(), [hs.Partial("mean")]),
        "redistribute_missing_dim": lambda x: x.redistribute(m(), [hs.Shard(3)]),
        "redistribute_placements_count": lambda x: x.redistribute(m(), [hs.Replicate(), hs.Replicate()]),
        "from_local_of_dtensor": lambda x: hs.DTensor.from_local(x, m(), [hs.Replicate()]),
        "from_local_shard_missing_dim": lambda x: hs.DTensor.from_local(x.to_local(), m(), [hs.Shard(4)]),
        "to_local_of_plain": lambda x: torch.ones(2).to_local(),
        # Partial into non-linear ops
        "relu_of_partial": torch.relu,
        "exp_of_partial": torch.exp,
        "compare_partial": lambda x: x > 0,
        "divide_by_partial": lambda x: torch.ones(4, 6) / x,
        "integer_cast_of_partial": lambda x: x.long(),
        "softmax_of_partial": lambda x: x.softmax(-1),
        "amax_of_sum_partial": lambda x: x.amax(0),
        "abs_of_partial": torch.abs,
        # dims a rule forbids sharded (a sharded attention sequence is context parallelism now:
        # test_context_parallel.py)
        "attention_head_dim_sharded": lambda q: F.scaled_dot_product_attention(q, q, q),
        "view_cuts_shards": lambda x: x.view(16, 6),
        "view_flattens_inner_sharded_dim": lambda x: x.view(8, 8),
        # uneven sizes where the op needs whole blocks
        "view_of_uneven_shards": lambda x: x.view(20),
        # shape and dtype mismatches (torch's own message, identical on every rank)
        "add_shape_mismatch": lambda x: x + hs.distribute_tensor(torch.ones(5, 6), m(), [hs.Shard(0)]),
        "mm_shape_mismatch": lambda x: x @ hs.distribute_tensor(torch.ones(5, 8), m(), [hs.Replicate()]),
        "mm_dtype_mismatch": lambda x: x @ hs.distribute_tensor(torch.ones(6, 8, dtype=torch.float64), m(),
                                                                [hs.Replicate()]),
        "view_wrong_numel": lambda x: x.view(7, 7),
        "cat_shape_mismatch": lambda x: torch.cat([x, hs.distribute_tensor(torch.ones(4, 5), m(), [hs.Shard(0)])], 0),
        "inplace_broadcast_self": lambda x: hs.distribute_tensor(torch.ones(1, 6), m(), [hs.Replicate()]).add_(x),
        "cross_entropy_batch_mismatch": lambda x: F.cross_entropy(
            x, hs.distribute_tensor(torch.zeros(5, dtype=torch.long), m(), [hs.Replicate()])),
        "nll_float_target": lambda x: F.nll_loss(x, hs.distribute_tensor(torch.zeros(4), m(), [hs.Replicate()])),
        "layer_norm_shape": lambda x: F.layer_norm(x, (5,)),
        # out-of-range dims and indices
        "sum_dim_out_of_range": lambda x: x.sum(5),
        "transpose_dim_out_of_range": lambda x: x.transpose(0, 2),
        "select_index_out_of_range": lambda x: x.select(1, 10),
        "permute_wrong_count": lambda x: x.permute(1, 0, 2),
        "permute_repeated_dim": lambda x: x.permute(1, 1),
        "unsqueeze_dim_out_of_range": lambda x: x.unsqueeze(4),
        "softmax_dim_out_of_range": lambda x: x.softmax(2),
        "cat_dim_out_of_range": lambda x: torch.cat([x, x], 3),
        "narrow_out_of_range": lambda x: x.narrow(1, 4, 5),
        "embedding_index_out_of_range": lambda w: F.embedding(
            hs.distribute_tensor(torch.tensor([[1, 20]]), current_mesh(), [hs.Replicate()]), w),
        "one_hot_class_out_of_range": lambda i: F.one_hot(i, 3),
        # a read by ownership (self sharded along the indexed dim) checks the GLOBAL range: a
        # clamped index would otherwise read a silent zero
        "index_select_owned_out_of_range": lambda x: torch.index_select(x, 0, torch.tensor([1, 4])),
        "gather_owned_out_of_range": lambda x: torch.gather(x, 0, torch.tensor([[0, -1]])),
        # unsupported operators
        "missing_operator": lambda x: torch.geqrf(x),
        "different_meshes": lambda x: x + hs.distribute_tensor(
            torch.ones(4, 6), hs.DeviceMesh.from_torch(
                torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("other",))),
            [hs.Replicate()]),
    }


def _divergent_plain_operand(x):
    hs.set_debug_checks(True)
    try:
        noise = torch.full((4, 6), float(dist.get_rank()))  # differs across ranks
        return x + noise
    finally:
        hs.set_debug_checks(False)


def _divergent_distribute(x):
    hs.set_debug_checks(True)
    try:
        return hs.distribute_tensor(torch.full((4, 6), float(dist.get_rank())), current_mesh(), [hs.Shard(0)])
    finally:
        hs.set_debug_checks(False)


EXPECTED = {
    "mesh_rank_count": ("", "holds 3 ranks but the world has 2"),
    "mesh_rank_count_2d": ("", "holds 4 ranks but the world has 2"),
    "mesh_duplicate_names": ("", "axis name 'a' is used twice"),
    "mesh_empty_name": ("", "an axis name is empty"),
    "mesh_none_name": ("", "'None' is reserved"),
    "mesh_names_count": ("", "shape has 1 axes but 2 axis names were given"),
    "shard_missing_dim": ("", "Shard on mesh axis 'a' names dim 2 of a 2-d tensor; allowed: -2..1"),
    "placements_count": ("", "2 placements given for mesh (a=2) with 1 axes"),
    "alias_axis_twice": ("", "mesh axis 'a' shards dims 0 and 1; allowed: an axis shards at most one dim"),
    "alias_unknown_axis": ("", "no axis named 'tp' in mesh (a=2); allowed: 'a'"),
    "alias_dims_count": ("", "(\"a\",) names 1 dims but the tensor [4, 6] has 2"),
    "partial_unknown_op": ("", "unknown Partial reduce op 'mean'; allowed: sum, avg, max, min, prod"),
    "redistribute_missing_dim": ("", "names dim 3 of a 2-d tensor"),
    "redistribute_placements_count": ("", "2 placements given for mesh (a=2) with 1 axes"),
    "from_local_of_dtensor": ("", "already a DTensor"),
    "from_local_shard_missing_dim": ("", "names dim 4 of a 2-d tensor"),
    "to_local_of_plain": ("", "(it is not a hypershard DTensor)"),
    "relu_of_partial": ("P", "aten::relu: argument self (#0) [4, 6] (\"None\", \"None\") partial(sum: a): "
                             "Partial(sum) input is not supported by this op"),
    "exp_of_partial": ("P", "aten::exp: argument self (#0)"),
    "compare_partial": ("P", "aten::gt.Scalar: argument self (#0)"),
    "divide_by_partial": ("P", "aten::div.Tensor: argument other (#1)"),
    "integer_cast_of_partial": ("P", "aten::_to_copy: argument self (#0)"),
    "softmax_of_partial": ("P", "a softmax of a sum is not the sum of the parts' softmaxes"),
    "amax_of_sum_partial": ("P", "Partial(sum) input is not supported by this reduction"),
    "abs_of_partial": ("P", "aten::abs: argument self (#0)"),
    "attention_head_dim_sharded": ("Q3", "dim 3 (head_dim) is sharded"),
    "view_cuts_shards": ("V1", "viewing as [16, 6] would cut through a sharded dim"),
    "view_flattens_inner_sharded_dim": ("V3", "viewing as [8, 8] would cut through a sharded dim"),
    "view_of_uneven_shards": ("U", "viewing as [20] would cut through a sharded dim"),
    "add_shape_mismatch": ("", "hypershard: aten::add.Tensor: shapes cannot be broadcast together (inputs: "
                               "self [4, 6] (\"a\", \"None\"), other [5, 6] (\"a\", \"None\"))"),
    "mm_shape_mismatch": ("", "aten::mm: argument mat2 (#1) [5, 8] (\"None\", \"None\"): size 5 of dim 'k' "
                              "differs from 6 in another operand"),
    # torch's text: "m1 and m2" on CPU, "mat1 and mat2" on CUDA
    "mm_dtype_mismatch": ("", "to have the same dtype, but got: float != double"),
    "view_wrong_numel": ("", "shape '[7, 7]' is invalid for input of size 24"),
    "cat_shape_mismatch": ("", "aten::cat: argument tensors[1] (#0) [4, 5] (\"a\", \"None\"): size 5 at dim 1 "
                               "differs from 6 in another operand; allowed: equal sizes except along dim 0"),
    "inplace_broadcast_self": ("", "an in-place op cannot broadcast self to [4, 6]"),
    "cross_entropy_batch_mismatch": ("", "Expected input batch_size (4) to match target batch_size (5)"),
    "nll_float_target": ("", "expected target dtype to be Long or Byte, but got Float"),
    "layer_norm_shape": ("", "shape [4, 6] does not end with normalized_shape [5]"),
    "sum_dim_out_of_range": ("", "aten::sum.dim_IntList: dim 5 is out of range for a 2-d tensor"),
    "transpose_dim_out_of_range": ("", "aten::transpose.int: dim 2 is out of range for a 2-d tensor"),
    "select_index_out_of_range": ("", "select(): index 10 out of range for tensor of size [4, 6] at dimension 1"),
    "permute_wrong_count": ("", "aten::permute: dims has 3 entries for a 2-d tensor"),
    "permute_repeated_dim": ("", "aten::permute: dim 1 appears twice in dims"),
    "unsqueeze_dim_out_of_range": ("", "aten::unsqueeze: dim 4 is out of range for a 3-d tensor"),
    "softmax_dim_out_of_range": ("", "dim 2 is out of range for a 2-d tensor"),
    "cat_dim_out_of_range": ("", "aten::cat: dim 3 is out of range for a 2-d tensor"),
    "narrow_out_of_range": ("", "start (4) + length (5) exceeds dimension size (6)"),
    "embedding_index_out_of_range": ("W", "IndexError: index out of range in self"),
    "one_hot_class_out_of_range": ("I", "Class values must be smaller than num_classes"),
    "index_select_owned_out_of_range": ("", "aten::index_select: index 4 is out of bounds for dimension 0 with size 4"),
    "gather_owned_out_of_range": ("", "aten::gather: index -1 is out of bounds for dimension 0 with size 4"),
    "missing_operator": ("", "Missing operator aten::geqrf"),
    "different_meshes": ("", "operands live on different meshes"),
}

INPUTS = {
    "": X46,
    "P": P46,
    "Q3": Input((2, 2, 4, 8), placements=["S(3)"]),
    "V1": Input((12, 8), placements=["S(1)"]),
    "V3": Input((2, 4, 8), placements=["S(1)"]),
    "U": Input((5, 4), placements=["S(0)"]),
    "W": Input((16, 8), placements=["S(0)"]),
    "I": Input((6,), torch.int64, placements=["S(0)"], init=randint(0, 6)),
}


def bad_input_cases():
    cases = []
    for name, (key, message) in EXPECTED.items():
        def fn(*args, _name=name):
            return _ops()[_name](*args)
        cases.append(Case(name, fn, [INPUTS[key]], MESH2, dist_fn=refused(fn), expect_error=message))
    divergent = refused(_divergent_plain_operand)
    divergent.collectives_allowed = True  # the debug check itself all-reduces a fingerprint
    cases.append(Case("plain_operand_differs_across_ranks", _divergent_plain_operand, [X46], MESH2,
                      dist_fn=divergent, expect_error="differs across the ranks of mesh"))
    spread = refused(_divergent_distribute)
    spread.collectives_allowed = True
    cases.append(Case("distribute_tensor_input_differs", _divergent_distribute, [X46], MESH2, dist_fn=spread,
                      expect_error="distribute_tensor: argument tensor: a plain tensor of shape [4, 6] differs"))
    cases.append(Case("relu_of_partial_2d", torch.relu, [Input((4, 6), placements=["S(0)", "P"])], MESH22,
                      dist_fn=refused(torch.relu), expect_error="Partial(sum) input is not supported by this op"))
    cases.append(Case("view_cuts_shards_2d", lambda x: x.view(16, 6), [Input((12, 8), placements=["S(0)", "S(1)"])],
                      MESH22, dist_fn=refused(lambda x: x.view(16, 6)), expect_error="would cut through a sharded dim"))
    return cases


def test_bad_input_catalogue():
    cases = bad_input_cases()
    assert len(cases) >= 40
    assert_all_passed(run_cases(cases, backend="hypershard", timeout=600))
