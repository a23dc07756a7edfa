"""UT: the distributed rule of the fused RMSNorm (rms_norm_rule / rms_norm_backward_rule in
csrc/ops/normalization.cpp), without processes.

One rule pair serves hypershard::rms_norm, hypershard::rms_norm_backward and torch_npu's
npu_rms_norm(_backward): the normalized dims are x's last weight.dim() dims; x's leading dims keep
their sharding, the normalized dims are whole (an input sharded there is planned gathered), the
weight is whole (Replicate), y is laid out like the planned x and rstd like it with the normalized
dims of size 1; a sum/avg Partial forward input is an error (max/min are reduced first). The
backward lays dx out like x and makes dweight Partial(sum) on every mesh axis that shards x's
leading dims; a sum Partial grad on an axis where x is whole is carried into dx and dweight (the
backward is linear in grad). Each row runs the rule on meta DTensors of a mesh without process
groups (hypershard.testing.planning) on the meshes {"dp": 2}, {"tp": 4}, {"dp": 2, "tp": 2} and
{"dp": 2, "tp": 2, "sp": 2}, x (B, S, H). Errors: a sum/avg Partial x or weight, a weight that is
not x's trailing shape, a grad or rstd not shaped after x.

Then the non-fused form: HF's RMSNorm written out (hypershard.ops.rms_norm_composed) runs aten ops
(_to_copy, pow, mean.dim, add, rsqrt, mul; in the backward also sum.dim_IntList, view, expand,
div, ...). `trace` lists them by running the composed form, forward and backward, on plain
tensors under a TorchDispatchMode; `replay` plans each listed op with the layouts the previous
plans gave its operands. Where x's leading dims are sharded or x is whole, the chain ends in the
fused op's layouts: y and dx like x, dweight Partial(sum) on the axes sharding the leading dims.
Where x is sharded on the normalized dim H the two forms differ by design (see
`test_hidden_sharded_composed_form_differs`).
"""

from __future__ import annotations

import hypershard.ops as hops
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import hypershard as hs
from hypershard.testing.fused import define_npu_standins
from hypershard.testing.planning import Arg as T
from hypershard.testing.planning import PlanningMesh, check_error_pieces, check_row_plan, plan, plan_row, short_spec
from hypershard.testing.planning import spec as S

FWD = torch.ops.hypershard.rms_norm.default
BWD = torch.ops.hypershard.rms_norm_backward.default
OP_NAME = "hypershard::rms_norm"
BWD_NAME = "hypershard::rms_norm_backward"
EPS = 1e-6
BOTH = [True, True]

MESHES = {
    "dp2": {"dp": 2},
    "tp4": {"tp": 4},
    "dp2tp2": {"dp": 2, "tp": 2},
    "dp2tp2sp2": {"dp": 2, "tp": 2, "sp": 2},
}

BSH = [4, 6, 8]            # (B, S, H)
BSH_B8 = [8, 6, 8]         # B = 8: two mesh axes on B
UNEVEN = [3, 5, 8]         # B = 3 over 2 (2, 1), S = 5 over 2 (3, 2)
UNEVEN_S7 = [3, 7, 8]      # S = 7 over 4 (2, 2, 2, 1)
BSND = [4, 6, 4, 8]        # (B, S, N, D) with a (N, D) weight


def R(mesh_key):
    return ["R"] * len(MESHES[mesh_key])


def whole(x: T, k: int) -> list:
    """x's placements with the shards of its last k (normalized) dims made Replicate."""
    ndim = len(x.shape)
    return ["R" if p.startswith("S(") and int(p[2:-1]) % ndim >= ndim - k else p for p in x.spec]


def stats_shape(shape, k):
    return list(shape[:len(shape) - k]) + [1] * k


def w(shape, mesh_key, spec=None):
    return T(shape, spec if spec is not None else R(mesh_key))


def fwd(x, weight, eps=EPS):
    return (x, weight, eps)


def bwd(x, weight, grad=None, rstd=None, mask=BOTH):
    """Backward arguments (grad, x, weight, rstd, output_mask): grad defaults to x's layout, rstd to
    the fused forward's (x's leading dims, the normalized dims whole)."""
    k = len(weight.shape)
    grad = grad if grad is not None else T(x.shape, x.spec)
    rstd = rstd if rstd is not None else T(stats_shape(x.shape, k), whole(x, k))
    return (grad, x, weight, rstd, mask)


# (id, mesh, args, expected input specs (None: as given), expected output specs [y, rstd])
FORWARD_ROWS = [
    # {"dp": 2}
    ("dp2_batch", "dp2", fwd(T(BSH, S(0)), w([8], "dp2")), None, [S(0), S(0)]),
    ("dp2_seq", "dp2", fwd(T(BSH, S(1)), w([8], "dp2")), None, [S(1), S(1)]),
    ("dp2_replicate", "dp2", fwd(T(BSH, S(None)), w([8], "dp2")), None, [S(None), S(None)]),
    ("dp2_hidden_gathered", "dp2", fwd(T(BSH, S(2)), w([8], "dp2")), [S(None), S(None)], [S(None), S(None)]),
    ("dp2_uneven_batch", "dp2", fwd(T(UNEVEN, S(0)), w([8], "dp2")), None, [S(0), S(0)]),
    ("dp2_uneven_seq", "dp2", fwd(T(UNEVEN, S(1)), w([8], "dp2")), None, [S(1), S(1)]),
    # {"tp": 4}
    ("tp4_seq", "tp4", fwd(T(BSH, S(1)), w([8], "tp4")), None, [S(1), S(1)]),
    ("tp4_batch", "tp4", fwd(T(BSH, S(0)), w([8], "tp4")), None, [S(0), S(0)]),
    ("tp4_replicate", "tp4", fwd(T(BSH, S(None)), w([8], "tp4")), None, [S(None), S(None)]),
    ("tp4_hidden_gathered", "tp4", fwd(T(BSH, S(2)), w([8], "tp4")), [S(None), S(None)], [S(None), S(None)]),
    ("tp4_uneven_seq", "tp4", fwd(T(UNEVEN_S7, S(1)), w([8], "tp4")), None, [S(1), S(1)]),
    # a weight given sharded is gathered (the weight is whole)
    ("tp4_weight_sharded_gathered", "tp4", fwd(T(BSH, S(0)), w([8], "tp4", S(0))), [S(0), S(None)], [S(0), S(0)]),
    # {"dp": 2, "tp": 2}
    ("dp2tp2_batch_seq", "dp2tp2", fwd(T(BSH, S(0, 1)), w([8], "dp2tp2")), None, [S(0, 1), S(0, 1)]),
    ("dp2tp2_seq_batch", "dp2tp2", fwd(T(BSH, S(1, 0)), w([8], "dp2tp2")), None, [S(1, 0), S(1, 0)]),
    ("dp2tp2_batch_only", "dp2tp2", fwd(T(BSH, S(0, None)), w([8], "dp2tp2")), None, [S(0, None), S(0, None)]),
    ("dp2tp2_seq_only", "dp2tp2", fwd(T(BSH, S(None, 1)), w([8], "dp2tp2")), None, [S(None, 1), S(None, 1)]),
    ("dp2tp2_replicate", "dp2tp2", fwd(T(BSH, S(None, None)), w([8], "dp2tp2")), None,
     [S(None, None), S(None, None)]),
    ("dp2tp2_two_axes_on_batch", "dp2tp2", fwd(T(BSH_B8, S(0, 0)), w([8], "dp2tp2")), None, [S(0, 0), S(0, 0)]),
    ("dp2tp2_uneven", "dp2tp2", fwd(T(UNEVEN, S(0, 1)), w([8], "dp2tp2")), None, [S(0, 1), S(0, 1)]),
    # H sharded on tp: the rule asks for x whole on H (gathered), the batch shard stays
    ("dp2tp2_batch_hidden_gathered", "dp2tp2", fwd(T(BSH, S(0, 2)), w([8], "dp2tp2")),
     [S(0, None), S(None, None)], [S(0, None), S(0, None)]),
    ("dp2tp2_hidden_on_both_gathered", "dp2tp2", fwd(T(BSH, S(2, 2)), w([8], "dp2tp2")),
     [S(None, None), S(None, None)], [S(None, None), S(None, None)]),
    # a max Partial x is reduced first (only sum/avg are errors)
    ("dp2tp2_partial_max_reduced", "dp2tp2", fwd(T(BSH, S(0, "P(max)")), w([8], "dp2tp2")),
     [S(0, None), S(None, None)], [S(0, None), S(0, None)]),
    # {"dp": 2, "tp": 2, "sp": 2}
    ("3d_batch_seq", "dp2tp2sp2", fwd(T(BSH, S(0, None, 1)), w([8], "dp2tp2sp2")), None,
     [S(0, None, 1), S(0, None, 1)]),
    ("3d_seq_on_tp_and_sp", "dp2tp2sp2", fwd(T(BSH, S(0, 1, 1)), w([8], "dp2tp2sp2")), None,
     [S(0, 1, 1), S(0, 1, 1)]),
    ("3d_hidden_on_tp_gathered", "dp2tp2sp2", fwd(T(BSH, S(0, 2, 1)), w([8], "dp2tp2sp2")),
     [S(0, None, 1), S(None, None, None)], [S(0, None, 1), S(0, None, 1)]),
    ("3d_replicate", "dp2tp2sp2", fwd(T(BSH, S(None, None, None)), w([8], "dp2tp2sp2")), None,
     [S(None, None, None)] * 2),
    ("3d_uneven", "dp2tp2sp2", fwd(T(UNEVEN, S(0, None, 1)), w([8], "dp2tp2sp2")), None,
     [S(0, None, 1), S(0, None, 1)]),
    # 2-D weight (S, H): the normalized dims are S and H; rstd is (B, 1, 1)
    ("dp2_weight2d_batch", "dp2", fwd(T(BSH, S(0)), w([6, 8], "dp2")), None, [S(0), S(0)]),
    ("tp4_weight2d_seq_gathered", "tp4", fwd(T(BSH, S(1)), w([6, 8], "tp4")), [S(None), S(None)],
     [S(None), S(None)]),
    ("dp2tp2_weight2d_seq_gathered", "dp2tp2", fwd(T(BSH, S(0, 1)), w([6, 8], "dp2tp2")),
     [S(0, None), S(None, None)], [S(0, None), S(0, None)]),
    # (B, S, N, D) with a (N, D) weight: B and S keep their shards, N is gathered
    ("3d_bsnd_weight2d", "dp2tp2sp2", fwd(T(BSND, S(0, 2, 1)), w([4, 8], "dp2tp2sp2")),
     [S(0, None, 1), S(None, None, None)], [S(0, None, 1), S(0, None, 1)]),
    # x of rank 1: every dim normalized
    ("dp2_rank1_gathered", "dp2", fwd(T([8], S(0)), w([8], "dp2")), [S(None), S(None)], [S(None), S(None)]),
]

# The backward: outputs are (dx, dweight).
BACKWARD_ROWS = [
    # each rank sums its own rows of x into dweight: Partial(sum) on the axes sharding B or S
    ("dp2_batch", "dp2", bwd(T(BSH, S(0)), w([8], "dp2")), None, [S(0), S("P")]),
    ("dp2_seq", "dp2", bwd(T(BSH, S(1)), w([8], "dp2")), None, [S(1), S("P")]),
    ("dp2_replicate", "dp2", bwd(T(BSH, S(None)), w([8], "dp2")), None, [S(None), S(None)]),
    ("tp4_seq", "tp4", bwd(T(BSH, S(1)), w([8], "tp4")), None, [S(1), S("P")]),
    ("tp4_uneven_seq", "tp4", bwd(T(UNEVEN_S7, S(1)), w([8], "tp4")), None, [S(1), S("P")]),
    ("dp2tp2_batch_seq", "dp2tp2", bwd(T(BSH, S(0, 1)), w([8], "dp2tp2")), None, [S(0, 1), S("P", "P")]),
    ("dp2tp2_seq_batch", "dp2tp2", bwd(T(BSH, S(1, 0)), w([8], "dp2tp2")), None, [S(1, 0), S("P", "P")]),
    ("dp2tp2_batch_only", "dp2tp2", bwd(T(BSH, S(0, None)), w([8], "dp2tp2")), None, [S(0, None), S("P", None)]),
    ("dp2tp2_seq_only", "dp2tp2", bwd(T(BSH, S(None, 1)), w([8], "dp2tp2")), None, [S(None, 1), S(None, "P")]),
    ("dp2tp2_two_axes_on_batch", "dp2tp2", bwd(T(BSH_B8, S(0, 0)), w([8], "dp2tp2")), None,
     [S(0, 0), S("P", "P")]),
    ("3d_batch_seq", "dp2tp2sp2", bwd(T(BSH, S(0, None, 1)), w([8], "dp2tp2sp2")), None,
     [S(0, None, 1), S("P", None, "P")]),
    ("3d_seq_on_tp_and_sp", "dp2tp2sp2", bwd(T(BSH, S(0, 1, 1)), w([8], "dp2tp2sp2")), None,
     [S(0, 1, 1), S("P", "P", "P")]),
    # H sharded: grad and x are gathered on H like the forward's x; dweight Partial on dp only
    ("tp4_hidden_gathered", "tp4", bwd(T(BSH, S(2)), w([8], "tp4")),
     [S(None), S(None), S(None), S(None)], [S(None), S(None)]),
    ("dp2tp2_batch_hidden_gathered", "dp2tp2", bwd(T(BSH, S(0, 2)), w([8], "dp2tp2")),
     [S(0, None), S(0, None), S(None, None), S(0, None)], [S(0, None), S("P", None)]),
    ("3d_hidden_on_tp_gathered", "dp2tp2sp2", bwd(T(BSH, S(0, 2, 1)), w([8], "dp2tp2sp2")),
     [S(0, None, 1), S(0, None, 1), S(None, None, None), S(0, None, 1)], [S(0, None, 1), S("P", None, "P")]),
    # 2-D weight (S, H): dweight sums over B only
    ("dp2_weight2d_batch", "dp2", bwd(T(BSH, S(0)), w([6, 8], "dp2")), None, [S(0), S("P")]),
    ("dp2tp2_weight2d_seq_gathered", "dp2tp2", bwd(T(BSH, S(0, 1)), w([6, 8], "dp2tp2")),
     [S(0, None), S(0, None), S(None, None), S(0, None)], [S(0, None), S("P", None)]),
    # a sum Partial grad on an axis where x is whole is carried into dx and dweight (linear in grad)
    ("tp4_grad_partial_carried", "tp4", bwd(T(BSH, S(None)), w([8], "tp4"), grad=T(BSH, S("P"))), None,
     [S("P"), S("P")]),
    ("dp2tp2_grad_partial_carried", "dp2tp2", bwd(T(BSH, S(0, None)), w([8], "dp2tp2"), grad=T(BSH, S(0, "P"))),
     None, [S(0, "P"), S("P", "P")]),
    ("3d_grad_partial_carried", "dp2tp2sp2",
     bwd(T(BSH, S(0, None, 1)), w([8], "dp2tp2sp2"), grad=T(BSH, S(0, "P", 1))), None,
     [S(0, "P", 1), S("P", "P", "P")]),
    # a Partial grad on an axis that shards x cannot be carried (x is not whole there): reduced to x's layout
    ("dp2tp2_grad_partial_on_sharding_axis", "dp2tp2",
     bwd(T(BSH, S(0, 1)), w([8], "dp2tp2"), grad=T(BSH, S("P", 1))),
     [S(0, 1), S(0, 1), S(None, None), S(0, 1)], [S(0, 1), S("P", "P")]),
    # an avg Partial grad is reduced rather than carried (correct, only not the cheapest plan)
    ("dp2tp2_grad_partial_avg_reduced", "dp2tp2",
     bwd(T(BSH, S(0, None)), w([8], "dp2tp2"), grad=T(BSH, S(0, "P(avg)"))),
     [S(0, None), S(0, None), S(None, None), S(0, None)], [S(0, None), S("P", None)]),
    # a grad sharded elsewhere is brought to x's layout
    ("tp4_grad_sharded_elsewhere", "tp4", bwd(T(BSH, S(1)), w([8], "tp4"), grad=T(BSH, S(2))),
     [S(1), S(1), S(None), S(1)], [S(1), S("P")]),
    ("dp2tp2_mask_dx_only", "dp2tp2", bwd(T(BSH, S(0, 1)), w([8], "dp2tp2"), mask=[True, False]), None,
     [S(0, 1), S("P", "P")]),
]


def _run(mesh_key, op, args, rank=0):
    return plan_row(op, args, MESHES[mesh_key], rank)


@pytest.mark.parametrize("name,mesh_key,args,inputs,outputs", [pytest.param(*r, id=r[0]) for r in FORWARD_ROWS])
def test_forward_layouts(name, mesh_key, args, inputs, outputs):
    result = _run(mesh_key, FWD, args)
    check_row_plan(result, args, inputs, outputs)
    assert not result.localizes
    x, weight, _ = args
    k = len(weight.shape)
    # y has x's shape; rstd x's with the normalized dims 1
    assert [list(o.global_shape) for o in result.outputs] == [x.shape, stats_shape(x.shape, k)]


@pytest.mark.parametrize("name,mesh_key,args,inputs,outputs", [pytest.param(*r, id=r[0]) for r in BACKWARD_ROWS])
def test_backward_layouts(name, mesh_key, args, inputs, outputs):
    result = _run(mesh_key, BWD, args)
    check_row_plan(result, args, inputs, outputs)
    assert not result.localizes
    _, x, weight, _, _ = args
    assert [list(o.global_shape) for o in result.outputs] == [x.shape, weight.shape]


def test_backward_rows_use_the_forward_layouts():
    # The backward rows' default rstd is what the fused forward plans for the same x and weight.
    for name, mesh_key, (grad, x, weight, rstd, _), inputs, _ in BACKWARD_ROWS:
        if grad.spec != x.spec:
            continue
        forward = _run(mesh_key, FWD, fwd(x, weight))
        assert forward.output_specs[1] == rstd.spec, name
        assert list(forward.outputs[1].global_shape) == rstd.shape, name


def test_plans_do_not_depend_on_the_rank():
    # Every rank plans by itself; the plans must agree (or the ranks run different collectives).
    for op, args in ((FWD, fwd(T(UNEVEN, S(0, 2, 1)), w([8], "dp2tp2sp2"))),
                     (BWD, bwd(T(UNEVEN, S(0, 2, 1)), w([8], "dp2tp2sp2"))),
                     (BWD, bwd(T(BSH, S(0, None, 1)), w([8], "dp2tp2sp2"), grad=T(BSH, S(0, "P", 1))))):
        seen = {tuple(layout.to_string() for layout in p.inputs + p.outputs)
                for p in (_run("dp2tp2sp2", op, args, rank=rank) for rank in range(8))}
        assert len(seen) == 1, seen


# --- errors ------------------------------------------------------------------------------------

NOT_LINEAR = ("Partial(sum) input is not supported by this op (it is not linear in it); allowed: Replicate or "
              "Shard (redistribute the Partial input first)")
WEIGHT_ALLOWED = "; allowed: a weight of rank >= 1 shaped like x's trailing dims"

# (id, mesh, op, args, text pieces; the first is the start of the message after "hypershard: ")
ERRORS = [
    ("partial_x_tp4", "tp4", FWD, fwd(T(BSH, S("P")), w([8], "tp4")),
     [f"{OP_NAME}: argument x (#0) [4, 6, 8] (\"None\", \"None\", \"None\") partial(sum: tp): " + NOT_LINEAR]),
    ("partial_x_with_batch_shard", "dp2tp2", FWD, fwd(T(BSH, S(0, "P")), w([8], "dp2tp2")),
     [f"{OP_NAME}: argument x (#0) [4, 6, 8] (\"dp\", \"None\", \"None\") partial(sum: tp): " + NOT_LINEAR]),
    ("partial_x_3d", "dp2tp2sp2", FWD, fwd(T(BSH, S(0, None, "P")), w([8], "dp2tp2sp2")),
     [f"{OP_NAME}: argument x (#0) [4, 6, 8]", "partial(sum: sp)", NOT_LINEAR]),
    ("partial_avg_x", "dp2tp2", FWD, fwd(T(BSH, S(0, "P(avg)")), w([8], "dp2tp2")),
     [f"{OP_NAME}: argument x (#0) [4, 6, 8]", "Partial(avg) input is not supported by this op"]),
    ("partial_weight", "dp2", FWD, fwd(T(BSH, S(0)), w([8], "dp2", S("P"))),
     [f"{OP_NAME}: argument weight (#1) [8] (\"None\",) partial(sum: dp): " + NOT_LINEAR]),
    ("weight_not_trailing", "dp2", FWD, fwd(T(BSH, S(0)), w([6], "dp2")),
     [f"{OP_NAME}: argument weight (#1) [6] (\"None\",): shape [6] is not the end of x's shape [4, 6, 8]"
      + WEIGHT_ALLOWED]),
    ("weight_dims_swapped", "dp2tp2", FWD, fwd(T(BSH, S(0, 1)), w([8, 6], "dp2tp2")),
     [f"{OP_NAME}: argument weight (#1) [8, 6]", "shape [8, 6] is not the end of x's shape [4, 6, 8]"
      + WEIGHT_ALLOWED]),
    ("weight_rank0", "tp4", FWD, fwd(T(BSH, S(0)), w([], "tp4")),
     [f"{OP_NAME}: argument weight (#1) []", "shape [] is not the end of x's shape [4, 6, 8]" + WEIGHT_ALLOWED]),
    ("weight_longer_than_x", "dp2tp2sp2", FWD, fwd(T([6, 8], S(0, None, None)), w(BSH, "dp2tp2sp2")),
     [f"{OP_NAME}: argument weight (#1) [4, 6, 8]", "shape [4, 6, 8] is not the end of x's shape [6, 8]"]),
    # the backward checks the weight as the forward does (its weight is argument #2)
    ("backward_weight_not_trailing", "dp2", BWD, bwd(T(BSH, S(0)), w([6], "dp2"), rstd=T([4, 6, 1], S(0))),
     [f"{BWD_NAME}: argument weight (#2) [6] (\"None\",): shape [6] is not the end of x's shape [4, 6, 8]"]),
    ("backward_rstd_rank", "dp2", BWD, bwd(T(BSH, S(0)), w([8], "dp2"), rstd=T([4, 6], S(0))),
     [f"{BWD_NAME}: argument rstd (#3) [4, 6]", "shape is not [4, 6, 1]"]),
    ("backward_grad_rank", "dp2", BWD, bwd(T(BSH, S(0)), w([8], "dp2"), grad=T([4, 6], S(0))),
     [f"{BWD_NAME}: argument grad (#0) [4, 6]", "shape differs from x [4, 6, 8]"]),
]


@pytest.mark.parametrize("name,mesh_key,op,args,pieces", [pytest.param(*r, id=r[0]) for r in ERRORS])
def test_rule_errors(name, mesh_key, op, args, pieces):
    with pytest.raises((hs.LayoutError, RuntimeError)) as raised:
        _run(mesh_key, op, args)
    check_error_pieces(str(raised.value), pieces)


# The backward rule checks grad's and rstd's global shapes against x's before planning (else only
# the local kernels would complain, with local shapes, after the redistributions).
SHAPE_GAPS = [
    ("grad_last_dim_differs", bwd(T(BSH, S(0)), w([8], "dp2"), grad=T([4, 6, 7], S(0))), "argument grad (#0)"),
    ("grad_batch_differs", bwd(T(BSH, S(0)), w([8], "dp2"), grad=T([2, 6, 8], S(0))), "argument grad (#0)"),
    ("rstd_not_stats_shape", bwd(T(BSH, S(0)), w([8], "dp2"), rstd=T([4, 6, 2], S(0))), "argument rstd (#3)"),
    ("rstd_seq_differs", bwd(T(BSH, S(0)), w([8], "dp2"), rstd=T([4, 5, 1], S(0))), "argument rstd (#3)"),
]


@pytest.mark.parametrize("name,args,piece", [pytest.param(*r, id=r[0]) for r in SHAPE_GAPS])
def test_backward_rule_rejects_mis_shaped_grad_or_rstd(name, args, piece):
    try:
        result = _run("dp2", BWD, args)
    except (hs.LayoutError, RuntimeError) as exc:
        assert str(exc).startswith(f"hypershard: {BWD_NAME}: {piece}"), str(exc)
        return
    raise AssertionError(f"no error; planned inputs {result.input_specs} of global shapes "
                         f"{[list(i.global_shape) for i in result.inputs]}")


def test_enough_rows():
    cases = len(FORWARD_ROWS) + len(BACKWARD_ROWS) + len(ERRORS)
    assert cases >= 60 and len(ERRORS) >= 12
    assert {r[1] for r in FORWARD_ROWS} == set(MESHES) == {r[1] for r in BACKWARD_ROWS}


# --- the non-fused form: the same layouts from the pointwise and reduction rules ----------------

def _key(t: torch.Tensor):
    """One tensor value of the trace: its storage and view (tensors of the trace stay alive, so
    a storage is never reused; aliases with the same view have the same layout)."""
    return (t.untyped_storage().data_ptr(), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


class _Recorder(TorchDispatchMode):
    """Lists every aten call (op, args, kwargs, result) below autograd."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


def trace(shape, x_dtype=torch.float32, w_dtype=torch.float32):
    """The composed form on plain tensors: (forward calls, backward calls, x, w, g, y, dx, dw).
    The backward is torch.autograd.grad with an explicit cotangent g (no ones_like, no
    AccumulateGrad copies)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(x_dtype).requires_grad_()
    weight = torch.randn(shape[-1], generator=gen).to(w_dtype).requires_grad_()
    recorder = _Recorder()
    with recorder:
        y = hops.rms_norm_composed(x, weight, EPS)
    forward = list(recorder.calls)
    g = torch.randn(y.shape, generator=gen).to(y.dtype)
    with recorder:
        dx, dw = torch.autograd.grad(y, (x, weight), g)
    return forward, recorder.calls[len(forward):], x, weight, g, y, dx, dw


def _reduced(layout):
    return hs.Layout.create(layout.mesh, layout.global_shape, layout.dim_axes, [None] * layout.mesh.ndim)


def replay(calls, mesh: PlanningMesh, layouts: dict, reduce_partials=False) -> list:
    """Plans each call on DTensors laid out as the earlier plans left its operands (`layouts`, by
    _key, is updated with each result). A Python number where the schema has a Tensor (``add(t,
    eps)``) is passed as a plain 0-d tensor (a Replicate operand, as the dispatch sees the
    wrapped number). A rule's error propagates (strict mode) unless `reduce_partials`: then a
    Partial operand the rule refuses is reduced first, as default mode's implicit redistribution
    does. Returns one line per call: op, planned inputs -> outputs (and the reductions made)."""
    log = []
    for func, args, kwargs, out in calls:
        while True:
            def to_dtensor(a):
                if isinstance(a, torch.Tensor):
                    return mesh.dtensor(list(a.shape), layouts[_key(a)], a.dtype)
                return a
            dargs, dkwargs = list(tree_map(to_dtensor, args)), tree_map(to_dtensor, kwargs)
            for i, argument in enumerate(func._schema.arguments[:len(dargs)]):
                if isinstance(argument.type, torch._C.TensorType) and isinstance(dargs[i], (int, float)):
                    dargs[i] = torch.scalar_tensor(dargs[i], dtype=torch.float64)
            try:
                result = plan(func, *dargs, **dkwargs)
                break
            except hs.LayoutError as exc:
                partial = [a for a in args if isinstance(a, torch.Tensor) and layouts[_key(a)].has_partial()]
                if not (reduce_partials and partial and "Partial(sum) input is not supported" in str(exc)):
                    raise
                for a in partial:
                    layouts[_key(a)] = _reduced(layouts[_key(a)])
                log.append(f"{func}: Partial operand reduced")
        assert result.refused == "", (func, result.refused)
        outs = out if isinstance(out, (tuple, list)) else [out]
        for o, layout in zip(outs, result.outputs):
            if isinstance(o, torch.Tensor):
                layouts[_key(o)] = layout
        log.append(f"{func} {result.input_specs} -> {result.output_specs}")
    return log


def composed_layouts(mesh_key, shape, x_spec, x_dtype=torch.float32, w_dtype=torch.float32, g_spec=None,
                     reduce_partials=False):
    """y, dx, dweight of the composed form by chaining the plans of its aten ops: x laid out as
    `x_spec`, the weight Replicate, the cotangent as `g_spec` (default: y's planned layout)."""
    forward, backward, x, weight, g, y, dx, dw = trace(shape, x_dtype, w_dtype)
    mesh = PlanningMesh(MESHES[mesh_key])
    layouts = {_key(x): mesh.layout(shape, x_spec), _key(weight): mesh.layout([shape[-1]], R(mesh_key))}
    log = replay(forward, mesh, layouts, reduce_partials)
    layouts[_key(g)] = layouts[_key(y)] if g_spec is None else mesh.layout(shape, g_spec)
    log += replay(backward, mesh, layouts, reduce_partials)
    return layouts[_key(y)], layouts[_key(dx)], layouts[_key(dw)], log, forward + backward


def fused_layouts(mesh_key, shape, x_spec, x_dtype=torch.float32, w_dtype=torch.float32, g_spec=None):
    """y, dx, dweight of the fused op: its forward plan, then its backward plan with grad laid out
    as `g_spec` (default y's), x as given and rstd as the forward planned it."""
    mesh = PlanningMesh(MESHES[mesh_key])
    x = mesh.dtensor(shape, x_spec, x_dtype)
    weight = mesh.dtensor([shape[-1]], R(mesh_key), w_dtype)
    forward = plan(FWD, x, weight, EPS)
    y_layout, rstd_layout = forward.outputs
    y_dtype = torch.result_type(x, weight)
    grad = mesh.dtensor(shape, y_layout if g_spec is None else g_spec, y_dtype)
    rstd = mesh.dtensor(list(rstd_layout.global_shape), rstd_layout, torch.float32)
    backward = plan(BWD, grad, x, weight, rstd, BOTH)
    return y_layout, backward.outputs[0], backward.outputs[1]


DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]

# (id, mesh, x shape, x spec): the leading dims sharded or x whole
SAME_LAYOUT_ROWS = [
    ("dp2_batch", "dp2", BSH, S(0)),
    ("dp2_seq", "dp2", BSH, S(1)),
    ("dp2_replicate", "dp2", BSH, S(None)),
    ("dp2_uneven_batch", "dp2", UNEVEN, S(0)),
    ("tp4_seq", "tp4", BSH, S(1)),
    ("tp4_uneven_seq", "tp4", UNEVEN_S7, S(1)),
    ("dp2tp2_batch_seq", "dp2tp2", BSH, S(0, 1)),
    ("dp2tp2_seq_batch", "dp2tp2", BSH, S(1, 0)),
    ("dp2tp2_batch_only", "dp2tp2", BSH, S(0, None)),
    ("dp2tp2_two_axes_on_batch", "dp2tp2", BSH_B8, S(0, 0)),
    ("dp2tp2_uneven", "dp2tp2", UNEVEN, S(0, 1)),
    ("3d_batch_seq", "dp2tp2sp2", BSH, S(0, None, 1)),
    ("3d_seq_on_tp_and_sp", "dp2tp2sp2", BSH, S(0, 1, 1)),
    ("3d_replicate", "dp2tp2sp2", BSH, S(None, None, None)),
]


def test_trace_lists_the_composed_ops():
    # The trace is the composed form's own: HF's float32 variance, rsqrt, cast back, times weight.
    forward, backward, *_ = trace(BSH, torch.bfloat16, torch.bfloat16)
    ops = [str(call[0]) for call in forward]
    assert ops == ["aten._to_copy.default", "aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.add.Tensor",
                   "aten.rsqrt.default", "aten.detach.default", "aten.mul.Tensor", "aten._to_copy.default",
                   "aten.mul.Tensor"], ops
    assert {"aten.sum.dim_IntList", "aten.view.default", "aten.expand.default", "aten.div.Scalar"} <= \
        {str(call[0]) for call in backward}
    # float32 x: no casts
    forward32, *_ = trace(BSH)
    assert [str(call[0]) for call in forward32] == [op for op in ops if op != "aten._to_copy.default"]


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name,mesh_key,shape,x_spec", [pytest.param(*r, id=r[0]) for r in SAME_LAYOUT_ROWS])
def test_composed_form_gets_the_fused_layouts(name, mesh_key, shape, x_spec, x_dtype, w_dtype):
    y_c, dx_c, dw_c, log, _ = composed_layouts(mesh_key, shape, x_spec, x_dtype, w_dtype)
    y_f, dx_f, dw_f = fused_layouts(mesh_key, shape, x_spec, x_dtype, w_dtype)
    trail = "\n".join(log)
    assert short_spec(y_c) == short_spec(y_f) == x_spec, trail
    assert y_c.to_string() == y_f.to_string(), trail          # the shard order too
    assert short_spec(dx_c) == short_spec(dx_f) == x_spec, trail
    assert dx_c.to_string() == dx_f.to_string(), trail
    # dweight: Partial(sum) on exactly the axes that shard x's leading dims, in both forms
    want_dw = ["P" if p.startswith("S(") else "R" for p in x_spec]
    assert short_spec(dw_c) == short_spec(dw_f) == want_dw, trail
    assert list(dw_c.global_shape) == list(dw_f.global_shape) == [shape[-1]]


# A sum Partial cotangent on an axis where x is whole: both forms carry it into dx and dweight.
PARTIAL_GRAD_ROWS = [
    ("tp4_replicate", "tp4", S(None), S("P")),
    ("dp2tp2_batch_only", "dp2tp2", S(0, None), S(0, "P")),
    ("3d_batch_seq", "dp2tp2sp2", S(0, None, 1), S(0, "P", 1)),
]


@pytest.mark.parametrize("name,mesh_key,x_spec,g_spec", [pytest.param(*r, id=r[0]) for r in PARTIAL_GRAD_ROWS])
def test_composed_backward_carries_a_partial_grad_like_the_fused_op(name, mesh_key, x_spec, g_spec):
    _, dx_c, dw_c, log, _ = composed_layouts(mesh_key, BSH, x_spec, g_spec=g_spec)
    _, dx_f, dw_f = fused_layouts(mesh_key, BSH, x_spec, g_spec=g_spec)
    trail = "\n".join(log)
    assert short_spec(dx_c) == short_spec(dx_f) == g_spec, trail
    want_dw = ["P" if p.startswith("S(") or p == "P" else "R" for p in g_spec]
    assert short_spec(dw_c) == short_spec(dw_f) == want_dw, trail


HIDDEN_ROWS = [
    ("dp2_hidden", "dp2", S(2)),
    ("tp4_hidden", "tp4", S(2)),
    ("dp2tp2_batch_hidden", "dp2tp2", S(0, 2)),
    ("3d_hidden_on_tp", "dp2tp2sp2", S(0, 2, 1)),
]


@pytest.mark.parametrize("name,mesh_key,x_spec", [pytest.param(*r, id=r[0]) for r in HIDDEN_ROWS])
def test_hidden_sharded_composed_form_differs(name, mesh_key, x_spec):
    """x sharded on H, the normalized dim. The fused op gathers H: y, dx whole on H, dweight
    Partial on the leading dims' axes only. The composed form keeps H sharded: mean.dim over the
    sharded H gives a Partial(sum) variance, which rsqrt refuses (strict mode raises there); with
    that Partial reduced (default mode's implicit all-reduce of the (B, S, 1) variance) y and dx
    stay sharded on H and dweight is sharded on H too. Both are correct; the layouts differ, so
    the fused form is not a drop-in for the composed one there (the header of
    csrc/ops/normalization.cpp says "the normalized dim is whole" of the composed form too)."""
    with pytest.raises(hs.LayoutError, match=r"aten::rsqrt: argument self \(#0\) .*partial\(sum: .*Partial\(sum\) "
                                             r"input is not supported by this op"):
        composed_layouts(mesh_key, BSH, x_spec)
    y_c, dx_c, dw_c, log, _ = composed_layouts(mesh_key, BSH, x_spec, reduce_partials=True)
    assert [line for line in log if "reduced" in line] == ["aten.rsqrt.default: Partial operand reduced"], log
    y_f, dx_f, dw_f = fused_layouts(mesh_key, BSH, x_spec)
    whole_h = ["R" if p == "S(2)" else p for p in x_spec]
    assert short_spec(y_f) == short_spec(dx_f) == whole_h
    assert short_spec(y_c) == short_spec(dx_c) == x_spec, log
    assert short_spec(dw_f) == ["P" if p.startswith("S(") and p != "S(2)" else "R" for p in x_spec]
    assert short_spec(dw_c) == ["S(0)" if p == "S(2)" else ("P" if p.startswith("S(") else "R") for p in x_spec], log


@pytest.mark.parametrize("mesh_key,x_spec", [("tp4", S("P")), ("dp2tp2", S(0, "P"))])
def test_partial_x_refused_by_both_forms(mesh_key, x_spec):
    # The fused rule refuses a Partial(sum) x; the composed form's first non-linear op (pow) does too.
    with pytest.raises(hs.LayoutError, match="Partial\\(sum\\) input is not supported by this op"):
        fused_layouts(mesh_key, BSH, x_spec)
    with pytest.raises(hs.LayoutError, match="aten::pow.Tensor_Scalar: argument self \\(#0\\)"):
        composed_layouts(mesh_key, BSH, x_spec)


# --- torch_npu's names: one rule ---------------------------------------------------------------

NPU_SCHEMAS = {
    "npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_rms_norm_backward": "npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> "
                             "(Tensor, Tensor)",
}
@pytest.fixture(scope="module")
def npu():
    """torch.ops.npu with torch_npu's RMSNorm schemas (stand-ins without kernels where torch_npu is absent)."""
    return define_npu_standins(NPU_SCHEMAS)


NPU_ROWS = ["dp2_batch", "dp2_hidden_gathered", "tp4_uneven_seq", "dp2tp2_batch_seq", "dp2tp2_batch_hidden_gathered",
            "dp2tp2_two_axes_on_batch", "3d_batch_seq", "3d_hidden_on_tp_gathered", "dp2_weight2d_batch",
            "3d_bsnd_weight2d"]


@pytest.mark.parametrize("name", NPU_ROWS)
def test_npu_ops_plan_like_the_hypershard_op(npu, name):
    _, mesh_key, (x, weight, eps), _, _ = next(r for r in FORWARD_ROWS if r[0] == name)
    want = _run(mesh_key, FWD, (x, weight, eps))
    got = _run(mesh_key, npu.npu_rms_norm.default, (x, weight, eps))
    assert (got.input_specs, got.output_specs, got.refused) == (want.input_specs, want.output_specs, "")
    assert [o.to_string() for o in got.outputs] == [o.to_string() for o in want.outputs]
    grad, x, weight, rstd, _ = bwd(x, weight)
    want = _run(mesh_key, BWD, (grad, x, weight, rstd, BOTH))
    got = _run(mesh_key, npu.npu_rms_norm_backward.default, (grad, x, weight, rstd))
    assert (got.input_specs, got.output_specs, got.refused) == (want.input_specs, want.output_specs, "")
    assert [o.to_string() for o in got.outputs] == [o.to_string() for o in want.outputs]


@pytest.mark.parametrize("name", ["tp4_grad_partial_carried", "dp2tp2_grad_partial_carried",
                                  "dp2tp2_grad_partial_on_sharding_axis"])
def test_npu_backward_partial_grad_like_the_hypershard_op(npu, name):
    _, mesh_key, (grad, x, weight, rstd, _), _, _ = next(r for r in BACKWARD_ROWS if r[0] == name)
    want = _run(mesh_key, BWD, (grad, x, weight, rstd, BOTH))
    got = _run(mesh_key, npu.npu_rms_norm_backward.default, (grad, x, weight, rstd))
    assert (got.input_specs, got.output_specs) == (want.input_specs, want.output_specs)


def test_npu_errors_name_npu_arguments(npu):
    cases = [
        (npu.npu_rms_norm.default, fwd(T(BSH, S("P")), w([8], "dp2")),
         "hypershard: npu::npu_rms_norm: argument self (#0) [4, 6, 8] (\"None\", \"None\", \"None\") partial(sum: dp): "
         + NOT_LINEAR),
        (npu.npu_rms_norm.default, fwd(T(BSH, S(0)), w([8], "dp2", S("P"))),
         "hypershard: npu::npu_rms_norm: argument gamma (#1) [8]"),
        (npu.npu_rms_norm.default, fwd(T(BSH, S(0)), w([6], "dp2")),
         "hypershard: npu::npu_rms_norm: argument gamma (#1) [6] (\"None\",): shape [6] is not the end of x's shape "
         "[4, 6, 8]" + WEIGHT_ALLOWED),
        (npu.npu_rms_norm_backward.default, bwd(T(BSH, S(0)), w([6], "dp2"), rstd=T([4, 6, 1], S(0)))[:4],
         "hypershard: npu::npu_rms_norm_backward: argument gamma (#2) [6]"),
        (npu.npu_rms_norm_backward.default, bwd(T(BSH, S(0)), w([8], "dp2"), rstd=T([4, 6], S(0)))[:4],
         "hypershard: npu::npu_rms_norm_backward: argument rstd (#3) [4, 6]"),
    ]
    for op, args, start in cases:
        with pytest.raises((hs.LayoutError, RuntimeError)) as raised:
            _run("dp2", op, args)
        assert str(raised.value).startswith(start), (start, str(raised.value))


# --- torch's _fused_rms_norm (F.rms_norm's CUDA kernel): one rule, dims from normalized_shape ----

FUSED_FWD = torch.ops.aten._fused_rms_norm.default
FUSED_BWD = torch.ops.aten._fused_rms_norm_backward.default


def _fused_fwd(args, with_weight=True):
    x, weight, eps = args
    return (x, list(weight.shape), weight if with_weight else None, eps)


def _fused_bwd(args):
    grad, x, weight, rstd, mask = args
    return (grad, x, list(weight.shape), rstd, weight, mask)


@pytest.mark.parametrize("name,mesh_key,args", [pytest.param(r[0], r[1], r[2], id=r[0]) for r in FORWARD_ROWS])
def test_fused_rms_norm_plans_like_the_hypershard_op(name, mesh_key, args):
    want = _run(mesh_key, FWD, args)
    got = _run(mesh_key, FUSED_FWD, _fused_fwd(args))
    assert (got.input_specs, got.output_specs, got.refused) == (want.input_specs, want.output_specs, "")
    assert [o.to_string() for o in got.outputs] == [o.to_string() for o in want.outputs]


@pytest.mark.parametrize("name,mesh_key,args", [pytest.param(r[0], r[1], r[2], id=r[0]) for r in BACKWARD_ROWS])
def test_fused_rms_norm_backward_plans_like_the_hypershard_op(name, mesh_key, args):
    want = _run(mesh_key, BWD, args)
    got = _run(mesh_key, FUSED_BWD, _fused_bwd(args))
    # the aten schema orders (grad_out, input, rstd, weight): the same layouts, weight last
    grad, x, weight, rstd = want.input_specs
    assert got.input_specs == [grad, x, rstd, weight]
    assert (got.output_specs, got.refused) == (want.output_specs, "")
    assert [o.to_string() for o in got.outputs] == [o.to_string() for o in want.outputs]


@pytest.mark.parametrize("name", ["dp2_batch", "tp4_seq", "dp2tp2_batch_hidden_gathered", "3d_bsnd_weight2d"])
def test_fused_rms_norm_without_weight(name):
    # weight=None (elementwise_affine=False): x and rstd plan as with a weight
    _, mesh_key, args, _, _ = next(r for r in FORWARD_ROWS if r[0] == name)
    want = _run(mesh_key, FWD, args)
    got = _run(mesh_key, FUSED_FWD, _fused_fwd(args, with_weight=False))
    assert got.input_specs == want.input_specs[:1] and got.output_specs == want.output_specs
    grad, x, weight, rstd, mask = bwd(args[0], args[1])
    got = _run(mesh_key, FUSED_BWD, (grad, x, list(weight.shape), rstd, None, [True, False]))
    assert got.output_specs[0] == _run(mesh_key, BWD, (grad, x, weight, rstd, mask)).output_specs[0]


def test_fused_rms_norm_errors():
    fused = "hypershard: aten::_fused_rms_norm: "
    cases = [
        (FUSED_FWD, (T(BSH, S("P")), [8], w([8], "dp2"), EPS),
         fused + "argument input (#0) [4, 6, 8] (\"None\", \"None\", \"None\") partial(sum: dp): " + NOT_LINEAR),
        (FUSED_FWD, (T(BSH, S(0)), [6], w([6], "dp2"), EPS),
         fused + "argument input (#0) [4, 6, 8] (\"dp\", \"None\", \"None\"): shape [4, 6, 8] does not end with "
                 "normalized_shape [6]"),
        (FUSED_FWD, (T(BSH, S(0)), [8], w([6, 8], "dp2"), EPS),
         fused + "argument weight (#2) [6, 8] (\"None\", \"None\"): shape [6, 8] is not normalized_shape [8]; "
                 "allowed: a weight shaped like normalized_shape"),
        (FUSED_BWD, (T(BSH, S(0)), T(BSH, S(0)), [8], T([4, 6], S(0)), w([8], "dp2"), BOTH),
         "hypershard: aten::_fused_rms_norm_backward: argument rstd (#3) [4, 6]"),
    ]
    for op, args, start in cases:
        with pytest.raises((hs.LayoutError, RuntimeError)) as raised:
            _run("dp2", op, args)
        assert str(raised.value).startswith(start), (start, str(raised.value))
