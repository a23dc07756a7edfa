"""UT: hypershard's autograd kernels for other libraries' ops (csrc/kernels/external_autograd.cpp)
and the torch_npu stand-ins the level0 tests use (hypershard.testing.fused), without processes.

- The stand-in backward kernels compute the true derivative: npu_rms_norm_backward and
  npu_rotary_mul_backward against torch's autograd of the composed forms, in float64 (the rms
  backward computes in float32 -- its bound is argued at `test_npu_rms_norm_backward_is_the_derivative`);
  a wrong formula (dx's mean term dropped, the rotation taken for its own transpose) is outside
  the same bound.
- The kernels are registered before the ops exist: in a fresh interpreter that imports hypershard
  first, npu::npu_rms_norm, npu::npu_rotary_mul (also with the older schema without rotary_mode)
  and transformers::grouped_mm_fallback defined afterwards have a kernel at AutogradPrivateUse2,
  and defining them raises nothing (the kernels are boxed: no signature to clash with the schema).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from hypershard import ops
from hypershard.testing import fused

EPS = 1e-6


def _rms_inputs(shape, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    gamma = 1 + 0.5 * torch.randn(shape[len(shape) - k:], generator=gen, dtype=torch.float64)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    return x, gamma, dy


def _rms_exact(x, gamma, dy):
    """dx, dgamma by torch's autograd of x * rsqrt(mean(x^2) + eps) * gamma in float64."""
    x, gamma = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + EPS) * gamma
    return torch.autograd.grad(y, (x, gamma), dy)


def _rms_bound(x, gamma, dy):
    """The float32 kernel's error: n + 8 roundings of 2^-24 (h, u, u * h, the mean's n - 1 sums and
    its division, h * mean, the difference, the factor rstd; rstd itself is given exactly) relative
    to dx's magnitude M = r |dy gamma| + r^3 |x| mean(|dy gamma x|), plus float32's input roundings
    (3 more); dgamma: R + 3 roundings relative to the sum of |dy x r| over the R leading rows. Twice
    that, element-wise."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    lead = tuple(range(x.dim() - gamma.dim()))
    n = gamma.numel()
    r = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + EPS)
    m = r * (dy * gamma).abs() + r ** 3 * x.abs() * (dy * gamma * x).abs().mean(dims, keepdim=True)
    rows = x.numel() // n
    t = (dy * x * r).abs().sum(lead) if lead else (dy * x * r).abs()
    return 2 * (n + 11) * 2.0 ** -24 * m, 2 * (rows + 3) * 2.0 ** -24 * t, r


@pytest.mark.parametrize("shape,k", [((3, 5, 8), 1), ((4, 16), 1), ((2, 3, 4, 6), 2)])
def test_npu_rms_norm_backward_is_the_derivative(shape, k):
    x, gamma, dy = _rms_inputs(shape, k, seed=sum(shape))
    dx_bound, dgamma_bound, rstd = _rms_bound(x, gamma, dy)
    want_dx, want_dgamma = _rms_exact(x, gamma, dy)
    dx, dgamma = fused.npu_rms_norm_backward_cpu(dy.float(), x.float(), gamma.float(), rstd.float())
    # float32 inputs: their roundings are inside the bound (the +3 above); rstd rounded once more
    fused.assert_within(dx, want_dx, dx_bound, "dx")
    fused.assert_within(dgamma, want_dgamma, dgamma_bound, "dgamma")
    # planted: dx without its mean term is far outside the same bound
    wrong = (rstd * dy * gamma).float()
    with pytest.raises(AssertionError, match="dx: .* beyond their error bound"):
        fused.assert_within(wrong, want_dx, dx_bound, "dx")


@pytest.mark.parametrize("rotary_mode", ["half", "interleave"])
@pytest.mark.parametrize("table_shape", [(1, 1, 7, 8), (3, 5, 7, 8), (1, 5, 7, 8)])
def test_npu_rotary_mul_backward_is_the_derivative(rotary_mode, table_shape):
    """float64 throughout: a few roundings of 2^-53 apart at most, checked with float64's default
    tolerance of torch.testing (rtol 1e-7, atol 1e-7)."""
    gen = torch.Generator().manual_seed(len(table_shape) + sum(table_shape))
    x = torch.randn(3, 5, 7, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    r1 = torch.randn(table_shape, generator=gen, dtype=torch.float64, requires_grad=True)
    r2 = torch.randn(table_shape, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 7, 8, generator=gen, dtype=torch.float64)
    y = ops.rotary_position_embedding_composed(x, r1, r2, ops.MODES[rotary_mode])
    want = torch.autograd.grad(y, (x, r1, r2), g)
    got = fused.npu_rotary_mul_backward_cpu(g, x.detach(), r1.detach(), r2.detach(), rotary_mode)
    for name, a, b in zip(("dx", "dr1", "dr2"), got, want):
        torch.testing.assert_close(a, b, msg=name)
    # planted: the rotation taken for its own transpose gives another dx
    wrong = g * r1 + fused.rotate(g * r2, rotary_mode)
    assert not torch.allclose(wrong, want[0])
    # and the forward stand-in is the composed form
    torch.testing.assert_close(fused.npu_rotary_mul_cpu(x, r1, r2, rotary_mode), y, rtol=0, atol=0)


_REGISTRATION_PROBE = textwrap.dedent("""
    import torch
    import hypershard  # registers its kernels before the ops below exist
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    lib = torch.library.Library("npu", "DEF")
    lib.define("npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)")
    lib.define("npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)")
    lib.define("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2) -> Tensor")  # older torch_npu: no rotary_mode
    lib.define("npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2) -> (Tensor, Tensor, Tensor)")
    import transformers.integrations.moe  # defines transformers::grouped_mm_fallback
    for name in ("npu::npu_rms_norm", "npu::npu_rms_norm_backward", "npu::npu_rotary_mul",
                 "npu::npu_rotary_mul_backward", "transformers::grouped_mm_fallback"):
        assert has(name, "AutogradPrivateUse2"), name
    # a plain tensor does not reach them: transformers' own autograd still serves it
    x, w = torch.randn(5, 4, requires_grad=True), torch.randn(2, 4, 3, requires_grad=True)
    y = torch.ops.transformers.grouped_mm_fallback(x, w, torch.tensor([2, 5], dtype=torch.int32))
    assert "GroupedMmFallback" not in y.grad_fn.name(), y.grad_fn.name()
    print("ok")
""")


def test_kernels_registered_before_the_ops_are_defined():
    result = subprocess.run([sys.executable, "-c", _REGISTRATION_PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
