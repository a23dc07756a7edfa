"""UT: the fused RMSNorm kernel (csrc/kernels/rms_norm.cpp) on plain CPU tensors, and the same
op's kernel for other devices (csrc/kernels/composite.cpp, ATen ops; called at its dispatch key
here) against the same bounds.

y, rstd and the two gradients (dx, dweight) for x in float32 / bfloat16 / float16 / float64 with a
weight of x's dtype (and a float32 weight with bfloat16 x: y is float32 then, as in HF's RMSNorm),
over one and two normalized dims, against a float64 reference (autograd of
``x * rsqrt(mean(x**2) + eps) * w``) evaluated on the SAME rounded inputs. Each element is checked
against an error bound derived from the arithmetic the kernel promises -- every product and sum in
float (double for double x), one rounding to the output dtype at the end -- not against a
tolerance tuned on one CPU; see `rstd_rel`, `y_bound`, `dx_bound`, `dweight_bound`. The composed
form (HF's RMSNorm written out, hypershard.ops.rms_norm_composed) rounds the normalized value to
x's dtype before the weight multiply: `composed_y_bound` states its error and the fused op must
agree with it within the two bounds. Planted faults show the bound checks reject wrong results.
Also: gradcheck in float64, the output mask, non-contiguous inputs, errors (on meta too), an empty
batch, first derivatives with create_graph=True (only a second derivative raises), an empty
normalized dim (weight (0,): rstd is NaN, the mean of nothing, as the composed form's).
"""

from __future__ import annotations

import math
import zlib

import hypershard.ops as hops
import pytest
import torch

from hypershard.testing.fused import assert_within

FWD = torch.ops.hypershard.rms_norm.default
BWD = torch.ops.hypershard.rms_norm_backward.default
f64, f32, bf16, f16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
EPS = 1e-6

# (x dtype, weight dtype): the weight of x's dtype, and HF's float32 weight with bfloat16 x
DTYPES = [(f32, f32), (bf16, bf16), (f16, f16), (f64, f64), (bf16, f32)]


DTYPE_PARAMS = [pytest.param(x, w, id="-".join(str(d).replace("torch.", "") for d in (x, w))) for x, w in DTYPES]


# Unit roundoff u = 2^-p of round-to-nearest, p the significand bits counting the implicit one
# (bf16 p = 8, fp16 p = 11, fp32 p = 24, fp64 p = 53): |fl(v) - v| <= u |v| for a normal result.
UNIT = {bf16: 2.0 ** -8, f16: 2.0 ** -11, f32: 2.0 ** -24, f64: 2.0 ** -53}
# Where a result is subnormal the rounding error is absolute instead: at most half the smallest
# subnormal (fp16 2^-24, bf16 2^-133, fp32 2^-149, fp64 2^-1074). So |fl(v) - v| <= u |v| + eta.
ETA = {bf16: 2.0 ** -134, f16: 2.0 ** -25, f32: 2.0 ** -150, f64: 2.0 ** -1075}
# The kernel's arithmetic type ("opmath"): float for the 16-bit types and float32, double for double.
OPMATH = {bf16: f32, f16: f32, f32: f32, f64: f64}


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): a value made of n roundings (of products, or of the
    additions on any path of a sum's tree) is within gamma_n of the exact one, relative to the sum
    of the absolute terms: prod (1 + d_i)^(+-1) over n factors lies in [1 - gamma_n, 1 + gamma_n]."""
    return n * u / (1 - n * u)


def rstd_rel(n: int, u: float, extra: int = 0) -> float:
    """Relative error of rstd = 1 / sqrt(sum(x^2) / n + eps) computed in a type of unit u, against
    the exact value with eps = 1e-6 (a double).

    sum(x^2): n products and n - 1 additions, all terms >= 0, so the computed sum is S (1 + t),
    |t| <= gamma_n. Dividing by n, rounding eps to the type and adding it: three more roundings,
    each on a term <= V = S/n + eps, so the computed V is V (1 + eta) with |eta| <= gamma_(n+2)
    (+ `extra` roundings: the composed form's mean and casts). sqrt halves it: |sqrt(1 + eta) - 1|
    = |eta| / (1 + sqrt(1 + eta)) <= |eta| / (1 + sqrt(1 - |eta|)) = sigma. sqrt and 1 / s are
    correctly rounded (one u each): rstd = r (1 + d5) / ((1 + s') (1 + d4)), |s'| <= sigma, so
    |rstd / r - 1| <= (1 + u) / ((1 - sigma) (1 - u)) - 1. (The squares never underflow: the inputs
    here have |x| >= 2^-60, x^2 >= 2^-120 is a normal float.)"""
    eta = gamma(n + 2 + extra, u)
    sigma = eta / (1 + math.sqrt(1 - eta))
    return (1 + u) / ((1 - sigma) * (1 - u)) - 1


def ref_rel(n: int, rows: int = 1) -> float:
    """A generous bound on the relative error (against the magnitudes) of the float64 reference's
    gradients: torch's float64 ops do the same arithmetic in another order (pow, mean, add, rsqrt
    as 1/sqrt, mul, and autograd's chain rule), at most n + rows + 20 roundings on any path and
    three rstd factors: (1 + rho)^3 (1 + gamma_(n+rows+20)) - 1 with u = 2^-53 (about 1e-14 here:
    negligible beside float's errors, and still a bound for float64 x)."""
    rho = rstd_rel(n, UNIT[f64], extra=4)
    return (1 + rho) ** 3 * (1 + gamma(n + rows + 20, UNIT[f64])) - 1


def ref_value_rel(n: int) -> float:
    """The float64 reference's y (and rstd): x.pow(2) one rounding per square, mean a sum and a
    division (counted as 2), + eps, rsqrt as 1/sqrt, then x * r * w two roundings:
    (1 + rho)(1 + u)^2 - 1 with rho = rstd_rel(n, 2^-53, extra=1)."""
    return (1 + rstd_rel(n, UNIT[f64], extra=1)) * (1 + UNIT[f64]) ** 2 - 1


def final_rounding(acc_bound: torch.Tensor, ref: torch.Tensor, ref_err: torch.Tensor, dtype) -> torch.Tensor:
    """|out - ref| for out = fl_dtype(v): the opmath error `acc_bound` of v against the exact value,
    the reference's own `ref_err`, and the one final rounding u |v| + eta, where |v| <= |ref| +
    ref_err + acc_bound. (For float32 / float64 outputs the kernel does not round again; the bound
    counts one rounding anyway.)"""
    u = UNIT[dtype]
    return acc_bound + ref_err + u * (ref.abs() + ref_err + acc_bound) + ETA[dtype]


def y_bound(y_ref, w, n, x_dtype, out_dtype):
    """y = fl_out(fl(fl(x rstd) w)) in opmath: (1 + rho)(1 + u)^2 of the exact x r w, then one
    rounding to y's dtype; each of the two products may underflow by eta_acc (times |w| for the
    first)."""
    acc = OPMATH[x_dtype]
    rel = (1 + rstd_rel(n, UNIT[acc])) * (1 + UNIT[acc]) ** 2 - 1
    magnitude = y_ref.abs() * (1 + ref_value_rel(n))
    acc_bound = rel * magnitude + (w.abs().to(f64) + 1) * ETA[acc]
    return final_rounding(acc_bound, y_ref, ref_value_rel(n) * magnitude, out_dtype)


def rstd_bound(r_ref, n, x_dtype):
    """rstd is returned in opmath without another rounding."""
    rho = rstd_rel(n, UNIT[OPMATH[x_dtype]])
    return (rho + ref_value_rel(n)) * r_ref.abs() * (1 + ref_value_rel(n))


def dx_bound(dx_ref, x, w, g, r_ref, dims, x_dtype):
    """dx = r (g w - h mean(g w h)), h = x r, i.e. A - B with A = r g w and B = r^3 x mean(g w x).

    The kernel: A = fl(rstd fl(fl(g w) - fl(h mean))): the rstd factor and three roundings,
    (1 + rho)(1 + u)^3. B: h = fl(x rstd) (rho, 1 rounding); each term of the dot product
    fl(fl(fl(g w) x) rstd) (rho, 3 roundings), summed (n - 1 additions), divided by n (1), times h
    (1), subtracted (1), times rstd (rho, 1): (1 + rho)^3 (1 + gamma_(n+7)) on each of B's terms.
    So |dx_acc - dx| <= ((1 + rho)(1 + u)^3 - 1) |A| + ((1 + rho)^3 (1 + gamma_(n+7)) - 1) M_B with
    M_B = r^3 |x| mean(|g w x|), then one rounding to x's dtype."""
    acc = OPMATH[x_dtype]
    u, n = UNIT[acc], w.numel()
    rho = rstd_rel(n, u)
    r = r_ref.abs() * (1 + ref_rel(n))
    x64, w64, g64 = (t.to(f64).abs() for t in (x, w, g))
    mag_a = r * g64 * w64
    mag_b = r ** 3 * x64 * (g64 * w64 * x64).mean(dims, keepdim=True)
    acc_bound = (((1 + rho) * (1 + u) ** 3 - 1) * mag_a + ((1 + rho) ** 3 * (1 + gamma(n + 7, u)) - 1) * mag_b
                 + (2 * n + 8) * ETA[acc] * (1 + r) ** 3 * (1 + g64.max() * w64.max() * x64.max()))
    return final_rounding(acc_bound, dx_ref, ref_rel(n) * (mag_a + mag_b), x_dtype)


def dweight_bound(dw_ref, x, w, g, r_ref, x_dtype):
    """dweight = sum over the leading dims of g h: each term fl(fl(g x) rstd) (rho, 2 roundings),
    stored in opmath, summed over the `rows` leading positions by at::sum in opmath (any order:
    rows - 1 additions), then one rounding to the weight's dtype:
    |dw_acc - dw| <= ((1 + rho)(1 + gamma_(rows+1)) - 1) sum |g x| r."""
    acc = OPMATH[x_dtype]
    u, n = UNIT[acc], w.numel()
    rows = x.numel() // n
    rho = rstd_rel(n, u)
    r = r_ref.abs() * (1 + ref_rel(n))
    terms = (g.to(f64).abs() * x.to(f64).abs() * r).sum_to_size(w.shape)
    acc_bound = ((1 + rho) * (1 + gamma(rows + 1, u)) - 1) * terms + rows * 2 * ETA[acc]
    return final_rounding(acc_bound, dw_ref, ref_rel(n, rows) * terms, w.dtype)


def composed_y_bound(y_ref, x_dtype, out_dtype, n):
    """HF's form: h = x.float(); var = h.pow(2).mean(-1); h = h * rsqrt(var + eps); w * h.to(x.dtype).

    All in float32 (u = 2^-24) whatever x's dtype: float64 x is rounded to float32 first (2 more
    roundings in var via x^2, 1 more in h). mean may divide or multiply by 1/n (count 2), torch's
    CPU rsqrt is 1 / sqrt (two correct roundings, as `rstd_rel` counts), h * rstd one rounding,
    the cast back to x's dtype one rounding of x's dtype (none for float32 / float64), the weight
    multiply one rounding of y's dtype. So
        |composed - y| <= ((1 + rho_c)(1 + u)^(1+e)(1 + u_x)(1 + u_y) - 1) |y| (+ underflow),
    rho_c = rstd_rel(n, u, extra = 1 + 2e), e = 1 for float64 x. For bf16 this is about two bf16
    roundings: twice the fused op's one."""
    e = 1 if x_dtype == f64 else 0
    u = UNIT[f32]
    rho_c = rstd_rel(n, u, extra=1 + 2 * e)
    u_x = UNIT[x_dtype] if x_dtype in (bf16, f16) else 0.0
    rel = (1 + rho_c) * (1 + u) ** (1 + e) * (1 + u_x) * (1 + UNIT[out_dtype]) - 1
    magnitude = y_ref.abs() * (1 + ref_value_rel(n))
    return rel * magnitude + ref_value_rel(n) * magnitude + 4 * (ETA[f32] + ETA[x_dtype] + ETA[out_dtype])


# --- inputs and the reference ----------------------------------------------------------------------

def make_inputs(x_shape, k, x_dtype, w_dtype, seed, scale=1.0):
    """x (rows scaled by 0.1 .. 10, so rstd varies), weight 1 + 0.5 randn (HF weights start at 1),
    and the cotangent g in y's dtype; every value rounded to its dtype once."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=gen, dtype=f64)
    lead = list(x_shape[:len(x_shape) - k]) + [1] * k
    x = x * torch.exp(torch.rand(lead, generator=gen, dtype=f64) * math.log(100)) / 10 * scale
    x = x.to(x_dtype)
    assert bool((x.abs() >= 2.0 ** -60).all())  # no square underflows (see rstd_rel)
    w = (1 + 0.5 * torch.randn(x_shape[len(x_shape) - k:], generator=gen, dtype=f64)).to(w_dtype)
    g = torch.randn(x_shape, generator=gen, dtype=f64).to(torch.result_type(x, w))
    return x, w, g


def reference(x, w, g, k, eps=EPS, mean_count=None):
    """float64 autograd of x * rsqrt(mean(x^2 over the last k dims) + eps) * w on the given values:
    y, rstd, dx, dweight. `mean_count` (planted faults) divides the sum of squares by another n."""
    x64, w64 = (t.detach().to(f64).requires_grad_() for t in (x, w))
    dims = tuple(range(-k, 0))
    if mean_count is None:
        ms = x64.pow(2).mean(dims, keepdim=True)
    else:
        ms = x64.pow(2).sum(dims, keepdim=True) / mean_count
    r = torch.rsqrt(ms + eps)
    y = x64 * r * w64
    dx, dw = torch.autograd.grad(y, (x64, w64), g.to(f64))
    return y.detach(), r.detach(), dx, dw


def run_kernel(x, w, g, eps=EPS, kernel="cpu"):
    """y, rstd, dx, dweight: through autograd and the CPU kernel, or ("composite") the ops' kernel
    for every other device (csrc/kernels/composite.cpp: CUDA, NPU), called at its dispatch key."""
    if kernel == "composite":
        key = torch._C.DispatchKey.CompositeExplicitAutograd
        y, rstd = FWD._op_dk(key, x, w, eps)
        dx, dw = BWD._op_dk(key, g, x, w, rstd, [True, True])
        return y, rstd, dx, dw
    xs, ws = (t.detach().clone().requires_grad_() for t in (x, w))
    y, rstd = FWD(xs, ws, eps)
    y.backward(g)
    return y.detach(), rstd, xs.grad, ws.grad


KERNELS = ["cpu", "composite"]


# (id, x shape, normalized dims k)
SHAPES = [
    ("bsh_h16", (3, 5, 16), 1),
    ("bsh_h64", (2, 4, 64), 1),
    ("rank1_h24", (24,), 1),                 # no leading dims: dweight is not a sum
    ("bsh_weight_sh", (3, 4, 8), 2),         # weight (S, H): n = 32, rstd (B, 1, 1)
    ("bsnd_weight_nd", (2, 3, 4, 8), 2),     # weight (N, D)
    ("many_rows_h8", (16, 12, 8), 1),        # dweight sums 192 rows
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("name,x_shape,k", [pytest.param(*r, id=r[0]) for r in SHAPES])
def test_output_and_gradients_within_bounds(name, x_shape, k, x_dtype, w_dtype, kernel):
    x, w, g = make_inputs(x_shape, k, x_dtype, w_dtype, seed=zlib.crc32(f"{name}:{x_dtype}:{w_dtype}".encode()))
    y, rstd, dx, dw = run_kernel(x, w, g, kernel=kernel)
    out_dtype = torch.result_type(x, w)
    assert y.dtype == out_dtype and y.shape == x.shape
    assert rstd.dtype == OPMATH[x_dtype]
    assert rstd.shape == x.shape[:x.dim() - k] + (1,) * k
    assert dx.dtype == x_dtype and dw.dtype == w_dtype and dw.shape == w.shape
    y_ref, r_ref, dx_ref, dw_ref = reference(x, w, g, k)
    n, dims = w.numel(), tuple(range(-k, 0))
    assert_within(y, y_ref, y_bound(y_ref, w, n, x_dtype, out_dtype), "y")
    assert_within(rstd, r_ref, rstd_bound(r_ref, n, x_dtype), "rstd")
    assert_within(dx, dx_ref, dx_bound(dx_ref, x, w, g, r_ref, dims, x_dtype), "dx")
    assert_within(dw, dw_ref, dweight_bound(dw_ref, x, w, g, r_ref, x_dtype), "dweight")


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PARAMS)
def test_tiny_values_where_eps_matters(x_dtype, w_dtype):
    # x ~ 1e-3: mean(x^2) ~ eps, so eps is half of what rstd sees (the bounds cover eps's rounding)
    x, w, g = make_inputs((4, 32), 1, x_dtype, w_dtype, seed=11, scale=1e-3)
    y, rstd, dx, dw = run_kernel(x, w, g)
    y_ref, r_ref, dx_ref, dw_ref = reference(x, w, g, 1)
    assert_within(y, y_ref, y_bound(y_ref, w, 32, x_dtype, y.dtype), "y")
    assert_within(rstd, r_ref, rstd_bound(r_ref, 32, x_dtype), "rstd")
    assert_within(dx, dx_ref, dx_bound(dx_ref, x, w, g, r_ref, (-1,), x_dtype), "dx")
    assert_within(dw, dw_ref, dweight_bound(dw_ref, x, w, g, r_ref, x_dtype), "dweight")


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PARAMS)
def test_fused_agrees_with_the_composed_form(x_dtype, w_dtype):
    """Both forms within their own bounds of the float64 value, hence of each other:
    |fused - composed| <= y_bound + composed_y_bound. In bf16 the composed form's second rounding
    shows: over 16384 elements it leaves the fused op's one-rounding bound somewhere."""
    x, w, _ = make_inputs((64, 256), 1, x_dtype, w_dtype, seed=12)
    fused = hops.rms_norm(x, w, EPS)
    composed = hops.rms_norm_composed(x, w, EPS)
    assert fused.dtype == composed.dtype == torch.result_type(x, w)
    y_ref = reference(x, w, torch.zeros_like(fused), 1)[0]
    out_dtype = fused.dtype
    fused_bound = y_bound(y_ref, w, 256, x_dtype, out_dtype)
    composed_bound = composed_y_bound(y_ref, x_dtype, out_dtype, 256)
    assert_within(fused, y_ref, fused_bound, "fused")
    assert_within(composed, y_ref, composed_bound, "composed")
    err = (fused.to(f64) - composed.to(f64)).abs()
    assert bool((err <= fused_bound + composed_bound).all())
    if (x_dtype, w_dtype) == (bf16, bf16):
        with pytest.raises(AssertionError, match="beyond their error bound"):
            assert_within(composed, y_ref, fused_bound, "composed under the fused bound")


def test_weight_dtypes_promote_like_hf():
    # y takes torch's promotion of x and weight, the gradients their own inputs' dtypes
    for x_dtype, w_dtype in ((bf16, f32), (f16, f32), (f32, bf16), (bf16, f16)):
        x, w, _ = make_inputs((2, 8), 1, x_dtype, w_dtype, seed=13)
        y, rstd = FWD(x, w, EPS)
        assert y.dtype == torch.result_type(x, w) == hops.rms_norm_composed(x, w).dtype
        assert rstd.dtype == f32


def test_eps_is_used():
    x, w, g = make_inputs((4, 16), 1, f32, f32, seed=14, scale=1e-3)
    for eps in (1e-6, 1e-5, 0.5):
        y, rstd, _, _ = run_kernel(x, w, g, eps)
        y_ref, r_ref, _, _ = reference(x, w, g, 1, eps=eps)
        # eps = 1e-6 is covered by rstd_rel; larger eps only shrinks the relative error further
        assert_within(rstd, r_ref, rstd_bound(r_ref, 16, f32), f"rstd eps={eps}")
        assert_within(y, y_ref, y_bound(y_ref, w, 16, f32, f32), f"y eps={eps}")
    assert torch.equal(FWD(x, w)[0], FWD(x, w, 1e-6)[0])   # the schema's default eps


def test_backward_op_output_mask():
    x, w, g = make_inputs((3, 5, 16), 1, f32, f32, seed=15)
    rstd = FWD(x, w, EPS)[1]
    full = BWD(g, x, w, rstd, [True, True])
    dx, dw = BWD(g, x, w, rstd, [True, False])
    assert torch.equal(dx, full[0]) and dw is None
    dx, dw = BWD(g, x, w, rstd, [False, True])
    assert dx is None and torch.equal(dw, full[1])


def test_non_contiguous_inputs():
    # x a transposed view, the (S, H) weight a transposed view, g expanded (stride 0)
    x_t, _, _ = make_inputs((3, 8, 6), 2, f32, f32, seed=16)
    x = x_t.transpose(1, 2)                                  # (3, 6, 8), not contiguous
    w = (1 + 0.5 * torch.randn(8, 6, generator=torch.Generator().manual_seed(1))).t()   # (6, 8)
    g = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(2)).expand(3, 6, 8)
    assert not x.is_contiguous() and not w.is_contiguous()
    y, rstd = FWD(x, w, EPS)
    y_c, rstd_c = FWD(x.contiguous(), w.contiguous(), EPS)
    assert torch.equal(y, y_c) and torch.equal(rstd, rstd_c)
    got = BWD(g, x, w, rstd, [True, True])
    want = BWD(g.contiguous(), x.contiguous(), w.contiguous(), rstd, [True, True])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("x_shape,w_shape", [((2, 3, 6), (6,)), ((2, 3, 4), (3, 4)), ((5,), (5,))],
                         ids=["one_dim", "two_dims", "rank1"])
def test_gradcheck_float64(x_shape, w_shape):
    gen = torch.Generator().manual_seed(20)
    x = torch.randn(x_shape, generator=gen, dtype=f64, requires_grad=True)
    w = (1 + 0.5 * torch.randn(w_shape, generator=gen, dtype=f64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: FWD(a, b, EPS)[0], (x, w))


def test_empty_batch():
    x = torch.randn(0, 3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    y, rstd = FWD(x, w, EPS)
    assert y.shape == (0, 3, 8) and rstd.shape == (0, 3, 1)
    y.backward(torch.randn(0, 3, 8))
    assert x.grad.shape == (0, 3, 8)
    assert w.grad.shape == (8,) and not w.grad.any()
    assert hops.rms_norm(torch.randn(0, 8, dtype=bf16), torch.randn(8, dtype=bf16)).shape == (0, 8)


def test_empty_normalized_dim_rstd_is_defined():
    # x (2, 3, 0) with weight (0,): y is empty but rstd (2, 3, 1) has 6 elements. The mean of no
    # squares is 0/0 (the composed form's NaN); 1/sqrt(eps) would also be a defined choice.
    # Garbage from at::empty is neither.
    for _ in range(3):
        junk = torch.full((4096,), 12345.0) * 2   # leaves non-zero memory for the allocator to reuse
        del junk
        rstd = FWD(torch.randn(2, 3, 0), torch.randn(0), EPS)[1]
        assert rstd.shape == (2, 3, 1)
        composed = torch.rsqrt(torch.randn(2, 3, 0).pow(2).mean(-1, keepdim=True) + EPS)
        assert bool(composed.isnan().all())
        assert bool(rstd.isnan().all()) or bool((rstd == 1 / math.sqrt(EPS)).all()), rstd.flatten().tolist()


PREFIX = "hypershard::rms_norm: "
ERRORS = [
    ("weight_not_trailing", lambda: FWD(torch.randn(2, 8), torch.randn(6), EPS),
     PREFIX + "x has shape [2, 8] and weight [6]; allowed: weight of rank >= 1 with the shape of x's last "
     "weight.dim() dims"),
    ("weight_dims_swapped", lambda: FWD(torch.randn(2, 6, 8), torch.randn(8, 6), EPS),
     PREFIX + "x has shape [2, 6, 8] and weight [8, 6]"),
    ("weight_rank0", lambda: FWD(torch.randn(2, 8), torch.tensor(1.0), EPS),
     PREFIX + "x has shape [2, 8] and weight []"),
    ("weight_longer_than_x", lambda: FWD(torch.randn(8), torch.randn(2, 8), EPS),
     PREFIX + "x has shape [8] and weight [2, 8]"),
    ("integer_x", lambda: FWD(torch.ones(2, 8, dtype=torch.int64), torch.ones(8), EPS),
     PREFIX + "x is Long and weight Float; allowed: floating dtypes"),
    ("integer_weight", lambda: FWD(torch.ones(2, 8), torch.ones(8, dtype=torch.int32), EPS),
     PREFIX + "x is Float and weight Int; allowed: floating dtypes"),
    ("backward_grad_shape", lambda: BWD(torch.randn(2, 7), torch.randn(2, 8), torch.randn(8), torch.ones(2, 1),
                                        [True, True]),
     "hypershard::rms_norm_backward: grad has shape [2, 7] and x [2, 8]; allowed: grad shaped like x"),
    ("backward_rstd_shape", lambda: BWD(torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), torch.ones(3, 1),
                                        [True, True]),
     "hypershard::rms_norm_backward: rstd has shape [3, 1]; allowed: x's shape with the normalized dims 1"),
    ("backward_weight_shape", lambda: BWD(torch.randn(2, 8), torch.randn(2, 8), torch.randn(4), torch.ones(2, 1),
                                          [True, True]),
     PREFIX + "x has shape [2, 8] and weight [4]"),
]


@pytest.mark.parametrize("name,call,message", [pytest.param(*r, id=r[0]) for r in ERRORS])
def test_errors(name, call, message):
    with pytest.raises(RuntimeError) as raised:
        call()
    assert message in str(raised.value), str(raised.value)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_errors_and_shapes_on_meta_too(device):
    # shapes-only calls (fake tensors, torch.compile) check the same arguments and give the same shapes
    x, w = torch.empty(2, 3, 8, device=device, dtype=bf16), torch.empty(3, 8, device=device, dtype=f32)
    with pytest.raises(RuntimeError, match="x has shape \\[2, 3, 8\\] and weight \\[6\\]"):
        FWD(x, torch.empty(6, device=device), EPS)
    y, rstd = FWD(x, w, EPS)
    assert (y.shape, y.dtype, rstd.shape, rstd.dtype) == ((2, 3, 8), f32, (2, 1, 1), f32)
    dx, dw = BWD(torch.empty(2, 3, 8, device=device, dtype=f32), x, w, rstd, [True, True])
    assert (dx.shape, dx.dtype, dw.shape, dw.dtype) == ((2, 3, 8), bf16, (3, 8), f32)


def test_first_order_with_create_graph_then_second_derivative_raises():
    x, w, g = make_inputs((3, 4, 8), 1, f64, f64, seed=21)
    x.requires_grad_()
    w.requires_grad_()
    y = FWD(x, w, EPS)[0]
    plain = torch.autograd.grad(y, (x, w), g, retain_graph=True)
    # create_graph=True is allowed: the first derivatives are the same values ...
    dx, dw = torch.autograd.grad(y, (x, w), g, create_graph=True)
    assert torch.equal(dx, plain[0]) and torch.equal(dw, plain[1])
    assert dx.requires_grad and dw.requires_grad
    # ... and only a second derivative through them raises
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(dx.sum(), x, retain_graph=True)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad((dw * dw).sum(), w, retain_graph=True)
    # a graph that uses the first derivatives only as constants still works
    (loss_grad,) = torch.autograd.grad((y * dx.detach()).sum(), x)
    assert loss_grad.shape == x.shape


# --- the checks can fail ----------------------------------------------------------------------

def _y_and_bound(x_dtype, w_dtype, shape=(2, 3, 8), k=1, seed=30, **ref_kwargs):
    x, w, g = make_inputs(shape, k, x_dtype, w_dtype, seed=seed)
    y = FWD(x, w, EPS)[0]
    y_ref = reference(x, w, g, k, **ref_kwargs)[0]
    return x, w, g, y, y_ref, y_bound(y_ref, w, w.numel(), x_dtype, y.dtype)


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PARAMS)
def test_planted_fault_a_few_ulps_beyond_the_bound(x_dtype, w_dtype):
    x, w, _, y, y_ref, bound = _y_and_bound(x_dtype, w_dtype)
    assert_within(y, y_ref, bound, "unperturbed")
    assert_within(y_ref.to(y.dtype), y_ref, bound, "the reference rounded once")
    # move the element with the largest value away from the reference, one ulp at a time, until
    # it is two ulps beyond its bound
    i = int(y.abs().argmax())
    flat = y.flatten().clone()
    away = torch.tensor(math.copysign(math.inf, flat[i].item()), dtype=y.dtype)
    start = flat[i].item()
    steps = 0
    while abs(flat[i].item() - y_ref.flatten()[i].item()) <= bound.flatten()[i].item():
        flat[i] = torch.nextafter(flat[i], away)
        steps += 1
    for _ in range(2):
        flat[i] = torch.nextafter(flat[i], away)
    # the bound is about n/2 + 6 roundings of opmath wide (plus the float64 reference's own for
    # float64): a few output ulps, not a loose tolerance
    assert steps <= {bf16: 3, f16: 3, f32: 20, f64: 30}[y.dtype], steps
    assert flat[i].item() != start
    with pytest.raises(AssertionError, match="1 of 48 elements beyond their error bound"):
        assert_within(flat.view_as(y), y_ref, bound, "perturbed")


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PARAMS)
def test_planted_fault_wrong_mean_count(x_dtype, w_dtype):
    # the kernel against a reference that divides the sum of squares by n + 1 (or n - 1)
    for count in (9, 7):
        *_, y, y_ref, bound = _y_and_bound(x_dtype, w_dtype, mean_count=count)
        with pytest.raises(AssertionError, match="beyond their error bound"):
            assert_within(y, y_ref, bound, f"mean over {count}")


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PARAMS)
def test_planted_fault_eps_dropped_or_wrong_dims(x_dtype, w_dtype):
    # tiny x: a reference without eps is far from the kernel's y
    x, w, g = make_inputs((4, 32), 1, x_dtype, w_dtype, seed=31, scale=1e-3)
    y = FWD(x, w, EPS)[0]
    y_ref = reference(x, w, g, 1, eps=0.0)[0]
    with pytest.raises(AssertionError, match="beyond their error bound"):
        assert_within(y, y_ref, y_bound(y_ref, w, 32, x_dtype, y.dtype), "eps dropped")
    # a (S, H) weight normalized over H alone
    x, w, g = make_inputs((2, 3, 8), 2, x_dtype, w_dtype, seed=32)
    y = FWD(x, w, EPS)[0]
    x64 = x.to(f64)
    wrong = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w.to(f64)
    with pytest.raises(AssertionError, match="beyond their error bound"):
        assert_within(y, wrong, y_bound(wrong, w, 24, x_dtype, y.dtype), "normalized over H only")


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PARAMS)
def test_planted_fault_gradients(x_dtype, w_dtype):
    x, w, g = make_inputs((3, 5, 16), 1, x_dtype, w_dtype, seed=33)
    _, _, dx, dw = run_kernel(x, w, g)
    y_ref, r_ref, dx_ref, dw_ref = reference(x, w, g, 1)
    dx_b = dx_bound(dx_ref, x, w, g, r_ref, (-1,), x_dtype)
    dw_b = dweight_bound(dw_ref, x, w, g, r_ref, x_dtype)
    assert_within(dx, dx_ref, dx_b, "dx")
    assert_within(dw, dw_ref, dw_b, "dweight")
    # dx without the projection term (rstd g w alone)
    no_projection = (r_ref * g.to(f64) * w.to(f64)).to(x_dtype)
    with pytest.raises(AssertionError, match="beyond their error bound"):
        assert_within(no_projection, dx_ref, dx_b, "dx without the mean term")
    # dweight summed from the rows of another cotangent (g shifted by one row of S)
    shifted = (g.to(f64).roll(1, dims=1) * x.to(f64) * r_ref).sum((0, 1)).to(w.dtype)
    with pytest.raises(AssertionError, match="beyond their error bound"):
        assert_within(shifted, dw_ref, dw_b, "dweight from shifted rows")
    # dweight missing one batch row's contribution
    partial_sum = (g.to(f64) * x.to(f64) * r_ref)[1:].sum((0, 1)).to(w.dtype)
    with pytest.raises(AssertionError, match="beyond their error bound"):
        assert_within(partial_sum, dw_ref, dw_b, "dweight missing a row")
