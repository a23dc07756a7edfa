"""UT: the fused rotary position embedding kernel (csrc/kernels/rotary.cpp) on plain CPU tensors,
and the same op's kernel for other devices (csrc/kernels/composite.cpp, ATen ops; called at its
dispatch key here) against the same bounds.

Output and the three gradients (dx, dcos, dsin) of every mode and dtype, x in BNSD/BSND/SBND with
full-size and broadcast cos/sin, against the composed form (hypershard.ops.
rotary_position_embedding_composed: cat/neg/mul/stack) evaluated in float64 on the SAME rounded
inputs. Each element is checked against an error bound derived from the arithmetic the kernel
promises (every product and sum in float -- double for double inputs -- and one rounding to the
output dtype at the end), not against a tolerance tuned on one CPU; see `forward_bound` and
`sum_bound`. A planted-fault test shows the bound check rejects wrong results.
"""

from __future__ import annotations

import math
import zlib

import hypershard.ops as hops
import pytest
import torch

from hypershard.testing.fused import assert_within

OP = torch.ops.hypershard.rotary_position_embedding.default
BWD = torch.ops.hypershard.rotary_position_embedding_backward.default
f64 = torch.float64

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

# Unit roundoff u = 2^-p of round-to-nearest, p the significand bits counting the implicit one
# (bf16 p = 8, fp16 p = 11, fp32 p = 24, fp64 p = 53): |fl(v) - v| <= u |v| for a normal result.
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24, f64: 2.0 ** -53}
# Where the result is subnormal the rounding error is absolute instead: at most half the smallest
# subnormal (fp16 2^-24, bf16 2^-133, fp32 2^-149, fp64 2^-1074). So |fl(v) - v| <= u |v| + eta.
ETA = {torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25, torch.float32: 2.0 ** -150, f64: 2.0 ** -1075}
# The kernel's arithmetic type ("opmath"): float for the 16-bit types and float32, double for double.
OPMATH = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float32, f64: f64}


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): n roundings (in any order of a sum or product of n+1
    numbers) change the result by at most gamma_n times the sum of the absolute terms."""
    return n * u / (1 - n * u)


def forward_bound(ref: torch.Tensor, terms: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bound on |kernel - ref| for y = t1 + t2 with t1 = x[a] cos, t2 = +-x[b] sin (and likewise dx
    = g cos + -g sin, two products of one sum); `terms` = |t1| + |t2|, `ref` the float64 value.

    In opmath (unit u_acc): fl(fl(t1) + fl(t2)) has error <= gamma_2(u_acc) (|t1| + |t2|) plus an
    absolute 2 eta_acc per product that underflows. Rounding that once to the output dtype adds
    u_out |y| + eta_out. The float64 reference itself carries gamma_2(2^-53) (|t1| + |t2|). So
        |kernel - ref| <= u_out (|ref| + r) + eta_out + (1 + u_out) (gamma_2(u_acc) T + 2 eta_acc) + r,
    r = gamma_2(2^-53) T. For float64 inputs u_acc = u_out = 2^-53."""
    return sum_bound(ref, terms, dtype, n=2)


def sum_bound(ref: torch.Tensor, terms: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Bound on |kernel - ref| for a value made of n products summed in opmath, then rounded once.

    The same argument as `forward_bound` with n products: n - 1 additions and n product roundings
    are n roundings on any path of the sum's tree (the float32 accumulation of n terms is within
    gamma_n(2^-24) * sum|terms|), each product may underflow by eta_acc, the one final rounding adds
    u_out |y| + eta_out, and the float64 reference (n products, n - 1 sums) carries gamma_n(2^-53) T.
    dcos / dsin over a broadcast table sum n = numel(x) / numel(table) products g x per element."""
    acc = OPMATH[dtype]
    u_out, u_acc = UNIT[dtype], UNIT[acc]
    ref_err = gamma(n, UNIT[f64]) * terms
    inner = gamma(n, u_acc) * terms + n * ETA[acc]
    return u_out * (ref.abs() + ref_err) + ETA[dtype] + (1 + u_out) * inner + ref_err


# --- the modes, independently of the kernel: y[i] = x[a(i)] cos[i] + s(i) x[b(i)] sin[i] ----------

def rotary_maps(d: int, mode: int):
    """Index maps a, b and signs s of each mode (the definitions in hypershard/tensor/ops.py)."""
    half, quarter = d // 2, d // 4
    a, b, s = list(range(d)), [0] * d, [0] * d
    for i in range(d):
        if mode == 0:    # cat(-x2, x1)
            b[i], s[i] = (i + half, -1) if i < half else (i - half, 1)
        elif mode == 1:  # rotate[2k] = -x[2k+1], rotate[2k+1] = x[2k]
            b[i], s[i] = (i + 1, -1) if i % 2 == 0 else (i - 1, 1)
        elif mode == 2:  # cat(-x2, x1, -x4, x3)
            b[i], s[i] = (i + quarter, -1) if (i // quarter) % 2 == 0 else (i - quarter, 1)
        else:            # cat(e, o) * cos + cat(-o, e) * sin
            a[i] = 2 * i if i < half else 2 * (i - half) + 1
            b[i], s[i] = (2 * i + 1, -1) if i < half else (2 * (i - half), 1)
    return torch.tensor(a), torch.tensor(b), torch.tensor(s, dtype=f64)


def magnitudes(x, cos, sin, g, mode):
    """float64 sums of absolute terms per element: of y and dx (two products each) and of dcos,
    dsin (one product per x element, summed to the table's shape)."""
    a, b, _ = rotary_maps(x.shape[-1], mode)
    x, cos, sin, g = (t.to(f64).abs() for t in (x, cos, sin, g))
    y_terms = x[..., a] * cos + x[..., b] * sin
    gc, gs = (g * cos).expand(x.shape), (g * sin).expand(x.shape)
    dx_terms = torch.zeros_like(x).index_add_(-1, a, gc).index_add_(-1, b, gs)
    dcos_terms = (g * x[..., a]).sum_to_size(cos.shape)
    dsin_terms = (g * x[..., b]).sum_to_size(sin.shape)
    return y_terms, dx_terms, dcos_terms, dsin_terms


def reference(x, cos, sin, g, mode):
    """The composed form in float64 on the given (rounded) inputs: y, dx, dcos, dsin."""
    x64, c64, s64 = (t.detach().to(f64).requires_grad_() for t in (x, cos, sin))
    y = hops.rotary_position_embedding_composed(x64, c64, s64, mode)
    dx, dcos, dsin = torch.autograd.grad(y, (x64, c64, s64), g.to(f64))
    return y.detach(), dx, dcos, dsin


def make_inputs(x_shape, cos_shape, sin_shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=gen, dtype=f64).to(dtype)
    cos = torch.cos(torch.rand(cos_shape, generator=gen, dtype=f64) * 2 * math.pi).to(dtype)
    sin = torch.sin(torch.rand(sin_shape, generator=gen, dtype=f64) * 2 * math.pi).to(dtype)
    g = torch.randn(x_shape, generator=gen, dtype=f64).to(dtype)
    return x, cos, sin, g


B, N, S, D = 2, 3, 5, 8
# (id, x shape, cos shape, sin shape): BNSD, BSND, SBND with full-size and broadcast tables
SHAPES = [
    ("bnsd_full", (B, N, S, D), (B, N, S, D), (B, N, S, D)),
    ("bnsd_1_1_S_D", (B, N, S, D), (1, 1, S, D), (1, 1, S, D)),
    ("bnsd_B_1_S_D", (B, N, S, D), (B, 1, S, D), (B, 1, S, D)),
    ("bsnd_full", (B, S, N, D), (B, S, N, D), (B, S, N, D)),
    ("bsnd_1_S_1_D", (B, S, N, D), (1, S, 1, D), (1, S, 1, D)),
    ("sbnd_S_1_1_D", (S, B, N, D), (S, 1, 1, D), (S, 1, 1, D)),
    ("bnsd_cos_full_sin_broadcast", (B, N, S, D), (B, N, S, D), (1, 1, S, D)),
    # D = 12 (quarters of 3) and many rows summed into one table row: (1, 1, S, D) over B*N = 32
    ("bnsd_wide_sum", (4, 8, 3, 12), (1, 1, 3, 12), (1, 1, 3, 12)),
]


def run_kernel(x, cos, sin, g, mode, kernel="cpu"):
    """y, dx, dcos, dsin: through autograd and the CPU kernel, or ("composite") the ops' kernel
    for every other device (csrc/kernels/composite.cpp: CUDA, NPU), called at its dispatch key."""
    if kernel == "composite":
        key = torch._C.DispatchKey.CompositeExplicitAutograd
        return (OP._op_dk(key, x, cos, sin, mode), *BWD._op_dk(key, g, x, cos, sin, mode, [True, True, True]))
    xs, cs, ss = (t.detach().clone().requires_grad_() for t in (x, cos, sin))
    y = OP(xs, cs, ss, mode)
    y.backward(g)
    return y.detach(), xs.grad, cs.grad, ss.grad


@pytest.mark.parametrize("kernel", ["cpu", "composite"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("name,x_shape,cos_shape,sin_shape", [pytest.param(*r, id=r[0]) for r in SHAPES])
def test_output_and_gradients_within_bounds(name, x_shape, cos_shape, sin_shape, mode, dtype, kernel):
    x, cos, sin, g = make_inputs(x_shape, cos_shape, sin_shape, dtype, seed=zlib.crc32(f"{name}:{mode}".encode()))
    y, dx, dcos, dsin = run_kernel(x, cos, sin, g, mode, kernel)
    for got, want in ((y, x), (dx, x), (dcos, cos), (dsin, sin)):
        assert got.dtype == dtype and got.shape == want.shape
    y_ref, dx_ref, dcos_ref, dsin_ref = reference(x, cos, sin, g, mode)
    y_terms, dx_terms, dcos_terms, dsin_terms = magnitudes(x, cos, sin, g, mode)
    assert_within(y, y_ref, forward_bound(y_ref, y_terms, dtype), "y")
    assert_within(dx, dx_ref, forward_bound(dx_ref, dx_terms, dtype), "dx")
    n_cos, n_sin = x.numel() // cos.numel(), x.numel() // sin.numel()
    assert_within(dcos, dcos_ref, sum_bound(dcos_ref, dcos_terms, dtype, n_cos), "dcos")
    assert_within(dsin, dsin_ref, sum_bound(dsin_ref, dsin_terms, dtype, n_sin), "dsin")


def test_map_reference_is_the_composed_form():
    # The bounds' magnitudes use the index maps above; they must describe the composed form.
    x, cos, sin, _ = make_inputs((2, 3, 16), (1, 3, 16), (2, 3, 16), f64, seed=1)
    for mode in range(4):
        a, b, s = rotary_maps(16, mode)
        assert sorted(a.tolist()) == sorted(b.tolist()) == list(range(16))
        direct = x[..., a] * cos + (s * x[..., b]) * sin
        assert torch.equal(direct, hops.rotary_position_embedding_composed(x, cos, sin, mode))


def test_backward_op_output_mask():
    x, cos, sin, g = make_inputs((B, N, S, D), (1, 1, S, D), (1, 1, S, D), torch.float32, seed=2)
    full = BWD(g, x, cos, sin, 3, [True, True, True])
    dx, dcos, dsin = BWD(g, x, cos, sin, 3, [True, False, False])
    assert torch.equal(dx, full[0]) and dcos is None and dsin is None
    dx, dcos, dsin = BWD(g, x, cos, sin, 3, [False, True, True])
    assert dx is None and torch.equal(dcos, full[1]) and torch.equal(dsin, full[2])


def test_non_contiguous_inputs():
    # x a transposed view (BSND storage read as BNSD), cos/sin expanded views (stride 0)
    x_bsnd, cos, sin, _ = make_inputs((B, S, N, D), (1, 1, S, D), (1, 1, S, D), torch.float32, seed=3)
    x = x_bsnd.transpose(1, 2)
    cos_e, sin_e = cos.expand(B, N, S, D), sin.expand(B, 1, S, D)
    assert not x.is_contiguous()
    got = OP(x, cos_e, sin_e, 0)
    assert torch.equal(got, OP(x.contiguous(), cos, sin, 0))


@pytest.mark.parametrize("mode", range(4))
def test_gradcheck_float64_broadcast_tables(mode):
    gen = torch.Generator().manual_seed(10 + mode)
    x = torch.randn(2, 3, 4, 8, generator=gen, dtype=f64, requires_grad=True)
    cos = torch.randn(1, 1, 4, 8, generator=gen, dtype=f64, requires_grad=True)
    sin = torch.randn(2, 1, 4, 8, generator=gen, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c, s: OP(a, c, s, mode), (x, cos, sin))


@pytest.mark.parametrize("rotary_mode,mode", [("half", 0), ("interleave", 1)])
def test_rotary_mul_is_modes_0_and_1(rotary_mode, mode):
    x, r1, r2, _ = make_inputs((B, S, N, D), (1, S, 1, D), (1, S, 1, D), torch.bfloat16, seed=4)
    assert torch.equal(hops.rotary_mul(x, r1, r2, rotary_mode), OP(x, r1, r2, mode))
    assert torch.equal(hops.rotary_position_embedding(x, r1, r2, rotary_mode), OP(x, r1, r2, mode))
    with pytest.raises(ValueError, match="rotary_mode 'quarter' is not supported"):
        hops.rotary_mul(x, r1, r2, "quarter")


def test_mode_names():
    x, cos, sin, _ = make_inputs((B, N, S, D), (1, 1, S, D), (1, 1, S, D), torch.float32, seed=5)
    for name, mode in hops.MODES.items():
        assert torch.equal(hops.rotary_position_embedding(x, cos, sin, name), OP(x, cos, sin, mode))


@pytest.mark.parametrize("cos_shape", [(1, 1, S, D), (0, N, S, D)], ids=["broadcast", "full"])
def test_empty_batch(cos_shape):
    x = torch.randn(0, N, S, D, requires_grad=True)
    cos = torch.randn(cos_shape, requires_grad=True)
    sin = torch.randn(cos_shape, requires_grad=True)
    y = OP(x, cos, sin, 2)
    assert y.shape == (0, N, S, D)
    y.backward(torch.randn(0, N, S, D))
    assert x.grad.shape == (0, N, S, D)
    assert cos.grad.shape == cos_shape and not cos.grad.any()
    assert sin.grad.shape == cos_shape and not sin.grad.any()


PREFIX = "hypershard::rotary_position_embedding: "
F = torch.float32
ERRORS = [
    ("mode_4", lambda: OP(torch.randn(2, 8), torch.randn(1, 8), torch.randn(1, 8), 4),
     PREFIX + "mode 4 is out of range; allowed: 0 (half), 1 (interleave), 2 (quarter), 3 (interleave-half)"),
    ("mode_minus_1", lambda: OP(torch.randn(2, 8), torch.randn(1, 8), torch.randn(1, 8), -1),
     PREFIX + "mode -1 is out of range"),
    ("odd_d", lambda: OP(torch.randn(2, 7), torch.randn(1, 7), torch.randn(1, 7), 0),
     PREFIX + "the last dim D = 7 of x must be divisible by 2 for mode 0"),
    ("d6_mode_2", lambda: OP(torch.randn(2, 6), torch.randn(1, 6), torch.randn(1, 6), 2),
     PREFIX + "the last dim D = 6 of x must be divisible by 4 for mode 2"),
    ("cos_wrong_rank", lambda: OP(torch.randn(2, 3, 8), torch.randn(3, 8), torch.randn(1, 3, 8), 0),
     PREFIX + "cos has shape [3, 8] and x [2, 3, 8]; allowed: the same rank as x"),
    ("cos_dim_not_broadcastable", lambda: OP(torch.randn(4, 3, 8), torch.randn(2, 3, 8), torch.randn(1, 3, 8), 0),
     PREFIX + "cos has shape [2, 3, 8] and x [4, 3, 8]; allowed: each dim equal to x's or 1 (broadcast), the last "
     "dim equal to D"),
    ("sin_broadcast_on_d", lambda: OP(torch.randn(4, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 1), 0),
     PREFIX + "sin has shape [1, 3, 1] and x [4, 3, 8]; allowed: each dim equal to x's or 1"),
    ("dtype_mismatch", lambda: OP(torch.randn(2, 8), torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(1, 8), 0),
     PREFIX + "cos is BFloat16 and x Float; allowed: one dtype for x, cos and sin"),
    ("integer_x", lambda: OP(torch.ones(2, 8, dtype=torch.int64), torch.ones(1, 8, dtype=torch.int64),
                             torch.ones(1, 8, dtype=torch.int64), 0),
     PREFIX + "x is Long; allowed: float32, float64, bfloat16, float16"),
    ("backward_grad_shape", lambda: BWD(torch.randn(2, 4), torch.randn(2, 8), torch.randn(1, 8), torch.randn(1, 8), 0,
                                        [True, True, True]),
     "hypershard::rotary_position_embedding_backward: grad has shape [2, 4] and x [2, 8]; allowed: grad shaped "
     "like x"),
]


@pytest.mark.parametrize("name,call,message", [pytest.param(*r, id=r[0]) for r in ERRORS])
def test_errors(name, call, message):
    with pytest.raises(RuntimeError) as raised:
        call()
    assert message in str(raised.value), str(raised.value)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_errors_on_meta_too(device):
    # shapes-only calls (fake tensors, torch.compile) check the same arguments
    x, t = torch.empty(2, 6, device=device), torch.empty(1, 6, device=device)
    with pytest.raises(RuntimeError, match="must be divisible by 4 for mode 2"):
        OP(x, t, t, 2)
    assert OP(x, t, t, 0).shape == (2, 6)


def test_double_backward_raises():
    x, cos, sin, g = make_inputs((B, N, S, D), (1, 1, S, D), (1, 1, S, D), f64, seed=6)
    x.requires_grad_()
    y = OP(x, cos, sin, 0)
    with pytest.raises(RuntimeError, match="second derivative"):
        (dx,) = torch.autograd.grad(y, x, g, create_graph=True)
        torch.autograd.grad(dx.sum(), x)


# --- the checks can fail ----------------------------------------------------------------------

def _kernel_and_bound(dtype, mode=0, ref_mode=None):
    x, cos, sin, g = make_inputs((B, N, S, D), (1, 1, S, D), (1, 1, S, D), dtype, seed=7)
    y = OP(x, cos, sin, mode)
    y_ref = reference(x, cos, sin, g, mode if ref_mode is None else ref_mode)[0]
    terms = magnitudes(x, cos, sin, g, mode if ref_mode is None else ref_mode)[0]
    return y, y_ref, forward_bound(y_ref, terms, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_planted_fault_a_few_ulps_beyond_the_bound(dtype):
    y, y_ref, bound = _kernel_and_bound(dtype)
    assert_within(y, y_ref, bound, "unperturbed")
    assert_within(y_ref.to(dtype), y_ref, bound, "the reference rounded once")
    # move the element with the largest value away from the reference, one ulp at a time, until
    # it is two ulps beyond its bound
    i = int(y.abs().argmax())
    flat = y.flatten().clone()
    away = torch.tensor(math.copysign(math.inf, flat[i].item()), dtype=dtype)
    start = flat[i].item()
    steps = 0
    while abs(flat[i].item() - y_ref.flatten()[i].item()) <= bound.flatten()[i].item():
        flat[i] = torch.nextafter(flat[i], away)
        steps += 1
    for _ in range(2):
        flat[i] = torch.nextafter(flat[i], away)
    assert steps <= 8, steps  # the bound is a few ulps wide, not a loose tolerance
    assert flat[i].item() != start
    with pytest.raises(AssertionError, match="1 of 240 elements beyond their error bound"):
        assert_within(flat.view_as(y), y_ref, bound, "perturbed")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_planted_fault_wrong_sign_or_wrong_mode(dtype):
    x, cos, sin, g = make_inputs((B, N, S, D), (1, 1, S, D), (1, 1, S, D), dtype, seed=8)
    y_ref = reference(x, cos, sin, g, 0)[0]
    bound = forward_bound(y_ref, magnitudes(x, cos, sin, g, 0)[0], dtype)
    # one rotated term with its sign swapped: y[..., 0] = x0 cos0 + x[h] sin0 instead of - x[h] sin0
    half = D // 2
    wrong = (x.to(f64) * cos + torch.cat((x[..., half:], x[..., :half]), -1).to(f64) * sin)
    faulty = OP(x, cos, sin, 0).clone()
    faulty[..., 0] = wrong[..., 0].to(dtype)
    with pytest.raises(AssertionError, match="beyond their error bound"):
        assert_within(faulty, y_ref, bound, "sign swapped")
    # the mode 0 kernel against the mode 3 reference
    y, y_ref3, bound3 = _kernel_and_bound(dtype, mode=0, ref_mode=3)
    with pytest.raises(AssertionError, match="beyond their error bound"):
        assert_within(y, y_ref3, bound3, "mode 0 as mode 3")
