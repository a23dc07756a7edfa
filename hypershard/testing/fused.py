"""Shared by the tests of hypershard's fused ops (hypershard.ops): element-wise error-bound checks
against a float64 reference, and stand-ins for torch_npu's op schemas (to prove that the rules
registered under torch_npu's names serve them where torch_npu itself is absent)."""

from __future__ import annotations

import torch

__all__ = ["NPU_FUSION_ATTENTION_SCHEMAS", "assert_within", "define_npu_kernels", "define_npu_standins", "has_npu_op"]

# Stand-in libraries live as long as the process: defining an op twice (a test file run twice
# in one process) would fail, and dropping them while torch.ops.npu still holds their packets
# would leave stale handles.
_NPU_LIBRARIES: list = []


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """Every element of `got` within its own bound of the float64 `ref` (and the same shape)."""
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err = (got.to(torch.float64) - ref).abs()
    bad = ~(err <= bound)  # NaN counts as bad
    if bool(bad.any()):
        index = int(torch.argmax(torch.where(bad, err / bound.clamp_min(1e-300), torch.zeros_like(err))))
        flat_got, flat_ref, flat_bound = got.to(torch.float64).flatten(), ref.flatten(), bound.flatten()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond their error bound; worst at flat index "
            f"{index}: got {flat_got[index].item()!r}, reference {flat_ref[index].item()!r}, "
            f"|err| {err.flatten()[index].item():.3e} > bound {flat_bound[index].item():.3e}"
        )


def has_npu_op(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"npu::{name}", "")
        return True
    except RuntimeError:
        return False


def define_npu_standins(schemas: dict):
    """torch.ops.npu with these ops ({name: schema}) defined where they are missing (no kernels),
    hypershard's runtime told of them; returns torch.ops.npu."""
    import hypershard as hs

    missing = [name for name in schemas if not has_npu_op(name)]
    if missing:
        try:
            library = torch.library.Library("npu", "DEF")
        except RuntimeError:  # the namespace is defined already (torch_npu or another test)
            library = torch.library.Library("npu", "FRAGMENT")
        for name in missing:
            library.define(schemas[name])
        _NPU_LIBRARIES.append(library)
    hs._C.sync_registrations()  # hypershard's runtime learns of ops registered after it loaded
    assert all(has_npu_op(name) for name in schemas)
    return torch.ops.npu


# --------------------------------------------------------------------------- torch_npu stand-ins
#
# torch_npu's fused ops with CPU kernels of its maths, for the tests where torch_npu is absent.
# On Ascend, torch_npu's autograd for npu_rms_norm / npu_rotary_mul calls npu_rms_norm_backward /
# npu_rotary_mul_backward; the stand-ins' plain-tensor autograd does the same, and on a DTensor
# hypershard's own autograd kernel (csrc/kernels/external_autograd.cpp) calls those backward ops.

NPU_RMS_NORM_SCHEMAS = {
    "npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_rms_norm_backward": "npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> "
    "(Tensor, Tensor)",
}
NPU_ROTARY_MUL_SCHEMAS = {
    "npu_rotary_mul": "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor",
    "npu_rotary_mul_backward": "npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, "
    "str rotary_mode='half') -> (Tensor, Tensor, Tensor)",
}

# torch_npu's fusion attention (the schema most releases share; newer ones append softmax_layout
# and sink, which the rule reads by name when present). Schemas only: planning tests need no kernel.
NPU_FUSION_ATTENTION_SCHEMAS = {
    "npu_fusion_attention": "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, "
    "str input_layout, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
    "float scale=1., float keep_prob=1., int pre_tockens=2147483647, "
    "int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
    "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
    "bool gen_mask_parallel=True, bool sync=False) -> (Tensor, Tensor, Tensor, Tensor, int, "
    "int, int)",
    "npu_fusion_attention_grad": "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, "
    "int head_num, str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, "
    "Tensor? atten_mask=None, Tensor? softmax_max=None, Tensor? softmax_sum=None, "
    "Tensor? softmax_in=None, Tensor? attention_in=None, float scale_value=1., "
    "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
    "int inner_precise=0, int seed=0, int offset=0, int numels=0, int[]? prefix=None, "
    "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
    "bool gen_mask_parallel=True, bool sync=False) -> (Tensor, Tensor, Tensor, Tensor)",
}

# name -> the function a stand-in backward kernel runs instead of its own maths (a planted fault,
# set inside one test launch's rank processes only)
PLANTED_BACKWARD: dict = {}


def npu_rms_norm_cpu(x, gamma, epsilon=1e-6):
    """(y, rstd): HF's RMSNorm written out over the last dim (float32 variance), rstd in float32
    shaped like x with the last dim 1."""
    from hypershard import ops

    rstd = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + epsilon)
    return ops.rms_norm_composed(x, gamma, epsilon), rstd


def npu_rms_norm_backward_cpu(dy, x, gamma, rstd):
    """(dx, dgamma) of y = x * rstd * gamma over gamma's dims (CANN's RmsNormGrad), in float32:
    with h = x * rstd and u = dy * gamma, dx = rstd * (u - h * mean(u * h)), dgamma = the sum of
    dy * h over the leading dims."""
    if "npu_rms_norm_backward" in PLANTED_BACKWARD:
        return PLANTED_BACKWARD["npu_rms_norm_backward"](dy, x, gamma, rstd)
    k = gamma.dim()
    dims, lead = tuple(range(x.dim() - k, x.dim())), tuple(range(x.dim() - k))
    g, h = dy.to(torch.float32), x.to(torch.float32) * rstd.to(torch.float32)
    u = g * gamma.to(torch.float32)
    dx = rstd * (u - h * (u * h).mean(dims, keepdim=True))
    dgamma = (g * h).sum(lead) if lead else g * h
    return dx.to(x.dtype), dgamma.to(gamma.dtype)


def rotate(x, rotary_mode):
    """npu_rotary_mul's rotation: "half" cat(-x2, x1) of the halves, "interleave" (-x[2k+1], x[2k])
    per pair. It is antisymmetric: its transpose is its negative."""
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def npu_rotary_mul_cpu(x, r1, r2, rotary_mode="half"):
    return x * r1 + rotate(x, rotary_mode) * r2


def npu_rotary_mul_backward_cpu(grad, x, r1, r2, rotary_mode="half"):
    """(dx, dr1, dr2) of y = x * r1 + rotate(x) * r2: dx = grad * r1 - rotate(grad * r2) (rotate
    is antisymmetric), dr1 = grad * x and dr2 = grad * rotate(x), summed to r1's / r2's shapes."""
    if "npu_rotary_mul_backward" in PLANTED_BACKWARD:
        return PLANTED_BACKWARD["npu_rotary_mul_backward"](grad, x, r1, r2, rotary_mode)
    dx = grad * r1 - rotate(grad * r2, rotary_mode)
    return (
        dx,
        (grad * x).sum_to_size(r1.shape).to(r1.dtype),
        (grad * rotate(x, rotary_mode)).sum_to_size(r2.shape).to(r2.dtype),
    )


class _NpuRmsNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, epsilon):
        with torch._C._AutoDispatchBelowAutograd():
            y, rstd = torch.ops.npu.npu_rms_norm(x, gamma, epsilon)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy, _):
        x, gamma, rstd = ctx.saved_tensors
        dx, dgamma = torch.ops.npu.npu_rms_norm_backward(dy, x, gamma, rstd)
        return dx, dgamma, None


class _NpuRotaryMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r1, r2, rotary_mode):
        with torch._C._AutoDispatchBelowAutograd():
            y = torch.ops.npu.npu_rotary_mul(x, r1, r2, rotary_mode)
        ctx.save_for_backward(x, r1, r2)
        ctx.rotary_mode = rotary_mode
        return y

    @staticmethod
    def backward(ctx, grad):
        x, r1, r2 = ctx.saved_tensors
        dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward(grad, x, r1, r2, ctx.rotary_mode)
        return dx, dr1, dr2, None


_NPU_KERNELS = {
    "npu_rms_norm": (npu_rms_norm_cpu, lambda x, gamma, epsilon=1e-6: _NpuRmsNormFunction.apply(x, gamma, epsilon)),
    "npu_rms_norm_backward": (npu_rms_norm_backward_cpu, None),
    "npu_rotary_mul": (
        npu_rotary_mul_cpu,
        lambda x, r1, r2, rotary_mode="half": _NpuRotaryMulFunction.apply(x, r1, r2, rotary_mode),
    ),
    "npu_rotary_mul_backward": (npu_rotary_mul_backward_cpu, None),
}


def define_npu_kernels(schemas: dict):
    """torch.ops.npu with the ops of `schemas` (NPU_RMS_NORM_SCHEMAS / NPU_ROTARY_MUL_SCHEMAS)
    defined where missing and given the stand-in kernels above (for CPU and CUDA) and, for the forward ops, a
    plain-tensor autograd kernel that calls the backward op (torch_npu's structure); an op that
    has a CPU kernel already (torch_npu, or an earlier call) is left alone."""
    ops_namespace = define_npu_standins(schemas)
    library = None
    for name in schemas:
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"npu::{name}", "CPU"):
            continue
        if library is None:
            library = torch.library.Library("npu", "FRAGMENT")
            _NPU_LIBRARIES.append(library)
        cpu, autograd = _NPU_KERNELS[name]
        library.impl(name, cpu, "CPU")
        library.impl(name, cpu, "CUDA")  # torch ops, any device: the GPU check's cases reach them too
        if autograd is not None:
            library.impl(name, autograd, "Autograd")
    return ops_namespace
