"""Level0: the fused rotary position embedding (csrc/kernels/rotary.cpp, its rule csrc/ops/rotary.cpp)
on real CPU meshes of 2, 4 and 8 ranks against one device: forward, and the gradients of x, cos
and sin (all three want grad), in each of the four modes (0 half, 1 interleave, 2 quarter,
3 interleave-half), in strict mode.

The eight scenarios; x is BNSD (B, N, S, D) unless a case name says bsnd / sbnd, D = 8 (never
sharded), and every sharded dim is uneven over its split (B = 3, N = 5 or 3, S = 7 over 2 or 4;
B = 9, N = 11, S = 13 over 8, where some ranks hold empty shards):
  s1 all Replicate, cos/sin (1, 1, S, D) and full size       1-D "dp" of 2, 4, 8
  s2 B on dp: x S(0), cos/sin (1, 1, S, D) Replicate          1-D "dp" of 2, 4, 8
  s3 N on tp: x, cos, sin S(1); cos/sin (B, N, S, D) and (1, N, S, D)    1-D "tp" of 2, 4, 8
  s4 dp x tp: x, cos, sin (S(0), S(1)), full size             (2, 2), (2, 4)
  s5 dp x sp: x (S(0), S(2)), cos/sin (1, 1, S, D) (R, S(2))  (2, 2), (4, 2)
  s6 tp x sp: x, cos, sin (S(1), S(2)), cos/sin (1, N, S, D) and full size    (2, 2), (2, 4)
  s7 dp x tp: x (S(0), S(1)), cos/sin (1, 1, S, D) Replicate  (2, 2), (2, 4)
  s8 dp x tp x sp: x (S(0), S(1), S(2)), cos/sin (1, 1, S, D) (R, R, S(2))    (2, 2, 2)
Values and gradients that involve no sum over split rows are bit-identical to one device and
are compared with rtol = atol = 0 (see scenario_cases); dcos / dsin summed over broadcast dims
use float32's default tolerance (or, in bf16, the bound argued at "bf16 tolerance").
Besides the eight:
- layout variants: SBND (x (S, B, N, D), cos (S, 1, 1, D)) with B on dp (s2) and S on sp (s5,
  s8), BSND (x (B, S, N, D), cos (1, S, 1, D)) with S on sp (s5, s6, s8) and N on tp (s3, s6),
  and BSND / SBND with S on a 1-D "sp";
- bfloat16: full-size tables (everything bit-identical) and broadcast tables on 2, 4 and 8
  ranks (y and dx bit-identical, dcos / dsin within an argued bound);
- the composed form (cat / neg / mul / stack) beside the fused op in one call (s2, s3, s5, s7,
  s8): the same values as one device, and in the distributed run the same output placements
  (x's) and the same local values as the fused op;
- the backward op alone: dx laid out like x, dcos / dsin Partial(sum) on the mesh axes that
  shard x where the table broadcasts (like the table elsewhere), values as on one device;
- strict-mode errors, the same clear text on every rank (D sharded, a table sharded on a mesh
  axis x does not use there or on a broadcast dim, Partial x or tables, a full-size table whole
  where x is sharded: "full-size dim", a bad mode); each has a twin in which rank 0 alone makes
  the call and must still get the error, so it comes before any collective;
- default mode (one 4-rank launch): the full-size table whole where x is sharded on S is cut
  locally (counted in dispatch_stats()["implicit_calls"]) and gives the one-device values and
  gradients; a Partial x is reduced first and gives the right values;
- torch_npu's npu::npu_rotary_mul through stand-in ops of torch_npu's schemas
  (hypershard.testing.fused; defined in each rank process on first use), sharded in strict mode,
  modes half and interleave: forward and the gradients of self, r1 and r2 against the composed
  form with torch's autograd on one device (see "torch_npu's op"); the rule registered under the
  npu name refuses what it refuses for the fused op; a planted wrong backward kernel is caught.

Cases per launch: 2 ranks 124, 4 ranks 153, 8 ranks 178 (strict mode); 4 ranks 20 (default mode).
"""

import dataclasses

import torch

import hypershard as hs
from hypershard import ops
from hypershard.testing import (
    Case,
    DefaultModeAdapter,
    Input,
    assert_all_passed,
    counting,
    current_rank,
    in_distributed_run,
    run_cases,
)
from hypershard.testing.spec import make_cotangent, uniform

MODES = (0, 1, 2, 3)
B, N, S, D = 3, 5, 7, 8


def mesh1(size, name):
    return ((size,), (name,))


def rope(mode):
    def run(x, cos, sin):
        return ops.rotary_position_embedding(x, cos, sin, mode)
    return run


def fused_and_composed(mode):
    """Both forms on the same inputs: the harness compares both (and the gradients through both)
    with one device; the distributed run also checks that they come out in the same layout with
    the same local values."""
    def run(x, cos, sin):
        fused = ops.rotary_position_embedding(x, cos, sin, mode)
        composed = ops.rotary_position_embedding_composed(x, cos, sin, mode)
        if in_distributed_run():
            assert fused.placements == composed.placements, (fused.placements, composed.placements)
            assert fused.placements == x.placements, (fused.placements, x.placements)
            torch.testing.assert_close(fused.to_local(), composed.to_local(), rtol=0, atol=0)
        else:
            torch.testing.assert_close(fused, composed, rtol=0, atol=0)
        return fused, composed
    return run


def laid_out_like_x(mode):
    """The fused op, asserting in the distributed run that y is laid out like x."""
    def run(x, cos, sin):
        y = ops.rotary_position_embedding(x, cos, sin, mode)
        if in_distributed_run():
            assert y.placements == x.placements, (y.placements, x.placements)
        return y
    return run


def backward_op(mode):
    """The backward op called directly (grad, x, cos, sin want no gradient): dx, dcos, dsin are
    compared with one device (the harness gathers, reducing Partials); the distributed run checks
    the rule's layouts: dx like x, dcos/dsin Partial(sum) on every mesh axis that shards x on a
    dim where the table broadcasts, like the table on the other axes."""
    def run(g, x, cos, sin):
        dx, dcos, dsin = torch.ops.hypershard.rotary_position_embedding_backward(g, x, cos, sin, mode,
                                                                                [True, True, True])
        if in_distributed_run():
            assert dx.placements == x.placements, (dx.placements, x.placements)
            for table, grad in ((cos, dcos), (sin, dsin)):
                want = tuple(hs.Partial("sum") if p.is_shard() and table.shape[p.dim] == 1 < x.shape[p.dim] else q
                             for p, q in zip(x.placements, table.placements))
                assert grad.placements == want, (grad.placements, want)
        return dx, dcos, dsin
    return run


def inputs(x_shape, x_place, t_shape, t_place, dtype=torch.float32, seed=None, table_grad=True):
    """x, cos, sin (cos and sin the same shape and placements)."""
    def item(shape, place, offset, grad):
        return Input(shape, dtype, placements=place, seed=None if seed is None else seed + offset,
                     init=uniform(-1.0, 1.0), requires_grad=grad)
    return [item(x_shape, x_place, 0, True), item(t_shape, t_place, 1, table_grad),
            item(t_shape, t_place, 2, table_grad)]


def sums_tables(x_shape, t_shape):
    """True when dcos/dsin are sums over broadcast rows (the table has a size-1 dim where x has
    more). Those sums run through at::sum (sum_to_size) in the kernel, whose order depends on the
    local shape: they may differ in the last float32 bits from one device even where no rank
    splits the summed rows (e.g. BSND with S sharded: a rank holding one position sums a
    (B, 1, N, D) block in another order than the (B, S, N, D) one)."""
    return any(t == 1 < x for t, x in zip(t_shape, x_shape))


# --------------------------------------------------------------------------- bf16 tolerance
#
# The distributed and the one-device runs execute the same kernel on each row of D elements
# (every product and sum in float32, one rounding to bf16 at the end), so y and dx -- and dcos /
# dsin of a full-size table, one product per element -- are bit-identical: those cases use
# rtol = atol = 0.
#
# Only dcos / dsin of a table broadcast over dims that x shards are summed in another order. One
# device: a float32 sum over all R broadcast rows, rounded once to bf16. Distributed: each of the
# k ranks of the Partial group sums its own rows in float32 and rounds to bf16, then the k bf16
# partials are added by the gather's all-reduce (k - 1 additions, in whatever order or tree,
# each rounded at most once). With u = 2^-8 (bf16's unit roundoff) and P_j the exact partial
# sums of an element, every one of those roundings errs by at most u times a magnitude
# <= sum_j |P_j| (1 + u), so
#     |distributed - exact| <= k u (1 + u) sum_j |P_j|,   |one device - exact| <= u |sum_j P_j|,
# plus float32's accumulation error in each run, in whatever order at::sum adds (it depends on
# the local shape), at most R 2^-24 sum_rows |g x| (tiny next to u).
# The case's atol is therefore
#     (k + 1) u (1 + 2u) max_elem sum_j |P_j|  +  2 R 2^-24 max_elem sum_rows |g x|,   rtol 0,
# with P_j computed in float64 by the same kernel from the case's own seeded x and cotangent,
# split into the rows each rank of the Partial group holds (even splits here). y and dx are
# covered by it too; a twin case whose tables want no gradient checks them bit-exactly.

U_BF16 = 2.0 ** -8


def bf16_atol(x_shape, mode, x_seed, cot_seed, parts):
    """The bound above for a BNSD x of `x_shape` (bf16, uniform(-1, 1) from x_seed), the cotangent
    of output 0 from cot_seed and a (1, 1, S, D) table; `parts`: per rank of the Partial group,
    the (B slice, N slice) of the rows it sums."""
    x = Input(x_shape, torch.bfloat16, init=uniform(-1.0, 1.0)).make(x_seed).double()
    g = make_cotangent(cot_seed, 0, x_shape, torch.bfloat16).double()
    table = torch.zeros((1, 1) + tuple(x_shape[2:]), dtype=torch.float64)  # dcos/dsin do not read it

    def dtables(g, x):
        return torch.ops.hypershard.rotary_position_embedding_backward(g, x, table, table, mode,
                                                                      [False, True, True])[1:]

    partials = [dtables(g[b, n], x[b, n]) for b, n in parts]
    spread = max(sum(p[i].abs() for p in partials).max().item() for i in (0, 1))
    rows_abs = max(t.abs().max().item() for t in dtables(g.abs(), x.abs()))
    rows, k = x_shape[0] * x_shape[1], len(parts)
    return (k + 1) * U_BF16 * (1 + 2 * U_BF16) * spread + 2 * rows * 2.0 ** -24 * rows_abs


# --------------------------------------------------------------------------- the scenarios

def scenario_cases(world):
    """Scenarios 1-8, their layout variants, the composed form and the backward op alone, for the
    meshes of `world` ranks."""
    cases = []

    def add(tag, mesh, x_shape, x_place, t_shape, t_place, fn=laid_out_like_x):
        # Every row is computed by the same kernel code as on one device: y, dx and the dcos/dsin
        # of a full-size table must be bit-identical (rtol = atol = 0). Where dcos/dsin are sums
        # (sums_tables), float32's default tolerance, and a twin whose tables want no gradient
        # checks y and dx bit-exactly.
        exact = {"rtol": 0.0, "atol": 0.0}
        summed = sums_tables(x_shape, t_shape)
        for mode in MODES:
            cases.append(Case(f"{tag}_mode{mode}", fn(mode), inputs(x_shape, x_place, t_shape, t_place), mesh,
                              **({} if summed else exact)))
            if summed and fn is laid_out_like_x:
                cases.append(Case(f"{tag}_mode{mode}_y_dx_exact", fn(mode),
                                  inputs(x_shape, x_place, t_shape, t_place, table_grad=False), mesh, **exact))

    def composed(tag, mesh, x_shape, x_place, t_shape, t_place):
        add(f"composed_{tag}", mesh, x_shape, x_place, t_shape, t_place, fused_and_composed)

    def backward(tag, mesh, x_shape, x_place, t_shape, t_place):
        for mode in MODES:
            cases.append(Case(f"backward_op_{tag}_mode{mode}", backward_op(mode),
                              [Input(x_shape, placements=x_place, requires_grad=False)]
                              + [dataclasses.replace(item, requires_grad=False)
                                 for item in inputs(x_shape, x_place, t_shape, t_place)], mesh))

    w = world
    # 1-D meshes, every world size. The split dim is uneven: B = 3, N = 5, S = 7 over 2 or 4;
    # B = 9, N = 11, S = 13 over 8 (where some ranks hold empty shards).
    b1, n1, s1 = (B, N, S) if w < 8 else (9, 11, 13)
    add(f"s1_replicate_{w}", mesh1(w, "dp"), (B, N, S, D), ["R"], (1, 1, S, D), ["R"])
    add(f"s1_replicate_fullsize_{w}", mesh1(w, "dp"), (B, N, S, D), ["R"], (B, N, S, D), ["R"])
    add(f"s2_batch_dp_{w}", mesh1(w, "dp"), (b1, N, S, D), ["S(0)"], (1, 1, S, D), ["R"])
    add(f"s3_heads_tp_fullsize_{w}", mesh1(w, "tp"), (B, n1, S, D), ["S(1)"], (B, n1, S, D), ["S(1)"])
    add(f"s3_heads_tp_1nsd_{w}", mesh1(w, "tp"), (B, n1, S, D), ["S(1)"], (1, n1, S, D), ["S(1)"])
    # layout variants: SBND with B on dp, BSND with N on tp; S on a 1-D "sp" in BSND and SBND
    add(f"s2_sbnd_batch_dp_{w}", mesh1(w, "dp"), (S, b1, N, D), ["S(1)"], (S, 1, 1, D), ["R"])
    add(f"s3_bsnd_heads_tp_{w}", mesh1(w, "tp"), (B, S, n1, D), ["S(2)"], (1, S, n1, D), ["S(2)"])
    add(f"sp_bsnd_seq_{w}", mesh1(w, "sp"), (B, s1, N, D), ["S(1)"], (1, s1, 1, D), ["S(1)"])
    add(f"sp_sbnd_seq_{w}", mesh1(w, "sp"), (s1, B, N, D), ["S(0)"], (s1, 1, 1, D), ["S(0)"])
    backward(f"s2_batch_dp_{w}", mesh1(w, "dp"), (b1, N, S, D), ["S(0)"], (1, 1, S, D), ["R"])
    backward(f"s3_heads_tp_1nsd_{w}", mesh1(w, "tp"), (B, n1, S, D), ["S(1)"], (1, n1, S, D), ["S(1)"])
    if w == 2:
        composed("s2_batch_dp_2", mesh1(2, "dp"), (B, N, S, D), ["S(0)"], (1, 1, S, D), ["R"])
        composed("s3_heads_tp_2", mesh1(2, "tp"), (B, N, S, D), ["S(1)"], (1, N, S, D), ["S(1)"])
    # 2-D meshes: (2, 2) on 4 ranks; (2, 4) and (4, 2) on 8. Uneven: B = 3 or 5 (over 2 or 4),
    # N = 3 or 5 (over 2 or 4 on dp x tp, over 2 on tp x sp), S = 7 (over 2 or 4).
    if w in (4, 8):
        dptp = ((2, w // 2), ("dp", "tp"))
        dpsp = ((w // 2, 2), ("dp", "sp"))
        tpsp = ((2, w // 2), ("tp", "sp"))
        b2, n2 = (B, 3) if w == 4 else (5, 5)
        ss = ["S(0)", "S(1)"]
        add(f"s4_dp_tp_fullsize_{w}", dptp, (B, n2, S, D), ss, (B, n2, S, D), ss)
        add(f"s5_dp_sp_{w}", dpsp, (b2, N, S, D), ["S(0)", "S(2)"], (1, 1, S, D), ["R", "S(2)"])
        add(f"s6_tp_sp_{w}", tpsp, (B, n2, S, D), ["S(1)", "S(2)"], (1, n2, S, D), ["S(1)", "S(2)"])
        add(f"s6_tp_sp_fullsize_{w}", tpsp, (B, n2, S, D), ["S(1)", "S(2)"], (B, n2, S, D), ["S(1)", "S(2)"])
        add(f"s7_dp_tp_broadcast_{w}", dptp, (B, n2, S, D), ss, (1, 1, S, D), ["R", "R"])
        # layout variants: BSND and SBND on dp x sp, BSND on tp x sp
        add(f"s5_bsnd_dp_sp_{w}", dpsp, (b2, S, N, D), ["S(0)", "S(1)"], (1, S, 1, D), ["R", "S(1)"])
        add(f"s5_sbnd_dp_sp_{w}", dpsp, (S, b2, N, D), ["S(1)", "S(0)"], (S, 1, 1, D), ["R", "S(0)"])
        add(f"s6_bsnd_tp_sp_{w}", tpsp, (B, S, n2, D), ["S(2)", "S(1)"], (1, S, n2, D), ["S(2)", "S(1)"])
        composed(f"s5_dp_sp_{w}", dpsp, (b2, N, S, D), ["S(0)", "S(2)"], (1, 1, S, D), ["R", "S(2)"])
        composed(f"s7_dp_tp_broadcast_{w}", dptp, (B, n2, S, D), ss, (1, 1, S, D), ["R", "R"])
        backward(f"s5_dp_sp_{w}", dpsp, (b2, N, S, D), ["S(0)", "S(2)"], (1, 1, S, D), ["R", "S(2)"])
        backward(f"s7_dp_tp_broadcast_{w}", dptp, (B, n2, S, D), ss, (1, 1, S, D), ["R", "R"])
    # 3-D mesh (2, 2, 2), scenario 8: B = 3, N = 5, S = 7 each over 2
    if w == 8:
        m3 = ((2, 2, 2), ("dp", "tp", "sp"))
        x3, t3 = ["S(0)", "S(1)", "S(2)"], ["R", "R", "S(2)"]
        add("s8_dp_tp_sp_8", m3, (B, N, S, D), x3, (1, 1, S, D), t3)
        add("s8_bsnd_dp_tp_sp_8", m3, (B, S, N, D), ["S(0)", "S(2)", "S(1)"], (1, S, 1, D), ["R", "R", "S(1)"])
        add("s8_sbnd_dp_tp_sp_8", m3, (S, B, N, D), ["S(1)", "S(2)", "S(0)"], (S, 1, 1, D), ["R", "R", "S(0)"])
        composed("s8_dp_tp_sp_8", m3, (B, N, S, D), x3, (1, 1, S, D), t3)
        backward("s8_dp_tp_sp_8", m3, (B, N, S, D), x3, (1, 1, S, D), t3)
    return cases


def bf16_cases(world):
    """bfloat16: full-size tables bit-exact; broadcast tables within bf16_atol's bound."""
    cases = []
    h = slice(None)

    def exact(name, mesh, x_shape, x_place, t_shape, t_place, mode):
        cases.append(Case(name, laid_out_like_x(mode), inputs(x_shape, x_place, t_shape, t_place, torch.bfloat16),
                          mesh, rtol=0.0, atol=0.0))

    def summed(name, mesh, x_shape, x_place, t_place, mode, parts):
        seed = 1000 + 10 * len(cases)
        t_shape = (1, 1) + x_shape[2:]
        atol = bf16_atol(x_shape, mode, seed, seed + 9, parts)
        cases.append(Case(name, laid_out_like_x(mode), inputs(x_shape, x_place, t_shape, t_place, torch.bfloat16, seed),
                          mesh, rtol=0.0, atol=atol, seed=seed + 9))
        # the same values with tables that want no gradient: y and dx alone, bit-identical
        cases.append(Case(name + "_y_dx_exact", laid_out_like_x(mode),
                          inputs(x_shape, x_place, t_shape, t_place, torch.bfloat16, seed, table_grad=False),
                          mesh, rtol=0.0, atol=0.0, seed=seed + 9))

    if world == 2:
        # B = 16 over 2 ranks, N = 8: dcos sums 128 rows per element, 64 on each rank
        halves = [(slice(0, 8), h), (slice(8, 16), h)]
        for mode in MODES:
            summed(f"bf16_s2_batch_dp_2_mode{mode}", mesh1(2, "dp"), (16, 8, S, D), ["S(0)"], ["R"], mode, halves)
        exact("bf16_s3_heads_tp_fullsize_2_mode1", mesh1(2, "tp"), (B, N, S, D), ["S(1)"], (B, N, S, D), ["S(1)"], 1)
    if world == 4:
        # dp x sp (2, 2): B = 6 over dp (3 + 3), S over sp; dcos Partial over dp
        summed("bf16_s5_dp_sp_4_mode2", ((2, 2), ("dp", "sp")), (6, 8, S, D), ["S(0)", "S(2)"], ["R", "S(2)"], 2,
               [(slice(0, 3), h), (slice(3, 6), h)])
        exact("bf16_s4_dp_tp_fullsize_4_mode0", ((2, 2), ("dp", "tp")), (B, 3, S, D), ["S(0)", "S(1)"],
              (B, 3, S, D), ["S(0)", "S(1)"], 0)
    if world == 8:
        # (2, 2, 2): B = 6 over dp, N = 8 over tp, S over sp; dcos Partial over dp and tp (4 parts)
        quarters = [(b, n) for b in (slice(0, 3), slice(3, 6)) for n in (slice(0, 4), slice(4, 8))]
        summed("bf16_s8_dp_tp_sp_8_mode3", ((2, 2, 2), ("dp", "tp", "sp")), (6, 8, S, D), ["S(0)", "S(1)", "S(2)"],
               ["R", "R", "S(2)"], 3, quarters)
    return cases


# --------------------------------------------------------------------------- strict-mode errors

def alone_on_rank0(mode, text):
    """The refused call made by rank 0 alone (the other ranks skip it): it must raise `text`.
    Had the rule or the dispatch started a collective first, rank 0 would wait for peers that
    never come and fail with a timeout instead -- so the error comes before any communication."""
    def run(x, cos, sin):
        if in_distributed_run() and current_rank() == 0:
            try:
                ops.rotary_position_embedding(x, cos, sin, mode)
            except RuntimeError as exc:
                assert text in str(exc), str(exc)
            else:
                raise AssertionError(f"no error raised; expected one containing {text!r}")
        return torch.zeros(1)
    return run


def error_cases(world):
    """Strict mode: every rank raises the rule's error (the harness checks the text on each rank
    and that the process group still works afterwards); the *_rank0_alone twins show that the
    error comes before any collective."""
    cases = []

    def add(name, mesh, x_place, t_shape, t_place, text, mode=0, x_shape=(B, N, S, D)):
        cases.append(Case(name, rope(mode), inputs(x_shape, x_place, t_shape, t_place), mesh, expect_error=text))
        cases.append(Case(name + "_rank0_alone", alone_on_rank0(mode, text), inputs(x_shape, x_place, t_shape, t_place),
                          mesh, check_grad=False))

    allowed = "allowed: x, cos and sin Replicate or Shard on dims other than the last (D)"
    if world == 2:
        m = mesh1(2, "dp")
        for mode in MODES:
            add(f"error_d_sharded_mode{mode}", m, ["S(3)"], (1, 1, S, D), ["R"],
                "argument x (#0) [3, 5, 7, 8] (\"None\", \"None\", \"None\", \"dp\"): the last dim (D) is sharded "
                "on mesh axis 'dp'; the rotation pairs positions across D; " + allowed, mode)
        add("error_table_d_sharded", m, ["S(0)"], (1, 1, S, D), ["S(3)"],
            "argument cos (#1) [1, 1, 7, 8] (\"None\", \"None\", \"None\", \"dp\"): the last dim (D) is sharded")
        add("error_table_sharded_where_x_whole", m, ["R"], (1, 1, S, D), ["S(2)"],
            "argument cos (#1) [1, 1, 7, 8] (\"None\", \"None\", \"dp\", \"None\"): dim 2 is sharded on mesh axis "
            "'dp' but x's dim 2 on no mesh axis")
        add("error_broadcast_dim_sharded", m, ["S(0)"], (1, 1, S, D), ["S(0)"],
            "argument cos (#1) [1, 1, 7, 8] (\"dp\", \"None\", \"None\", \"None\"): its size-1 (broadcast) dim 0 is "
            "sharded on mesh axis 'dp'")
        add("error_partial_x", m, ["P"], (1, 1, S, D), ["R"],
            "argument x (#0) [3, 5, 7, 8] (\"None\", \"None\", \"None\", \"None\") partial(sum: dp): Partial(sum) "
            "input: the rotation is not linear in x and cos/sin together", 3)
        add("error_partial_tables", m, ["S(0)"], (1, 1, S, D), ["P"],
            "argument cos (#1) [1, 1, 7, 8] (\"None\", \"None\", \"None\", \"None\") partial(sum: dp): Partial(sum) "
            "input")
        add("error_fullsize_table_whole_seq", m, ["S(2)"], (1, 1, S, D), ["R"],
            "argument cos (#1) [1, 1, 7, 8] (\"None\", \"None\", \"None\", \"None\"): full-size dim 2 is whole where x "
            "is sharded on mesh axis 'dp'", 1)
        add("error_fullsize_table_whole_heads", m, ["S(1)"], (B, N, S, D), ["R"],
            "argument cos (#1) [3, 5, 7, 8] (\"None\", \"None\", \"None\", \"None\"): full-size dim 1 is whole where x "
            "is sharded on mesh axis 'dp'", 2)
        add("error_mode_out_of_range", m, ["S(0)"], (1, 1, S, D), ["R"],
            "mode 4 is out of range; allowed: 0 (half), 1 (interleave), 2 (quarter), 3 (interleave-half)", 4)
    if world == 4:
        m = ((2, 2), ("dp", "tp"))
        add("error_table_on_other_mesh_axis", m, ["S(2)", "R"], (1, 1, S, D), ["R", "S(2)"],
            "argument cos (#1) [1, 1, 7, 8] (\"None\", \"None\", \"tp\", \"None\"): dim 2 is sharded on mesh axis "
            "'tp' but x's dim 2 on mesh axis 'dp'")
        add("error_fullsize_table_whole_2d", m, ["S(0)", "S(1)"], (B, N, S, D), ["S(0)", "R"],
            "argument cos (#1) [3, 5, 7, 8] (\"dp\", \"None\", \"None\", \"None\"): full-size dim 1 is whole where x "
            "is sharded on mesh axis 'tp'", 3)
        add("error_d_sharded_2d", m, ["S(0)", "S(3)"], (1, 1, S, D), ["R", "R"],
            "argument x (#0) [3, 5, 7, 8] (\"dp\", \"None\", \"None\", \"tp\"): the last dim (D) is sharded on mesh "
            "axis 'tp'")
    return cases


# --------------------------------------------------------------------------- torch_npu's op
#
# npu::npu_rotary_mul through stand-ins of torch_npu's schemas (hypershard.testing.fused: CPU
# kernels of torch_npu's maths, the backward npu_rotary_mul_backward's dx = g * r1 - rotate(g * r2),
# dr1 / dr2 = g * x / g * rotate(x) summed to the tables' shapes). On a DTensor hypershard's
# autograd kernel at AutogradPrivateUse2 (csrc/kernels/external_autograd.cpp) records a backward
# that calls npu::npu_rotary_mul_backward, which the rule serves. The one-device reference is the
# composed form with torch's autograd (the true derivative), not the stand-in, so a wrong backward
# kernel or an unrecorded backward fails (test_npu_planted_wrong_backward_is_caught).
# Tolerance: y is the same float32 products and sum on each element in both runs; dx too (autograd
# through cat / neg / mul forms g * r1 and the rotated g * r2, negation and slicing exact, and adds
# them once, as the formula does): bit-equal where the tables are full size. dr1 / dr2 of a table
# broadcast over B and N are float32 sums in another order (and Partial over split rows): float32's
# default tolerance, as the fused op's summed cases (sums_tables).


def npu_ops():
    from hypershard.testing.fused import NPU_ROTARY_MUL_SCHEMAS, define_npu_kernels
    return define_npu_kernels(NPU_ROTARY_MUL_SCHEMAS)


def through_npu(rotary_mode):
    def run(x, r1, r2):
        y = npu_ops().npu_rotary_mul(x, r1, r2, rotary_mode)
        if in_distributed_run():
            assert y.placements == x.placements, (y.placements, x.placements)
            if x.requires_grad:  # recorded by hypershard's kernel, not torch_npu's
                assert "NpuRotaryMul" in y.grad_fn.name(), y.grad_fn.name()
        return y
    return run


def npu_reference(rotary_mode):
    def run(x, r1, r2):
        return ops.rotary_position_embedding_composed(x, r1, r2, ops.MODES[rotary_mode])
    return run


def npu_double_backward(x, r1, r2):
    y = through_npu("half")(x, r1, r2)
    dx, = torch.autograd.grad(y.sum(), x, create_graph=True)
    dx.sum().backward()
    return dx


def npu_case(name, rotary_mode, mesh, x_place, t_shape, t_place, dist_fn=None):
    tol = {} if sums_tables((B, N, S, D), t_shape) else {"rtol": 0.0, "atol": 0.0}
    return Case(name, npu_reference(rotary_mode), inputs((B, N, S, D), x_place, t_shape, t_place), mesh,
                dist_fn=dist_fn or through_npu(rotary_mode), **tol)


def npu_cases(world):
    if world != 2:
        return []
    cases = []
    for rotary_mode in ("half", "interleave"):
        for tag, mesh, x_place, t_shape, t_place in (
                ("batch_dp", mesh1(2, "dp"), ["S(0)"], (1, 1, S, D), ["R"]),
                ("seq_sp", mesh1(2, "sp"), ["S(2)"], (1, 1, S, D), ["S(2)"]),
                ("heads_tp", mesh1(2, "tp"), ["S(1)"], (1, N, S, D), ["S(1)"]),
                ("fullsize_tp", mesh1(2, "tp"), ["S(1)"], (B, N, S, D), ["S(1)"])):
            cases.append(npu_case(f"npu_rotary_mul_{rotary_mode}_{tag}", rotary_mode, mesh, x_place, t_shape, t_place))
    # first-order gradients with create_graph=True work; a second derivative raises
    cases.append(Case("npu_rotary_mul_double_backward_refused", npu_double_backward,
                      inputs((B, N, S, D), ["S(0)"], (1, 1, S, D), ["R"]), mesh1(2, "dp"),
                      expect_error="hypershard: npu::npu_rotary_mul_backward: a second derivative (double backward) "
                                   "is not implemented"))
    # the rule's checks under the npu name: a refused layout, a mode npu_rotary_mul does not have
    items = [Input((B, N, S, D), placements=["S(2)"], requires_grad=False),
             Input((1, 1, S, D), requires_grad=False), Input((1, 1, S, D), requires_grad=False)]
    cases.append(Case("npu_rotary_mul_fullsize_table_whole_refused", through_npu("half"), items, mesh1(2, "sp"),
                      expect_error="npu::npu_rotary_mul: argument r1 (#1) [1, 1, 7, 8] (\"None\", \"None\", \"None\", "
                                   "\"None\"): full-size dim 2 is whole where x is sharded on mesh axis 'sp'"))
    items = [Input((B, N, S, D), placements=["S(0)"], requires_grad=False),
             Input((1, 1, S, D), requires_grad=False), Input((1, 1, S, D), requires_grad=False)]
    cases.append(Case("npu_rotary_mul_unknown_mode_refused", through_npu("quarter"), items, mesh1(2, "dp"),
                      expect_error="npu::npu_rotary_mul: rotary_mode 'quarter' is not supported; allowed: 'half', "
                                   "'interleave'"))
    return cases


def _dx_rotated_the_wrong_way(grad, x, r1, r2, rotary_mode="half"):
    """A planted fault: dx = g * r1 + rotate(g * r2) (rotate taken for its own transpose)."""
    from hypershard.testing.fused import rotate
    return (grad * r1 + rotate(grad * r2, rotary_mode), (grad * x).sum_to_size(r1.shape),
            (grad * rotate(x, rotary_mode)).sum_to_size(r2.shape))


def planted(fault, rotary_mode):
    def run(x, r1, r2):
        from hypershard.testing import fused
        fused.PLANTED_BACKWARD["npu_rotary_mul_backward"] = fault  # this launch's rank processes only
        return through_npu(rotary_mode)(x, r1, r2)
    return run


def test_npu_planted_wrong_backward_is_caught():
    """The npu cases' checks fail on a wrong backward kernel: the same case with a stand-in
    backward whose dx rotates the wrong way (its own launch, so the fault stays in those ranks);
    the tables' gradients stay right."""
    case = npu_case("npu_rotary_mul_planted_dx", "interleave", mesh1(2, "dp"), ["S(0)"], (1, 1, S, D), ["R"],
                    dist_fn=planted(_dx_rotated_the_wrong_way, "interleave"))
    got = run_cases([case], timeout=300)["npu_rotary_mul_planted_dx"]
    assert got.status == "failed" and "grad of input 0" in got.message, (got.status, got.message)
    assert "grad of input 1" not in got.message and "grad of input 2" not in got.message, got.message


def strict_cases(world):
    return scenario_cases(world) + bf16_cases(world) + error_cases(world) + npu_cases(world)


def test_rotary_2_ranks():
    assert_all_passed(run_cases(strict_cases(2), timeout=600))


def test_rotary_4_ranks():
    assert_all_passed(run_cases(strict_cases(4), timeout=900))


def test_rotary_8_ranks():
    assert_all_passed(run_cases(strict_cases(8), timeout=900))


# --------------------------------------------------------------------------- default mode

def default_mode_cases():
    cases = []
    implicitly = lambda mode: counting("implicit_calls", rope(mode))  # noqa: E731
    m4, m22 = mesh1(4, "sp"), ((2, 2), ("dp", "sp"))
    for mode in MODES:
        # the full-size table whole where x is sharded on S: cut locally, no communication
        cases.append(Case(f"default_fullsize_table_whole_seq_4_mode{mode}", implicitly(mode),
                          inputs((B, N, S, D), ["S(2)"], (1, 1, S, D), ["R"]), m4))
        cases.append(Case(f"default_fullsize_table_whole_dp_sp_mode{mode}", implicitly(mode),
                          inputs((B, N, S, D), ["S(0)", "S(2)"], (B, N, S, D), ["S(0)", "R"]), m22))
        # a Partial x: reduced first
        cases.append(Case(f"default_partial_x_4_mode{mode}", implicitly(mode),
                          inputs((B, N, S, D), ["P"], (1, 1, S, D), ["R"]), mesh1(4, "dp")))
        cases.append(Case(f"default_partial_x_2d_mode{mode}", implicitly(mode),
                          inputs((B, N, S, D), ["S(0)", "P"], (1, 1, S, D), ["R", "R"]), ((2, 2), ("dp", "tp"))))
        # a regular layout is served as in strict mode (no implicit call needed)
        cases.append(Case(f"default_regular_dp_sp_mode{mode}", laid_out_like_x(mode),
                          inputs((B, N, S, D), ["S(0)", "S(2)"], (1, 1, S, D), ["R", "S(2)"]), m22))
    return cases


def test_rotary_default_mode():
    assert_all_passed(run_cases(default_mode_cases(), backend=DefaultModeAdapter(), timeout=900))
