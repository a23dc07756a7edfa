"""hypershard's fused ops: C++ custom ops (``csrc/kernels``) with CPU kernels and autograd, on
plain tensors and on DTensors alike. Each shares its distributed rule (``csrc/ops``) with
torch_npu's op of the same maths, so a model written against either runs sharded.

``rotary_position_embedding(x, cos, sin, mode=0)``
    ``y = x * cos + rotate(x) * sin`` along the last dim D of x (cos and sin broadcast to x, same
    rank, each dim x's or 1). Modes, as Ascend's operator defines them:
    0 "half" (GPT-NeoX: ``rotate = cat(-x2, x1)`` of the halves), 1 "interleave" (GPT-J:
    ``rotate[2k] = -x[2k+1]``, ``rotate[2k+1] = x[2k]``), 2 "quarter" (``cat(-x2, x1, -x4, x3)``
    of the quarters, D divisible by 4), 3 "interleave-half" (even positions first, then odd,
    then mode 0: ``y = cat(e, o) * cos + cat(-o, e) * sin``). Backward for all four: dx, dcos,
    dsin (summed over the dims cos/sin broadcast on). x of layout BNSD, BSND or SBND (any rank),
    float32/float64/bfloat16/float16 (computed in float, rounded once).
``rotary_mul(x, r1, r2, rotary_mode="half")``
    torch_npu's ``npu_rotary_mul``: the same op with mode "half" or "interleave".
``rotary_position_embedding_composed(x, cos, sin, mode=0)``
    The same maths from cat/neg/mul/stack (the non-fused form: the reference of the tests and
    the bench).
``rms_norm(x, weight, eps=1e-6)``
    ``x * rsqrt(mean(x**2) + eps) * weight`` over x's last ``weight.dim()`` dims, one fused pass
    (the op ``torch.ops.hypershard.rms_norm`` also returns rstd, kept for its backward; torch_npu's
    ``npu_rms_norm`` has the same signature). Computed in float, rounded once, output dtype
    promoted from x and weight as HF's RMSNorm does.
``rms_norm_composed(x, weight, eps=1e-6)``
    HF's RMSNorm written out (float32 variance, rsqrt, cast back, times weight).

Sharded: rotary (csrc/ops/rotary.cpp): B/N/S may be sharded, D never; the output is laid out
like x; cos/sin sharded like x on the dims they share with it or of size 1 there; no Partial
inputs. rms_norm (csrc/ops/normalization.cpp): the leading dims keep their sharding, the
normalized dims are whole, weight whole; the weight's gradient is Partial(sum) over the axes that
shard the leading dims -- the layouts the composed form gets from the pointwise and reduction
rules.
"""

from __future__ import annotations

import torch  # the ops are defined when hypershard (its dispatch) loads, before this module

__all__ = [
    "MODES",
    "rms_norm",
    "rms_norm_composed",
    "rotary_mul",
    "rotary_position_embedding",
    "rotary_position_embedding_composed",
]

MODES = {"half": 0, "interleave": 1, "quarter": 2, "interleave_half": 3}


def _mode(mode) -> int:
    if isinstance(mode, str):
        if mode not in MODES:
            raise ValueError(f"rotary mode {mode!r} is not supported; allowed: {', '.join(MODES)} or 0..3")
        return MODES[mode]
    return int(mode)


def rotary_position_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode=0) -> torch.Tensor:
    """Fused rotary position embedding (see the module docstring); mode 0..3 or its name."""
    return torch.ops.hypershard.rotary_position_embedding(x, cos, sin, _mode(mode))


def rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """torch_npu's ``npu_rotary_mul``: ``x * r1 + rotate(x) * r2``, rotary_mode "half" or "interleave"."""
    if rotary_mode not in ("half", "interleave"):
        raise ValueError(f"rotary_mode {rotary_mode!r} is not supported; allowed: 'half', 'interleave'")
    return torch.ops.hypershard.rotary_position_embedding(x, r1, r2, MODES[rotary_mode])


def rotary_position_embedding_composed(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode=0) -> torch.Tensor:
    """The non-fused form of `rotary_position_embedding`, from cat/neg/mul/stack."""
    mode = _mode(mode)
    if mode == 0:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    if mode == 1:
        even, odd = x[..., ::2], x[..., 1::2]
        return x * cos + torch.stack((-odd, even), dim=-1).flatten(-2) * sin
    if mode == 2:
        x1, x2, x3, x4 = x.chunk(4, dim=-1)
        return x * cos + torch.cat((-x2, x1, -x4, x3), dim=-1) * sin
    if mode == 3:
        even, odd = x[..., ::2], x[..., 1::2]
        return torch.cat((even, odd), dim=-1) * cos + torch.cat((-odd, even), dim=-1) * sin
    raise ValueError(f"rotary mode {mode} is out of range; allowed: 0..3")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Fused RMSNorm over x's last ``weight.dim()`` dims (see the module docstring)."""
    return torch.ops.hypershard.rms_norm(x, weight, eps)[0]


def rms_norm_composed(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF's RMSNorm (LlamaRMSNorm / Qwen3RMSNorm) written out, over the last dim."""
    dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(dtype)
