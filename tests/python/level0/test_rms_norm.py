"""Level0: the fused RMSNorm (csrc/kernels/rms_norm.cpp, its rule rms_norm_rule in
csrc/ops/normalization.cpp) on real CPU meshes of 2, 4 and 8 ranks against one device: forward,
and the gradients of x and weight, in strict mode.

x is (B, S, H) with B = 3, S = 5 (7 on the 1-D 4-rank mesh), H = 8: every sharded leading dim is
uneven over its split (B = 3 over 2: 2 + 1, over 4: 1 + 1 + 1 + 0, an empty shard; S = 5 over 2,
S = 7 over 4), the weight (H,) Replicate (or (S, H) for two normalized dims):
  1-D (2,) "dp" / (4,) "tp": x S(0), S(1), Replicate, S(2) (H sharded)
  2-D (2, 2) ("dp", "tp"): x (S(0), S(1)), (S(1), S(0)), (S(0), R), (S(0), S(0)), (S(0), S(2)), R
  3-D (2, 2, 2) ("dp", "tp", "sp"): x (S(0), R, S(1)), (S(0), S(1), S(1)), (S(0), S(2), S(1)), R
x sharded on H is planned gathered by the rule (a redistribution the rule asks for, which strict
mode allows): it computes correctly, y is whole on H.

Values: every row of x is normalized by the same kernel code on one rank as on one device, so y
and dx (and dweight where no rank splits the leading dims) are bit-identical (rtol = atol = 0,
checked by a twin case whose weight wants no gradient). dweight of a sharded x is a Partial(sum)
of per-rank sums: its atol is argued at "dweight tolerance". In the distributed run each case
asserts the output placements: x's, with the normalized dims made Replicate.

Besides: the composed form (HF's RMSNorm written out) beside the fused op in one call -- the
same values within both forms' rounding and the same placements -- and alone (its own gradients);
bf16 (and bf16 x with a float32 weight, y float32); rstd's layout and values; strict-mode errors
(Partial x -- also raised by rank 0 alone, before any collective --, Partial weight, a weight that
is not x's trailing shape, and the composed form with H sharded, whose mean over the sharded H is
a Partial(sum) that rsqrt refuses); default mode (one 4-rank launch): a Partial x is reduced first
(counted in dispatch_stats()["implicit_calls"]), the composed form with H sharded runs with its
variance all-reduced and keeps H sharded (unlike the fused op, which gathers H); torch_npu's
npu::npu_rms_norm through stand-in ops of torch_npu's schemas (hypershard.testing.fused; defined
in each rank process on first use), sharded in strict mode, forward and the gradients of self and
gamma against the composed form with torch's autograd on one device (see "torch_npu's op"), and a
planted wrong backward kernel that those checks catch.

Cases per launch (test_case_counts): 2 ranks 36, 4 ranks 53, 8 ranks 18 (strict mode); 4 ranks 9
(default mode).
"""

import math

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
from hypershard.testing.planning import PlanningMesh
from hypershard.testing.spec import make_cotangent, normalize_mesh, stable_seed

EPS = 1e-6
B, S, H = 3, 5, 8
EXACT = {"rtol": 0.0, "atol": 0.0}


def mesh1(size, name):
    return ((size,), (name,))


M2 = ((2, 2), ("dp", "tp"))
M3 = ((2, 2, 2), ("dp", "tp", "sp"))


def expected_placements(x, k):
    """x's placements with the shards of its last k (normalized) dims made Replicate (and a
    Partial, which default mode reduces first, Replicate)."""
    return tuple(hs.Replicate() if (p.is_shard() and p.dim % x.dim() >= x.dim() - k) or p.is_partial() else p
                 for p in x.placements)


def fused(x, w):
    """The fused op; in the distributed run y must be laid out like x with H whole."""
    y = ops.rms_norm(x, w, EPS)
    if in_distributed_run():
        want = expected_placements(x, w.dim())
        assert y.placements == want, (y.placements, want)
    return y


def fused_with_rstd(x, w):
    """torch.ops.hypershard.rms_norm itself: y and rstd (x's shape with the normalized dims 1,
    laid out like y). rstd is compared with one device too."""
    y, rstd = torch.ops.hypershard.rms_norm(x, w, EPS)
    assert tuple(rstd.shape) == tuple(x.shape[:x.dim() - w.dim()]) + (1,) * w.dim()
    assert rstd.dtype == torch.float32 and not rstd.requires_grad
    if in_distributed_run():
        assert y.placements == rstd.placements == expected_placements(x, w.dim()), (y.placements, rstd.placements)
    return y, rstd


def fused_composed_rtol(n, x_dtype, out_dtype):
    """|fused - composed| relative to |y|: the fused op is within one rounding of y's dtype plus
    about n/2 + 6 float roundings of the exact value (rstd's sum of n squares, halved by the sqrt;
    see tests/python/unit/test_rms_norm_kernel.py, y_bound); the composed form within a rounding
    to x's dtype (bf16/fp16 only) and one of y's dtype plus about n/2 + 7 float roundings
    (composed_y_bound there). Together: 2 u_y + u_x + (n + 16) 2^-24, times 1.01 as |y| and the
    composed value differ by less than 1 %."""
    unit = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
    u_x = unit[x_dtype] if x_dtype in (torch.bfloat16, torch.float16) else 0.0
    return 1.01 * (2 * unit[out_dtype] + u_x + (n + 16) * 2.0 ** -24)


def fused_and_composed(x, w):
    """Both forms on the same inputs: the harness compares both (and the gradients through both)
    with one device; the distributed run also checks that they come out in the same layout, with
    the same local values within both forms' rounding (fused_composed_rtol)."""
    y = ops.rms_norm(x, w, EPS)
    c = ops.rms_norm_composed(x, w, EPS)
    rtol = fused_composed_rtol(w.numel(), x.dtype, y.dtype)
    if in_distributed_run():
        assert y.placements == c.placements == expected_placements(x, 1), (y.placements, c.placements)
        torch.testing.assert_close(y.to_local(), c.to_local(), rtol=rtol, atol=0.0)
    else:
        torch.testing.assert_close(y, c, rtol=rtol, atol=0.0)
    return y, c


def composed(x, w):
    """The composed form alone: its values and its own gradients against one device."""
    c = ops.rms_norm_composed(x, w, EPS)
    if in_distributed_run():
        assert c.placements == x.placements, (c.placements, x.placements)
    return c


# --------------------------------------------------------------------------- dweight tolerance
#
# y and dx: every row is normalized by the same kernel code (products and sums in float, one
# rounding), on one rank as on one device: bit-identical, rtol = atol = 0.
#
# dweight = sum over the R leading positions of g * x * rstd. One device: the kernel's float32
# products (the same on every rank), at::sum over all R rows in float32, one rounding to the
# weight's dtype. Distributed, x's leading dims split over k distinct row blocks (the ranks of the
# Partial(sum) group): each rank sums its block in float32 and rounds to the weight's dtype, then
# the k partials are added by the all-reduce (k - 1 additions in the weight's dtype, in any order).
# With u_w the weight dtype's unit roundoff and P_j the exact block sums of an element, each of
# those k + 1 roundings errs by at most u_w times a magnitude <= sum_j |P_j| (1 + u_w); the float32
# accumulations (in whatever order at::sum adds, which depends on the block's shape) by at most
# R 2^-24 sum_rows |g x rstd| in each run. So
#     |distributed - one device| <= (k + 1) u_w (1 + 2 u_w) max sum_j |P_j| + 2 (R + k) 2^-24 max T,
# T = sum_rows |g x rstd|: the case's atol (rtol 0), computed in float64 from the case's own seeded
# x and cotangent(s) (for the fused + composed cases the two cotangents' magnitudes add) and the
# row blocks the mesh gives (hypershard.testing.planning: each rank's offsets and local sizes).
# The composed form's dweight (sum.dim_IntList of g * h in the weight's dtype) has the same
# structure, its products g * h rounded to x's dtype: |g h| <= |g x rstd| (1 + 2 u_x + ...) <=
# 1.02 |g x rstd| even in bf16, so both magnitudes are taken 1.02 times (which also covers the
# float32 rounding of the kernel's products, identical in both runs). y and dx are covered by it
# too; the twin case whose weight wants no gradient checks them bit-exactly.

UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def row_blocks(x_shape, x_place, mesh, k):
    """The distinct blocks of leading positions the ranks hold: a tuple of slices per block."""
    shape, names = normalize_mesh(mesh)
    world = math.prod(shape)
    lead = len(x_shape) - k
    blocks = set()
    for rank in range(world):
        pm = PlanningMesh(dict(zip(names, shape)), rank=rank)
        layout = pm.layout(list(x_shape), x_place)
        offsets = layout.global_offset_at(pm.device_mesh.position)
        sizes = layout.local_shape_at(pm.device_mesh.position)
        blocks.add(tuple((offsets[d], sizes[d]) for d in range(lead)))
    return [tuple(slice(o, o + s) for o, s in block) for block in sorted(blocks)]


def dweight_atol(name, items, mesh, outputs=1):
    """The bound above for a case named `name` with inputs `items` (x, weight) and `outputs`
    differentiable outputs of x's shape (each with its own cotangent)."""
    x_item, w_item = items
    k = len(w_item.shape)
    x = x_item.make(x_item.seed if x_item.seed is not None else stable_seed(name, "input", 0)).double()
    y_dtype = torch.result_type(torch.empty(0, dtype=x_item.dtype), torch.empty(0, dtype=w_item.dtype))
    dims = tuple(range(-k, 0))
    rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + EPS)
    cots = [make_cotangent(stable_seed(name), i, x_item.shape, y_dtype).double() for i in range(outputs)]
    g, g_abs = sum(cots), sum(c.abs() for c in cots)
    terms = g * x * rstd
    total = (g_abs * x.abs() * rstd).sum_to_size(w_item.shape)
    blocks = row_blocks(x_item.shape, x_item.placements, mesh, k)
    spread = sum(terms[block].sum_to_size(w_item.shape).abs() for block in blocks)
    rows = x.numel() // math.prod(w_item.shape)
    u_w = UNIT[w_item.dtype]
    return 1.02 * ((len(blocks) + 1) * u_w * (1 + 2 * u_w) * spread.max().item()
                   + 2 * (rows + len(blocks)) * 2.0 ** -24 * total.max().item())


def splits_rows(x_place, k, ndim):
    """True when some mesh axis shards a leading dim (dweight is then a Partial sum)."""
    for p in x_place:
        if p.startswith("S(") and int(p[2:-1]) % ndim < ndim - k:
            return True
    return False


def tolerance(name, inputs, mesh, outputs=1):
    """rtol = atol = 0 where no rank splits the leading dims (and the weight wants a gradient),
    else rtol 0 and dweight_atol."""
    x_item, w_item = inputs
    if w_item.wants_grad and splits_rows(x_item.placements, len(w_item.shape), len(x_item.shape)):
        return {"rtol": 0.0, "atol": dweight_atol(name, inputs, mesh, outputs)}
    return dict(EXACT)


def composed_hidden_atol(name, inputs, mesh):
    """The composed form with H sharded (default mode): its sums over H (the variance, and in the
    backward the sum of g w x over H) are per-rank partial sums all-reduced, in another order than
    on one device. Each evaluation of the composed chain in float32 is within about
    (3n + 24) 2^-24 of the exact value relative to the magnitudes (n - 1 additions and about 12
    pointwise roundings on a path, three rstd factors of about n/2 + 3 roundings each): y's |y|,
    dx's M = r |g w| + r^3 |x| mean(|g w x|) (A and B of dx = A - B). So the two runs differ by at
    most 2 (3n + 24) 2^-24 max(|y|, M); plus dweight_atol where the leading dims are split."""
    x_item, w_item = inputs
    n = math.prod(w_item.shape)
    x = x_item.make(stable_seed(name, "input", 0)).double()
    w = w_item.make(stable_seed(name, "input", 1)).double()
    g = make_cotangent(stable_seed(name), 0, x_item.shape, x_item.dtype).double()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    magnitude = torch.maximum((x * r * w).abs(), r * (g * w).abs() + r ** 3 * x.abs() * (g * w * x).abs().mean(
        -1, keepdim=True))
    atol = 2 * (3 * n + 24) * 2.0 ** -24 * magnitude.max().item()
    return atol + tolerance(name, inputs, mesh)["atol"]


def items(x_shape, x_place, w_shape=(H,), x_dtype=torch.float32, w_dtype=None, w_grad=True):
    return [Input(x_shape, x_dtype, placements=x_place),
            Input(w_shape, w_dtype or x_dtype, requires_grad=w_grad,
                  init=lambda shape, dtype, gen: (1 + 0.5 * torch.randn(shape, generator=gen)).to(dtype))]


# --------------------------------------------------------------------------- the scenarios

def value_cases(world):
    cases = []

    def add(tag, mesh, x_shape, x_place, w_shape=(H,), fn=fused, x_dtype=torch.float32, w_dtype=None, outputs=1):
        k = len(w_shape)
        name = f"{tag}_{world}"
        inputs = items(x_shape, x_place, w_shape, x_dtype, w_dtype)
        cases.append(Case(name, fn, inputs, mesh, **tolerance(name, inputs, mesh, outputs)))
        if splits_rows(x_place, k, len(x_shape)):
            # the twin: the weight wants no gradient, y and dx bit-identical
            cases.append(Case(name + "_y_dx_exact", fn, items(x_shape, x_place, w_shape, x_dtype, w_dtype, False),
                              mesh, **EXACT))

    w = world
    bsh = (B, S, H)
    if w in (2, 4):
        m = mesh1(w, "dp" if w == 2 else "tp")
        seq = (B, S if w == 2 else 7, H)
        add("batch", m, bsh, ["S(0)"])
        add("seq", m, seq, ["S(1)"])
        add("replicate", m, bsh, ["R"])
        add("hidden_gathered", m, bsh, ["S(2)"])
        add("weight2d_batch", m, bsh, ["S(0)"], (S, H))
        add("weight2d_seq_gathered", m, bsh, ["S(1)"], (S, H))
        add("rstd_seq", m, seq, ["S(1)"], fn=fused_with_rstd)
        add("rstd_hidden_gathered", m, bsh, ["S(2)"], fn=fused_with_rstd)
        add("composed_beside_batch", m, bsh, ["S(0)"], fn=fused_and_composed, outputs=2)
        add("composed_beside_seq", m, seq, ["S(1)"], fn=fused_and_composed, outputs=2)
        add("composed_alone_seq", m, seq, ["S(1)"], fn=composed)
        add("composed_alone_replicate", m, bsh, ["R"], fn=composed)
        add("bf16_batch", m, bsh, ["S(0)"], x_dtype=torch.bfloat16)
        add("bf16_seq_f32_weight", m, seq, ["S(1)"], x_dtype=torch.bfloat16, w_dtype=torch.float32)
        add("bf16_hidden_gathered", m, bsh, ["S(2)"], x_dtype=torch.bfloat16)
        add("bf16_composed_beside_seq", m, seq, ["S(1)"], fn=fused_and_composed, x_dtype=torch.bfloat16, outputs=2)
    if w == 4:
        add("dp_tp_batch_seq", M2, bsh, ["S(0)", "S(1)"])
        add("dp_tp_seq_batch", M2, bsh, ["S(1)", "S(0)"])
        add("dp_tp_batch_only", M2, bsh, ["S(0)", "R"])
        add("dp_tp_two_axes_on_batch", M2, bsh, ["S(0)", "S(0)"])   # B = 3 over 4: one empty shard
        add("dp_tp_batch_hidden_gathered", M2, bsh, ["S(0)", "S(2)"])
        add("dp_tp_replicate", M2, bsh, ["R", "R"])
        add("dp_tp_weight2d", M2, bsh, ["S(0)", "S(1)"], (S, H))
        add("dp_tp_rstd", M2, bsh, ["S(1)", "S(0)"], fn=fused_with_rstd)
        add("dp_tp_composed_beside", M2, bsh, ["S(0)", "S(1)"], fn=fused_and_composed, outputs=2)
        add("dp_tp_composed_alone", M2, bsh, ["S(1)", "S(0)"], fn=composed)
        add("dp_tp_bf16", M2, bsh, ["S(0)", "S(1)"], x_dtype=torch.bfloat16)
        add("dp_tp_bf16_f32_weight", M2, bsh, ["S(0)", "S(1)"], x_dtype=torch.bfloat16, w_dtype=torch.float32)
    if w == 8:
        add("3d_batch_seq", M3, bsh, ["S(0)", "R", "S(1)"])
        add("3d_seq_on_tp_and_sp", M3, bsh, ["S(0)", "S(1)", "S(1)"])
        add("3d_hidden_on_tp_gathered", M3, bsh, ["S(0)", "S(2)", "S(1)"])
        add("3d_replicate", M3, bsh, ["R", "R", "R"])
        add("3d_weight2d", M3, bsh, ["S(0)", "R", "S(1)"], (S, H))
        add("3d_rstd", M3, bsh, ["S(0)", "S(2)", "S(1)"], fn=fused_with_rstd)
        add("3d_composed_beside", M3, bsh, ["S(0)", "R", "S(1)"], fn=fused_and_composed, outputs=2)
        add("3d_composed_alone", M3, bsh, ["S(0)", "S(1)", "S(1)"], fn=composed)
        add("3d_bf16", M3, bsh, ["S(0)", "R", "S(1)"], x_dtype=torch.bfloat16)
    return cases


# --------------------------------------------------------------------------- strict-mode errors

def alone_on_rank0(text):
    """The refused call made by rank 0 alone (the other ranks skip it): it must raise `text`. Had
    the rule or the dispatch started a collective first, rank 0 would wait for peers that never
    come and fail with a timeout instead -- so the error comes before any communication."""
    def run(x, w):
        if in_distributed_run() and current_rank() == 0:
            try:
                ops.rms_norm(x, w, EPS)
            except RuntimeError as exc:
                assert text in str(exc), str(exc)
            else:
                raise AssertionError(f"no error raised; expected one containing {text!r}")
        return torch.zeros(1)
    return run


NOT_LINEAR = "Partial(sum) input is not supported by this op (it is not linear in it)"


def error_cases(world):
    cases = []
    if world == 2:
        m = mesh1(2, "dp")
        text = ("hypershard::rms_norm: argument x (#0) [3, 5, 8] (\"None\", \"None\", \"None\") partial(sum: dp): "
                + NOT_LINEAR)
        cases.append(Case("error_partial_x_2", fused, items((B, S, H), ["P"]), m, expect_error=text))
        cases.append(Case("error_partial_x_2_rank0_alone", alone_on_rank0(text), items((B, S, H), ["P"]), m,
                          check_grad=False))
        w_partial = [Input((B, S, H), placements=["S(0)"]), Input((H,), placements=["P"])]
        cases.append(Case("error_partial_weight_2", fused, w_partial, m,
                          expect_error="hypershard::rms_norm: argument weight (#1) [8] (\"None\",) partial(sum: dp): "
                                       + NOT_LINEAR))
        cases.append(Case("error_weight_not_trailing_2", fused, items((B, S, H), ["S(0)"], (S,)), m,
                          expect_error="hypershard::rms_norm: argument weight (#1) [5] (\"None\",): shape [5] is not "
                                       "the end of x's shape [3, 5, 8]; allowed: a weight of rank >= 1 shaped like "
                                       "x's trailing dims"))
        # the composed form with H sharded: mean over the sharded H is a Partial(sum) variance,
        # which rsqrt refuses in strict mode (the fused op gathers H instead: hidden_gathered)
        cases.append(Case("error_composed_hidden_sharded_2", composed, items((B, S, H), ["S(2)"]), m,
                          expect_error="hypershard: aten::rsqrt: argument self (#0) [3, 5, 1] (\"None\", \"None\", "
                                       "\"None\") partial(sum: dp): Partial(sum) input is not supported by this op"))
    if world == 4:
        text = ("hypershard::rms_norm: argument x (#0) [3, 5, 8] (\"dp\", \"None\", \"None\") partial(sum: tp): "
                + NOT_LINEAR)
        cases.append(Case("error_partial_x_2d", fused, items((B, S, H), ["S(0)", "P"]), M2, expect_error=text))
        cases.append(Case("error_partial_x_2d_rank0_alone", alone_on_rank0(text), items((B, S, H), ["S(0)", "P"]), M2,
                          check_grad=False))
    return cases


# --------------------------------------------------------------------------- torch_npu's op
#
# npu::npu_rms_norm through stand-ins of torch_npu's schemas (hypershard.testing.fused: the CPU
# kernels compute torch_npu's maths -- the forward HF's RMSNorm written out, the backward
# npu_rms_norm_backward's formula). On a DTensor hypershard's autograd kernel at
# AutogradPrivateUse2 (csrc/kernels/external_autograd.cpp) records a backward that calls
# npu::npu_rms_norm_backward, which the rule serves. The one-device reference is NOT the stand-in:
# it is the composed form with torch's autograd (the true derivative), so a wrong backward kernel,
# or a backward that is never recorded, fails the gradient comparison (test_npu_planted_*).
#
# Tolerance: y and rstd are the same composed float32 code on each row in both runs (bit-equal);
# dx is the explicit formula in one run and autograd's chain through the composed ops in the
# other: each within (3n + 24) 2^-24 of the exact value relative to its magnitude M (the argument
# at composed_hidden_atol; the formula takes about n + 8 roundings, fewer than the chain), so
# composed_hidden_atol's 2 (3n + 24) 2^-24 max M bounds their difference; dgamma is a sum of the
# same float32 products g * h in another order (and Partial over split rows): dweight_atol, which
# composed_hidden_atol adds where the leading dims are split.


def npu_ops():
    from hypershard.testing.fused import NPU_RMS_NORM_SCHEMAS, define_npu_kernels
    return define_npu_kernels(NPU_RMS_NORM_SCHEMAS)


def through_npu(x, gamma):
    """npu::npu_rms_norm (y and rstd laid out like x with H whole)."""
    y, rstd = npu_ops().npu_rms_norm(x, gamma, EPS)
    if in_distributed_run():
        want = expected_placements(x, 1)
        assert y.placements == rstd.placements == want, (y.placements, rstd.placements, want)
        assert not rstd.requires_grad
        if x.requires_grad or gamma.requires_grad:  # recorded by hypershard's kernel, not torch_npu's
            assert "NpuRmsNorm" in y.grad_fn.name(), y.grad_fn.name()
    return y, rstd


def npu_reference(x, gamma):
    """The one-device reference: the composed form (torch's autograd), rstd not differentiable."""
    rstd = torch.rsqrt(x.detach().to(torch.float32).pow(2).mean(-1, keepdim=True) + EPS)
    return ops.rms_norm_composed(x, gamma, EPS), rstd


def npu_double_backward(x, gamma):
    y, _ = through_npu(x, gamma)
    dx, = torch.autograd.grad(y.sum(), x, create_graph=True)
    dx.sum().backward()
    return dx


def npu_case(name, mesh, place, dist_fn=through_npu):
    inputs = items((B, S, H), place)
    return Case(name, npu_reference, inputs, mesh, dist_fn=dist_fn, rtol=0.0,
                atol=composed_hidden_atol(name, inputs, mesh))


def npu_cases(world):
    cases = []
    layouts = {2: [("batch", mesh1(2, "dp"), ["S(0)"]), ("seq", mesh1(2, "sp"), ["S(1)"]),
                   ("hidden_gathered", mesh1(2, "tp"), ["S(2)"])],
               4: [("dp_tp", M2, ["S(0)", "S(1)"]), ("dp_tp_hidden_gathered", M2, ["S(0)", "S(2)"])],
               8: [("3d", M3, ["S(0)", "S(2)", "S(1)"])]}[world]
    for tag, mesh, place in layouts:
        cases.append(npu_case(f"npu_rms_norm_{tag}_{world}", mesh, place))
    if world == 2:
        # first-order gradients with create_graph=True work; a second derivative raises
        cases.append(Case("npu_rms_norm_double_backward_refused", npu_double_backward, items((B, S, H), ["S(0)"]),
                          mesh1(2, "dp"), expect_error="hypershard: npu::npu_rms_norm_backward: a second derivative "
                                                       "(double backward) is not implemented"))
        inputs = [Input((B, S, H), placements=["P"], requires_grad=False), Input((H,), requires_grad=False)]
        cases.append(Case("npu_rms_norm_partial_x_refused", through_npu, inputs, mesh1(2, "dp"),
                          expect_error="npu::npu_rms_norm: argument self (#0) [3, 5, 8] (\"None\", \"None\", \"None\") "
                          "partial(sum: dp): " + NOT_LINEAR))
    return cases


def _dx_without_mean_term(dy, x, gamma, rstd):
    """A planted fault: dx = rstd * dy * gamma (the projection term dropped), dgamma right."""
    h = x.float() * rstd
    return (rstd * dy * gamma).to(x.dtype), (dy * h).sum(tuple(range(x.dim() - gamma.dim())))


def planted(fault):
    def run(x, gamma):
        from hypershard.testing import fused
        fused.PLANTED_BACKWARD["npu_rms_norm_backward"] = fault  # this launch's rank processes only
        return through_npu(x, gamma)
    return run


def test_npu_planted_wrong_backward_is_caught():
    """The npu cases' checks fail on a wrong backward kernel: the same case with a stand-in
    backward that drops dx's mean term (its own launch, so the fault stays in those ranks)."""
    case = npu_case("npu_rms_norm_planted_dx_2", mesh1(2, "dp"), ["S(0)"], dist_fn=planted(_dx_without_mean_term))
    result = run_cases([case], timeout=300)
    got = result["npu_rms_norm_planted_dx_2"]
    assert got.status == "failed" and "grad of input 0" in got.message, (got.status, got.message)
    assert "grad of input 1" not in got.message, got.message


def strict_cases(world):
    return value_cases(world) + error_cases(world) + npu_cases(world)


def test_case_counts():
    counts = {w: len(strict_cases(w)) for w in (2, 4, 8)}
    assert counts == {2: 36, 4: 53, 8: 18}, counts
    assert len(default_mode_cases()) == 9


def test_rms_norm_2_ranks():
    assert_all_passed(run_cases(strict_cases(2), timeout=600))


def test_rms_norm_4_ranks():
    assert_all_passed(run_cases(strict_cases(4), timeout=600))


def test_rms_norm_8_ranks():
    assert_all_passed(run_cases(strict_cases(8), timeout=600))


# --------------------------------------------------------------------------- default mode

def no_implicit_call(fn):
    """fn, asserting in the distributed run that no implicit redistribution was needed."""
    def run(*args):
        if not in_distributed_run():
            return fn(*args)
        before = hs._C.dispatch_stats()["implicit_calls"]
        out = fn(*args)
        assert hs._C.dispatch_stats()["implicit_calls"] == before, "an implicit redistribution was counted"
        return out
    return run


def composed_hidden_sharded(x, w):
    """Default mode: the composed form with H sharded runs (its Partial variance all-reduced) and
    keeps H sharded -- the fused op gathers H instead (fused, hidden_gathered)."""
    c = ops.rms_norm_composed(x, w, EPS)
    if in_distributed_run():
        assert c.placements == x.placements, (c.placements, x.placements)
    return c


def default_mode_cases():
    cases = []
    m4 = mesh1(4, "dp")
    bsh = (B, S, H)

    def add(name, fn, inputs, mesh, outputs=1, atol=None):
        tol = tolerance(name, inputs, mesh, outputs) if atol is None else {"rtol": 0.0, "atol": atol}
        cases.append(Case(name, fn, inputs, mesh, **tol))

    # A Partial x: reduced first. Replicate -> Partial(sum) (the harness's distribute) leaves the
    # value on one rank of the group and zeros on the others, so the reduction gives x exactly:
    # the one-device values (dweight within dweight_atol where the batch is split).
    add("default_partial_x_4", counting("implicit_calls", fused), items(bsh, ["P"]), m4)
    add("default_partial_x_2d", counting("implicit_calls", fused), items(bsh, ["S(0)", "P"]), M2)
    add("default_partial_x_bf16_f32_weight", counting("implicit_calls", fused),
        items(bsh, ["P"], x_dtype=torch.bfloat16, w_dtype=torch.float32), mesh1(4, "tp"))
    # the composed form with H sharded: the variance's Partial(sum) reduced implicitly; y keeps H
    # sharded (composed_hidden_atol)
    for name, place, mesh in (("default_composed_hidden_sharded_4", ["S(2)"], mesh1(4, "tp")),
                              ("default_composed_hidden_sharded_2d", ["S(0)", "S(2)"], M2)):
        inputs = items(bsh, place)
        add(name, counting("implicit_calls", composed_hidden_sharded), inputs, mesh,
            atol=composed_hidden_atol(name, inputs, mesh))
    # the fused op needs no implicit call: H sharded is the rule's planned gather, as in strict mode
    add("default_fused_hidden_gathered_4", no_implicit_call(fused), items(bsh, ["S(2)"]), mesh1(4, "tp"))
    add("default_fused_batch_seq_2d", no_implicit_call(fused), items(bsh, ["S(0)", "S(1)"], w_grad=False), M2)
    add("default_fused_and_composed_2d", no_implicit_call(fused_and_composed), items(bsh, ["S(1)", "S(0)"]), M2,
        outputs=2)
    add("default_npu_batch_4", no_implicit_call(through_npu),
        [Input(bsh, placements=["S(0)"], requires_grad=False), Input((H,), requires_grad=False)], m4)
    return cases


def test_rms_norm_default_mode():
    assert_all_passed(run_cases(default_mode_cases(), backend=DefaultModeAdapter(), timeout=600))
