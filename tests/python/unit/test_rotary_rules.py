"""UT: the distributed rule of rotary position embedding (csrc/ops/rotary.cpp), without processes.

One rule serves hypershard::rotary_position_embedding, its backward and torch_npu's rotary ops:
D (the last dim) is never sharded, B/N/S are free, the output is laid out like x, cos/sin follow
x on the dims they share with it or are whole on their size-1 (broadcast) dims, no forward input
is Partial; the backward reduces a Partial grad, lays dx out like x and dcos/dsin like cos/sin
plus Partial(sum) on every axis that shards x on a dim where cos/sin broadcast. Each row runs the
rule on meta DTensors of a mesh without process groups (hypershard.testing.planning) in the
layouts BNSD, BSND and SBND, on meshes of one, two and three axes.
"""

from __future__ import annotations

import pytest
import torch

import hypershard as hs
from hypershard.testing.fused import define_npu_standins
from hypershard.testing.planning import Arg as T
from hypershard.testing.planning import check_error_pieces, check_row_plan, plan_row
from hypershard.testing.planning import spec as S

FWD = torch.ops.hypershard.rotary_position_embedding.default
BWD = torch.ops.hypershard.rotary_position_embedding_backward.default
OP_NAME = "hypershard::rotary_position_embedding"
BWD_NAME = "hypershard::rotary_position_embedding_backward"
ALL = [True, True, True]

MESHES = {
    "dp2": {"dp": 2},
    "tp4": {"tp": 4},
    "dp2tp2": {"dp": 2, "tp": 2},
    "dp2sp2": {"dp": 2, "sp": 2},
    "tp2sp2": {"tp": 2, "sp": 2},
    "dp2tp2sp2": {"dp": 2, "tp": 2, "sp": 2},
}

# B, N, S, D = 4, 4, 6, 8 in three layouts; D = 8 is divisible by 4, so every mode applies.
BNSD, BSND, SBND = [4, 4, 6, 8], [4, 6, 4, 8], [6, 4, 4, 8]
BNSD_TABLE, BN1D_TABLE = [1, 1, 6, 8], [4, 1, 6, 8]   # (1, 1, S, D) and (B, 1, S, D)
BSND_TABLE, SBND_TABLE = [1, 6, 1, 8], [6, 1, 1, 8]   # (1, S, 1, D) and (S, 1, 1, D)


def fwd(x, cos, sin=None, mode=0):
    """Forward arguments; sin defaults to a table laid out like cos."""
    return (x, cos, sin if sin is not None else T(cos.shape, cos.spec), mode)


def bwd(x, cos, sin=None, grad=None, mode=0, mask=ALL):
    """Backward arguments (grad, x, cos, sin, mode, output_mask); grad defaults to x's layout."""
    sin = sin if sin is not None else T(cos.shape, cos.spec)
    grad = grad if grad is not None else T(x.shape, x.spec)
    return (grad, x, cos, sin, mode, mask)


# (id, mesh, args, expected input specs (None: as given), expected output specs)
FORWARD_ROWS = [
    ("all_replicate_full", "dp2tp2", fwd(T(BNSD, S(None, None)), T(BNSD, S(None, None))), None, [S(None, None)]),
    ("all_replicate_broadcast", "tp4", fwd(T(BNSD, S(None)), T(BNSD_TABLE, S(None))), None, [S(None)]),
    ("batch_on_dp_broadcast", "dp2", fwd(T(BNSD, S(0)), T(BNSD_TABLE, S(None))), None, [S(0)]),
    ("batch_on_dp_full", "dp2", fwd(T(BNSD, S(0)), T(BNSD, S(0))), None, [S(0)]),
    ("heads_on_tp_full", "tp4", fwd(T(BNSD, S(1)), T(BNSD, S(1))), None, [S(1)]),
    ("heads_on_tp_broadcast", "tp4", fwd(T(BNSD, S(1)), T(BNSD_TABLE, S(None))), None, [S(1)]),
    ("dp_tp_full", "dp2tp2", fwd(T(BNSD, S(0, 1)), T(BNSD, S(0, 1))), None, [S(0, 1)]),
    ("dp_tp_broadcast_replicate", "dp2tp2", fwd(T(BNSD, S(0, 1)), T(BNSD_TABLE, S(None, None))), None, [S(0, 1)]),
    ("dp_tp_batch_table", "dp2tp2", fwd(T(BNSD, S(0, 1)), T(BN1D_TABLE, S(0, None))), None, [S(0, 1)]),
    ("dp_sp_seq_table", "dp2sp2", fwd(T(BNSD, S(0, 2)), T(BNSD_TABLE, S(None, 2))), None, [S(0, 2)]),
    ("sp_only", "dp2sp2", fwd(T(BNSD, S(None, 2)), T(BNSD_TABLE, S(None, 2))), None, [S(None, 2)]),
    ("tp_sp_seq_table", "tp2sp2", fwd(T(BNSD, S(1, 2)), T(BNSD_TABLE, S(None, 2))), None, [S(1, 2)]),
    ("tp_sp_full", "tp2sp2", fwd(T(BNSD, S(1, 2)), T(BNSD, S(1, 2))), None, [S(1, 2)]),
    ("dp_tp_sp_seq_table", "dp2tp2sp2", fwd(T(BNSD, S(0, 1, 2)), T(BNSD_TABLE, S(None, None, 2))), None,
     [S(0, 1, 2)]),
    ("dp_tp_sp_full", "dp2tp2sp2", fwd(T(BNSD, S(0, 1, 2)), T(BNSD, S(0, 1, 2))), None, [S(0, 1, 2)]),
    ("bsnd_dp_sp", "dp2sp2", fwd(T(BSND, S(0, 1)), T(BSND_TABLE, S(None, 1))), None, [S(0, 1)]),
    ("bsnd_tp_sp", "tp2sp2", fwd(T(BSND, S(2, 1)), T(BSND_TABLE, S(None, 1))), None, [S(2, 1)]),
    ("bsnd_dp_tp_sp", "dp2tp2sp2", fwd(T(BSND, S(0, 2, 1)), T(BSND_TABLE, S(None, None, 1))), None,
     [S(0, 2, 1)]),
    ("sbnd_dp_sp", "dp2sp2", fwd(T(SBND, S(1, 0)), T(SBND_TABLE, S(None, 0))), None, [S(1, 0)]),
    ("sbnd_dp_tp_broadcast", "dp2tp2", fwd(T(SBND, S(1, 2)), T(SBND_TABLE, S(None, None))), None, [S(1, 2)]),
    # dp and tp both on B (B = 8 over 4 ranks); the full table follows with both axes
    ("two_axes_on_batch", "dp2tp2", fwd(T([8, 4, 6, 8], S(0, 0)), T([8, 4, 6, 8], S(0, 0))), None, [S(0, 0)]),
    # uneven: N = 5 over 4 ranks (2, 2, 1, 0), S = 7 over 2 (4, 3), B = 3 over 2 (2, 1)
    ("uneven_heads", "tp4", fwd(T([2, 5, 6, 8], S(1)), T([2, 5, 6, 8], S(1))), None, [S(1)]),
    ("uneven_batch_seq", "dp2sp2", fwd(T([3, 4, 7, 8], S(0, 2)), T([1, 1, 7, 8], S(None, 2))), None, [S(0, 2)]),
    # cos and sin of different shapes: each follows x by itself
    ("cos_full_sin_broadcast", "dp2tp2",
     fwd(T(BNSD, S(0, 1)), T(BNSD, S(0, 1)), T(BNSD_TABLE, S(None, None))), None, [S(0, 1)]),
    # a size-1 dim of x is not a broadcast: (1 == 1) either may say Replicate
    ("size_one_dim_of_x", "dp2", fwd(T([4, 1, 6, 8], S(0)), T([1, 1, 6, 8], S(None))), None, [S(0)]),
    # any rank: (B*N, S, D) with a (1, S, D) table
    ("rank3", "dp2sp2", fwd(T([16, 6, 8], S(0, 1)), T([1, 6, 8], S(None, 1))), None, [S(0, 1)]),
    ("d_only_rank1", "tp4", fwd(T([8], S(None)), T([8], S(None))), None, [S(None)]),
]

# The backward: outputs are (dx, dcos, dsin).
BACKWARD_ROWS = [
    # x S(0) on dp with cos (1, 1, S, D): every dp rank sums its own rows of B -> dcos Partial on dp
    ("batch_on_dp_broadcast", "dp2", bwd(T(BNSD, S(0)), T(BNSD_TABLE, S(None))), None, [S(0), S("P"), S("P")]),
    ("heads_on_tp_full", "tp4", bwd(T(BNSD, S(1)), T(BNSD, S(1))), None, [S(1), S(1), S(1)]),
    ("dp_tp_full", "dp2tp2", bwd(T(BNSD, S(0, 1)), T(BNSD, S(0, 1))), None, [S(0, 1), S(0, 1), S(0, 1)]),
    ("dp_tp_broadcast", "dp2tp2", bwd(T(BNSD, S(0, 1)), T(BNSD_TABLE, S(None, None))), None,
     [S(0, 1), S("P", "P"), S("P", "P")]),
    ("dp_tp_batch_table", "dp2tp2", bwd(T(BNSD, S(0, 1)), T(BN1D_TABLE, S(0, None))), None,
     [S(0, 1), S(0, "P"), S(0, "P")]),
    ("dp_sp_seq_table", "dp2sp2", bwd(T(BNSD, S(0, 2)), T(BNSD_TABLE, S(None, 2))), None,
     [S(0, 2), S("P", 2), S("P", 2)]),
    ("tp_sp_seq_table", "tp2sp2", bwd(T(BNSD, S(1, 2)), T(BNSD_TABLE, S(None, 2))), None,
     [S(1, 2), S("P", 2), S("P", 2)]),
    ("dp_tp_sp_seq_table", "dp2tp2sp2", bwd(T(BNSD, S(0, 1, 2)), T(BNSD_TABLE, S(None, None, 2))), None,
     [S(0, 1, 2), S("P", "P", 2), S("P", "P", 2)]),
    ("bsnd_dp_sp", "dp2sp2", bwd(T(BSND, S(0, 1)), T(BSND_TABLE, S(None, 1))), None,
     [S(0, 1), S("P", 1), S("P", 1)]),
    ("sbnd_dp_sp", "dp2sp2", bwd(T(SBND, S(1, 0)), T(SBND_TABLE, S(None, 0))), None,
     [S(1, 0), S("P", 0), S("P", 0)]),
    ("two_axes_on_batch_broadcast", "dp2tp2", bwd(T([8, 4, 6, 8], S(0, 0)), T(BNSD_TABLE, S(None, None))), None,
     [S(0, 0), S("P", "P"), S("P", "P")]),
    ("cos_full_sin_broadcast", "dp2tp2",
     bwd(T(BNSD, S(0, 1)), T(BNSD, S(0, 1)), T(BNSD_TABLE, S(None, None))), None,
     [S(0, 1), S(0, 1), S("P", "P")]),
    ("uneven_heads", "tp4", bwd(T([2, 5, 6, 8], S(1)), T([1, 1, 6, 8], S(None))), None, [S(1), S("P"), S("P")]),
    # a Partial grad is reduced to x's (non-Partial) layout: the backward is linear in grad
    ("partial_grad_reduced", "dp2tp2",
     bwd(T(BNSD, S(0, 1)), T(BNSD_TABLE, S(None, None)), grad=T(BNSD, S("P", 1))),
     [S(0, 1), S(0, 1), S(None, None), S(None, None)], [S(0, 1), S("P", "P"), S("P", "P")]),
    ("partial_grad_replicated_x", "tp4", bwd(T(BNSD, S(None)), T(BNSD, S(None)), grad=T(BNSD, S("P"))),
     [S(None), S(None), S(None), S(None)], [S(None), S(None), S(None)]),
    # a grad sharded elsewhere (even on D) is brought to x's layout
    ("grad_sharded_elsewhere", "tp4", bwd(T(BNSD, S(1)), T(BNSD, S(1)), grad=T(BNSD, S(3))),
     [S(1), S(1), S(1), S(1)], [S(1), S(1), S(1)]),
    # the backward cuts a full-size replicated table like x (no refusal: the forward raised it)
    ("full_replicated_table_cut", "dp2", bwd(T(BNSD, S(0)), T(BNSD, S(None))),
     [S(0), S(0), S(0), S(0)], [S(0), S(0), S(0)]),
    ("output_mask_dx_only", "dp2tp2", bwd(T(BNSD, S(0, 1)), T(BNSD_TABLE, S(None, None)), mask=[True, False, False]),
     None, [S(0, 1), S("P", "P"), S("P", "P")]),
]


def _run(mesh_key, op, args, rank=0):
    return plan_row(op, args, MESHES[mesh_key], rank)


@pytest.mark.parametrize("name,mesh_key,args,inputs,outputs", [pytest.param(*r, id=r[0]) for r in FORWARD_ROWS])
def test_forward_layouts(name, mesh_key, args, inputs, outputs):
    result = _run(mesh_key, FWD, args)
    check_row_plan(result, args, inputs, outputs)


@pytest.mark.parametrize("name,mesh_key,args,inputs,outputs", [pytest.param(*r, id=r[0]) for r in BACKWARD_ROWS])
def test_backward_layouts(name, mesh_key, args, inputs, outputs):
    result = _run(mesh_key, BWD, args)
    check_row_plan(result, args, inputs, outputs)


MODE_ROWS = ["dp_tp_broadcast_replicate", "dp_tp_sp_seq_table", "bsnd_dp_sp", "sbnd_dp_sp", "uneven_heads"]


@pytest.mark.parametrize("name", MODE_ROWS)
def test_every_mode_gives_the_same_layouts(name):
    _, mesh_key, args, _, _ = next(r for r in FORWARD_ROWS if r[0] == name)
    x, cos, sin, _ = args
    forward = {mode: _run(mesh_key, FWD, (x, cos, sin, mode)) for mode in range(4)}
    backward = {mode: _run(mesh_key, BWD, bwd(x, cos, sin, mode=mode)) for mode in range(4)}
    for table in (forward, backward):
        specs = {mode: (p.input_specs, p.output_specs, p.refused) for mode, p in table.items()}
        assert all(s == specs[0] for s in specs.values()), specs


def test_plans_do_not_depend_on_the_rank():
    # Every rank plans by itself; the plans must agree (or the ranks run different collectives).
    x, cos = T(BNSD, S(0, 1, 2)), T(BNSD_TABLE, S(None, None, 2))
    for op, args in ((FWD, fwd(x, cos)), (BWD, bwd(x, cos))):
        seen = {tuple(layout.to_string() for layout in p.inputs + p.outputs)
                for p in (_run("dp2tp2sp2", op, args, rank=rank) for rank in range(8))}
        assert len(seen) == 1, seen


# --- full-size replicated tables where x is sharded: cut locally, refused in strict mode -------

REFUSALS = [
    # (id, mesh, args, planned input specs, text pieces of the refusal)
    ("cos_and_sin_whole_on_dp", "dp2", fwd(T(BNSD, S(0)), T(BNSD, S(None))), [S(0), S(0), S(0)],
     ["argument cos (#1) [4, 4, 6, 8]", "full-size dim 0 is whole where x is sharded on mesh axis 'dp'"]),
    ("sin_only_whole_on_tp", "tp4", fwd(T(BNSD, S(1)), T(BNSD_TABLE, S(None)), T(BNSD, S(None))),
     [S(1), S(None), S(1)], ["argument sin (#2) [4, 4, 6, 8]", "full-size dim 1 is whole where x is sharded on "
                                                               "mesh axis 'tp'"]),
    ("cos_half_like_x", "dp2tp2", fwd(T(BNSD, S(0, 1)), T(BNSD, S(0, None))), [S(0, 1), S(0, 1), S(0, 1)],
     ["argument cos (#1)", "full-size dim 1 is whole where x is sharded on mesh axis 'tp'"]),
    ("seq_table_whole_on_sp", "dp2sp2", fwd(T(BNSD, S(0, 2)), T(BNSD_TABLE, S(None, None))),
     [S(0, 2), S(None, 2), S(None, 2)], ["argument cos (#1) [1, 1, 6, 8]",
                                         "full-size dim 2 is whole where x is sharded on mesh axis 'sp'"]),
]


@pytest.mark.parametrize("name,mesh_key,args,inputs,pieces", [pytest.param(*r, id=r[0]) for r in REFUSALS])
def test_full_size_replicated_table_is_cut_and_refused(name, mesh_key, args, inputs, pieces):
    result = _run(mesh_key, FWD, args)
    assert result.input_specs == inputs           # the table is asked for sliced like x ...
    assert result.output_specs == [inputs[0]]
    assert result.refused.startswith(f"hypershard: {OP_NAME}: ")   # ... and strict mode raises this
    for piece in pieces + ["every rank would hold the whole table",
                           "; allowed: the table sharded like x on that dim, or of size 1 there (broadcast)"]:
        assert piece in result.refused, (piece, result.refused)


# --- errors ------------------------------------------------------------------------------------

ALLOWED = ("; allowed: x, cos and sin Replicate or Shard on dims other than the last (D); cos/sin sharded like x "
           "on the dims they share with it, whole on their size-1 (broadcast) dims")

D_SHARDED_TP = "the last dim (D) is sharded on mesh axis 'tp'; the rotation pairs positions across D" + ALLOWED

# (id, mesh, op, args, text pieces; the first is the start of the message after "hypershard: ")
ERRORS = [
    ("d_sharded_on_x", "tp4", FWD, fwd(T(BNSD, S(3)), T(BNSD_TABLE, S(None))),
     [f"{OP_NAME}: argument x (#0) [4, 4, 6, 8]", "the last dim (D) is sharded on mesh axis 'tp'; the rotation "
      "pairs positions across D" + ALLOWED]),
    ("d_sharded_on_cos", "tp4", FWD, fwd(T(BNSD, S(1)), T(BNSD, S(3)), T(BNSD, S(1))),
     [f"{OP_NAME}: argument cos (#1) [4, 4, 6, 8]", D_SHARDED_TP]),
    ("d_sharded_on_sin", "dp2tp2", FWD, fwd(T(BNSD, S(0, None)), T(BNSD_TABLE, S(None, None)),
                                            T(BNSD_TABLE, S(None, 3))),
     [f"{OP_NAME}: argument sin (#2) [1, 1, 6, 8]", D_SHARDED_TP]),
    ("cos_on_other_axis", "dp2tp2", FWD, fwd(T(BNSD, S(0, 1)), T(BNSD, S(1, 0)), T(BNSD, S(0, 1))),
     [f"{OP_NAME}: argument cos (#1)", "dim 0 is sharded on mesh axis 'tp' but x's dim 0 on mesh axis 'dp'"
      + ALLOWED]),
    ("sin_on_dim_x_keeps_whole", "tp4", FWD, fwd(T(BNSD, S(0)), T(BNSD, S(0)), T(BNSD, S(1))),
     [f"{OP_NAME}: argument sin (#2)", "dim 1 is sharded on mesh axis 'tp' but x's dim 1 on no mesh axis"]),
    ("cos_seq_on_other_axis_3d_mesh", "dp2tp2sp2", FWD,
     fwd(T(BNSD, S(0, 1, 2)), T(BNSD_TABLE, S(None, 2, None)), T(BNSD_TABLE, S(None, None, 2))),
     [f"{OP_NAME}: argument cos (#1)", "dim 2 is sharded on mesh axis 'tp' but x's dim 2 on mesh axis 'sp'"]),
    ("cos_broadcast_dim_sharded", "dp2", FWD, fwd(T(BNSD, S(0)), T(BNSD_TABLE, S(0)), T(BNSD_TABLE, S(None))),
     [f"{OP_NAME}: argument cos (#1) [1, 1, 6, 8]", "its size-1 (broadcast) dim 0 is sharded on mesh axis 'dp'"
      + ALLOWED]),
    ("sin_broadcast_dim_sharded_bsnd", "dp2tp2", FWD,
     fwd(T(BSND, S(0, 2)), T(BSND_TABLE, S(None, None)), T(BSND_TABLE, S(None, 2))),
     [f"{OP_NAME}: argument sin (#2) [1, 6, 1, 8]", "its size-1 (broadcast) dim 2 is sharded on mesh axis 'tp'"]),
    ("partial_x", "tp4", FWD, fwd(T(BNSD, S("P")), T(BNSD_TABLE, S(None))),
     [f"{OP_NAME}: argument x (#0) [4, 4, 6, 8]", "Partial(sum) input: the rotation is not linear in x and "
      "cos/sin together" + ALLOWED + " (redistribute the Partial input first)"]),
    ("partial_cos", "dp2tp2", FWD, fwd(T(BNSD, S(0, None)), T(BNSD_TABLE, S(None, "P")), T(BNSD_TABLE, S(None, None))),
     [f"{OP_NAME}: argument cos (#1) [1, 1, 6, 8]", "Partial(sum) input"]),
    ("partial_sin", "tp4", FWD, fwd(T(BNSD, S(None)), T(BNSD, S(None)), T(BNSD, S("P"))),
     [f"{OP_NAME}: argument sin (#2) [4, 4, 6, 8]", "Partial(sum) input"]),
    ("cos_wrong_rank", "dp2", FWD, fwd(T(BNSD, S(0)), T([6, 8], S(None)), T(BNSD_TABLE, S(None))),
     [f"{OP_NAME}: argument cos (#1) [6, 8]", "shape [6, 8] does not broadcast to x [4, 4, 6, 8]; allowed: the rank "
      "of x, each dim equal to x's or 1, the last dim D"]),
    ("cos_dim_neither_x_nor_one", "dp2", FWD, fwd(T(BNSD, S(0)), T([2, 1, 6, 8], S(None)), T(BNSD_TABLE, S(None))),
     [f"{OP_NAME}: argument cos (#1) [2, 1, 6, 8]", "shape [2, 1, 6, 8] does not broadcast to x [4, 4, 6, 8]"]),
    ("sin_broadcast_on_d", "tp4", FWD, fwd(T(BNSD, S(1)), T(BNSD_TABLE, S(None)), T([1, 1, 6, 1], S(None))),
     [f"{OP_NAME}: argument sin (#2) [1, 1, 6, 1]", "does not broadcast to x [4, 4, 6, 8]"]),
    ("mode_4", "dp2", FWD, fwd(T(BNSD, S(0)), T(BNSD_TABLE, S(None)), mode=4),
     [f"{OP_NAME}: mode 4 is out of range; allowed: 0 (half), 1 (interleave), 2 (quarter), 3 (interleave-half)"]),
    ("mode_minus_1", "dp2", FWD, fwd(T(BNSD, S(0)), T(BNSD_TABLE, S(None)), mode=-1),
     [f"{OP_NAME}: mode -1 is out of range; allowed: 0 (half)"]),
    ("odd_d", "tp4", FWD, fwd(T([4, 4, 6, 7], S(1)), T([1, 1, 6, 7], S(None))),
     [f"{OP_NAME}: argument x (#0) [4, 4, 6, 7]", "the last dim D = 7 is not divisible by 2; allowed: an even D"]),
    ("d6_quarter_mode", "tp4", FWD, fwd(T([4, 4, 6, 6], S(1)), T([1, 1, 6, 6], S(None)), mode=2),
     [f"{OP_NAME}: argument x (#0) [4, 4, 6, 6]", "the last dim D = 6 is not divisible by 4; allowed: D divisible "
      "by 4 in mode 2 (quarter)"]),
    # the backward checks as the forward does (its x is argument #1)
    ("backward_partial_x", "tp4", BWD, bwd(T(BNSD, S("P")), T(BNSD_TABLE, S(None)), grad=T(BNSD, S(None))),
     [f"{BWD_NAME}: argument x (#1) [4, 4, 6, 8]", "Partial(sum) input"]),
    ("backward_d_sharded_on_x", "tp4", BWD, bwd(T(BNSD, S(3)), T(BNSD_TABLE, S(None))),
     [f"{BWD_NAME}: argument x (#1)", "the last dim (D) is sharded on mesh axis 'tp'"]),
    ("backward_broadcast_dim_sharded", "dp2", BWD, bwd(T(BNSD, S(0)), T(BNSD_TABLE, S(0))),
     [f"{BWD_NAME}: argument cos (#2) [1, 1, 6, 8]", "its size-1 (broadcast) dim 0 is sharded on mesh axis 'dp'"]),
    ("backward_grad_shape", "dp2", BWD, bwd(T(BNSD, S(0)), T(BNSD_TABLE, S(None)), grad=T([4, 4, 5, 8], S(0))),
     [f"{BWD_NAME}: argument grad (#0) [4, 4, 5, 8]", "shape differs from x [4, 4, 6, 8]; allowed: grad shaped "
      "like x"]),
    ("backward_mode_5", "dp2", BWD, bwd(T(BNSD, S(0)), T(BNSD_TABLE, S(None)), mode=5),
     [f"{BWD_NAME}: mode 5 is out of range"]),
    ("backward_d6_quarter_mode", "dp2", BWD, bwd(T([4, 4, 6, 6], S(0)), T([1, 1, 6, 6], S(None)), mode=2),
     [f"{BWD_NAME}: argument x (#1) [4, 4, 6, 6]", "the last dim D = 6 is not divisible by 4"]),
]


@pytest.mark.parametrize("name,mesh_key,op,args,pieces", [pytest.param(*r, id=r[0]) for r in ERRORS])
def test_rule_errors(name, mesh_key, op, args, pieces):
    with pytest.raises((hs.LayoutError, RuntimeError)) as raised:
        _run(mesh_key, op, args)
    check_error_pieces(str(raised.value), pieces)


def test_enough_rows():
    cases = len(FORWARD_ROWS) + len(BACKWARD_ROWS) + len(REFUSALS) + len(ERRORS)
    assert cases >= 26 and len(ERRORS) >= 16


# --- torch_npu's names: one rule ---------------------------------------------------------------

NPU_SCHEMAS = {
    "npu_rotary_mul": "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor",
    "npu_rotary_mul_backward": "npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, "
                               "str rotary_mode='half') -> (Tensor, Tensor, Tensor)",
    "npu_rotary_position_embedding": "npu_rotary_position_embedding(Tensor x, Tensor cos, Tensor sin, "
                                     "int mode=0) -> Tensor",
    "npu_rotary_position_embedding_backward": "npu_rotary_position_embedding_backward(Tensor grad, Tensor cos, "
                                              "Tensor sin, Tensor x, int mode=0) -> (Tensor, Tensor, Tensor)",
}
@pytest.fixture(scope="module")
def npu():
    """torch.ops.npu with torch_npu's rotary schemas (stand-ins without kernels where torch_npu is absent)."""
    return define_npu_standins(NPU_SCHEMAS)


NPU_ROWS = ["batch_on_dp_broadcast", "heads_on_tp_full", "dp_tp_batch_table", "dp_tp_sp_seq_table", "bsnd_dp_sp",
            "sbnd_dp_sp", "uneven_batch_seq", "cos_full_sin_broadcast"]


def _forward_row(name):
    return next(r for r in FORWARD_ROWS if r[0] == name)


@pytest.mark.parametrize("name", NPU_ROWS)
def test_npu_ops_plan_like_the_hypershard_op(npu, name):
    _, mesh_key, (x, cos, sin, _), _, _ = _forward_row(name)
    grad = T(x.shape, x.spec)
    for rotary_mode, mode in (("half", 0), ("interleave", 1)):
        want = _run(mesh_key, FWD, (x, cos, sin, mode))
        got = _run(mesh_key, npu.npu_rotary_mul.default, (x, cos, sin, rotary_mode))
        assert (got.input_specs, got.output_specs, got.refused) == (want.input_specs, want.output_specs, "")
        want = _run(mesh_key, BWD, (grad, x, cos, sin, mode, ALL))
        got = _run(mesh_key, npu.npu_rotary_mul_backward.default, (grad, x, cos, sin, rotary_mode))
        assert (got.input_specs, got.output_specs) == (want.input_specs, want.output_specs)
    for mode in range(4):
        want = _run(mesh_key, FWD, (x, cos, sin, mode))
        got = _run(mesh_key, npu.npu_rotary_position_embedding.default, (x, cos, sin, mode))
        assert (got.input_specs, got.output_specs, got.refused) == (want.input_specs, want.output_specs, "")
        # npu's backward orders its inputs (grad, cos, sin, x); its outputs are (dx, dcos, dsin)
        want = _run(mesh_key, BWD, (grad, x, cos, sin, mode, ALL))
        got = _run(mesh_key, npu.npu_rotary_position_embedding_backward.default, (grad, cos, sin, x, mode))
        g, x_spec, c, s = want.input_specs
        assert got.input_specs == [g, c, s, x_spec]
        assert got.output_specs == want.output_specs


def test_npu_refusal_and_errors(npu):
    # the full-size replicated table is refused under npu's names too, naming npu's argument
    refused = _run("dp2", npu.npu_rotary_mul.default, (T(BNSD, S(0)), T(BNSD, S(None)), T(BNSD_TABLE, S(None))))
    assert refused.input_specs == [S(0), S(0), S(None)]
    assert refused.refused.startswith("hypershard: npu::npu_rotary_mul: argument r1 (#1) [4, 4, 6, 8]")
    assert "full-size dim 0 is whole where x is sharded on mesh axis 'dp'" in refused.refused
    cases = [
        (npu.npu_rotary_mul.default, (T(BNSD, S(0)), T(BNSD_TABLE, S(None)), T(BNSD_TABLE, S(None)), "quarter"),
         "hypershard: npu::npu_rotary_mul: rotary_mode 'quarter' is not supported; allowed: 'half', 'interleave'"),
        (npu.npu_rotary_mul.default, (T(BNSD, S(3)), T(BNSD_TABLE, S(None)), T(BNSD_TABLE, S(None))),
         "hypershard: npu::npu_rotary_mul: argument self (#0) [4, 4, 6, 8]"),
        (npu.npu_rotary_mul_backward.default,
         (T(BNSD, S(0)), T(BNSD, S(0)), T(BNSD_TABLE, S(None)), T(BNSD_TABLE, S(0))),
         "hypershard: npu::npu_rotary_mul_backward: argument r2 (#3) [1, 1, 6, 8]"),
        (npu.npu_rotary_position_embedding.default, (T(BNSD, S(0)), T(BNSD_TABLE, S(None)), T(BNSD_TABLE, S(None)), 4),
         "hypershard: npu::npu_rotary_position_embedding: mode 4 is out of range"),
        (npu.npu_rotary_position_embedding.default,
         (T([4, 4, 6, 6], S(0)), T([1, 1, 6, 6], S(None)), T([1, 1, 6, 6], S(None)), 2),
         "hypershard: npu::npu_rotary_position_embedding: argument x (#0) [4, 4, 6, 6]"),
        (npu.npu_rotary_position_embedding_backward.default,
         (T(BNSD, S(0)), T(BNSD_TABLE, S(None)), T(BNSD_TABLE, S(None)), T(BNSD, S("P")), 0),
         "hypershard: npu::npu_rotary_position_embedding_backward: argument x (#3) [4, 4, 6, 8]"),
    ]
    for op, args, start in cases:
        with pytest.raises((hs.LayoutError, RuntimeError)) as raised:
            _run("dp2", op, args)
        assert str(raised.value).startswith(start), (start, str(raised.value))
