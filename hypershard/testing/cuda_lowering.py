"""The CUDA lowering of a training step, run on CPU: which ops a HuggingFace model reaches on a GPU,
and the rules that serve them checked without one.

On CUDA, F.scaled_dot_product_attention's CompositeImplicitAutograd kernel asks the device's sdp
chooser (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) for a backend and calls
aten::_scaled_dot_product_{flash,efficient,cudnn}_attention; autograd then calls their _backward
ops. On CPU (and on meta tensors) the same call picks _scaled_dot_product_flash_attention_for_cpu
instead, so a CPU trace never reaches the CUDA kernels. This module provides:

- `install_cpu_kernels()`: CPU kernels for cuDNN's batch norm (and its backward) and for the CUDA
  attention ops and their backwards (and for the
  PrivateUse1 hook _scaled_dot_product_fused_attention_overrideable), computing attention exactly
  (float32 or wider, grouped key/value heads, an additive or bool mask, is_causal); the extra
  outputs (philox state, placeholders) have the shapes and dtypes of the ops' own Meta kernels.
  Dropout is not implemented (a stand-in cannot draw the CUDA kernel's mask). Only ops without a
  CPU kernel get one.
- `lowered_sdpa(backend, query, key, value, ...)`: F.scaled_dot_product_attention as torch's
  CompositeImplicitAutograd kernel lowers it for that backend (flash pads the head dim to a
  multiple of 8 and passes the original scale; efficient turns a bool mask additive, pads its last
  dim to a multiple of 8 and expands it to (batch, heads, L, S); cuDNN and the PrivateUse1 hook
  "overrideable" turn a bool mask additive; the math path is aten::_scaled_dot_product_attention_math),
  and `CudaLowering(backend)`, a TorchFunctionMode that routes every F.scaled_dot_product_attention
  call there (autocast's cast of SDPA's inputs included). Which backend a GPU picks is torch's
  choice, by dtype, mask and architecture: SCENARIOS names the usual ones.
- `train(model, batches, scenario)`: hypershard.testing.models.train with a scenario's lowering, AdamW with
  foreach=True (CUDA's default; CPU's is per tensor), autocast and torch.amp.GradScaler;
  `trace_step(scenario)`: the ATen ops one step of a tiny Qwen3ForCausalLM reaches that way, and
  `cuda_step_ops()`: those the coverage tool's CPU step does not reach, per scenario
  (docs/operators.md lists them).

Nothing here needs a GPU: the kernels are CPU stand-ins with the CUDA ops' schemas, so the
distributed rules of those ops run (and are tested) on a CPU mesh exactly as they would on CUDA,
up to the kernels' own arithmetic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "BACKENDS",
    "CPU_STEP",
    "CudaLowering",
    "SCENARIOS",
    "Scenario",
    "batches",
    "cuda_step_ops",
    "install_cpu_kernels",
    "lowered_sdpa",
    "trace_step",
    "train",
]

aten = torch.ops.aten
BACKENDS = ("flash", "efficient", "cudnn", "overrideable", "math")

# --------------------------------------------------------------------------- CPU kernels


def _attention_probs(query, key, value, bias, is_causal, scale):
    """(probabilities, value with the key/value heads repeated, the key likewise, scale) in
    float32 or wider."""
    acc = torch.promote_types(query.dtype, torch.float32)
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    if k.size(1) != q.size(1):  # grouped heads: query head i reads key/value head i // group
        group = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else scores + bias.to(acc)
    if is_causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    # a fully masked row (a padded query) attends to nothing: zeros, as the fused kernels and the
    # math path's _safe_softmax give
    probs = torch.exp(scores - lse.unsqueeze(-1)).masked_fill(torch.isneginf(lse).unsqueeze(-1), 0.0)
    return probs, k, v, scale, lse


def _no_dropout(dropout_p):
    if dropout_p:
        raise NotImplementedError(
            "hypershard.testing.cuda_lowering: the CPU stand-in kernels do not implement "
            "dropout (the CUDA kernels draw their own mask)"
        )


# Outputs whose shape on a GPU differs from the op's Meta kernel: cuDNN attention returns its
# dropout seed and offset as 1-element tensors where the Meta kernel says 0-dim (seen on an H200,
# torch 2.11; hypershard's plan takes shapes from Meta, so the imitation returns the real ones).
REAL_SHAPES = {
    (aten._scaled_dot_product_cudnn_attention.default, 6): (1,),
    (aten._scaled_dot_product_cudnn_attention.default, 7): (1,),
}


def _forward(op, args, kwargs, query, key, value, bias, dropout_p, is_causal, scale):
    """The op's outputs: its Meta kernel's shapes and dtypes, output and logsumexp computed."""
    _no_dropout(dropout_p)

    def meta(x):
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    shapes = op(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
    probs, _, v, _, lse = _attention_probs(query, key, value, bias, is_causal, scale)
    outs = []
    for i, m in enumerate(shapes):
        if not isinstance(m, torch.Tensor):
            outs.append(m)
        elif i == 0:
            outs.append((probs @ v).to(m.dtype))
        elif i == 1:  # logsumexp: (b, h, L), (b, h, L, 1) or (b, h, L rounded up) -- or empty
            stat = torch.zeros(m.shape, dtype=m.dtype)
            if stat.numel():
                stat.view(stat.size(0), stat.size(1), -1)[..., : lse.size(-1)] = lse.to(m.dtype)
            outs.append(stat)
        else:
            outs.append(torch.zeros(REAL_SHAPES.get((op, i), m.shape), dtype=m.dtype))
    return tuple(outs)


def _backward(grad_out, query, key, value, bias, dropout_p, is_causal, scale, bias_grad):
    """(grad_query, grad_key, grad_value, grad_bias or None) of exact attention."""
    _no_dropout(dropout_p)
    probs, k, v, scale, _ = _attention_probs(query, key, value, bias, is_causal, scale)
    g = grad_out.to(probs.dtype)
    grad_v = probs.transpose(-2, -1) @ g
    grad_p = g @ v.transpose(-2, -1)
    grad_s = probs * (grad_p - (grad_p * probs).sum(-1, keepdim=True))
    grad_q = (grad_s @ k) * scale
    grad_k = (grad_s.transpose(-2, -1) @ query.to(probs.dtype)) * scale
    if key.size(1) != query.size(1):  # the repeated heads' gradients summed back into their KV head
        b, hkv, s = key.size(0), key.size(1), key.size(2)
        grad_k = grad_k.reshape(b, hkv, -1, s, grad_k.size(-1)).sum(2)
        grad_v = grad_v.reshape(b, hkv, -1, s, grad_v.size(-1)).sum(2)
    grad_bias = None
    if bias_grad and bias is not None and bias.dtype != torch.bool:
        grad_bias = grad_s.sum_to_size(bias.shape).to(bias.dtype)
    return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype), grad_bias


def _flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    op = aten._scaled_dot_product_flash_attention.default
    return _forward(
        op,
        (query, key, value, dropout_p, is_causal, return_debug_mask),
        {"scale": scale},
        query,
        key,
        value,
        None,
        dropout_p,
        is_causal,
        scale,
    )


def _flash_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    return _backward(grad_out, query, key, value, None, dropout_p, is_causal, scale, False)[:3]


def _efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    op = aten._scaled_dot_product_efficient_attention.default
    return _forward(
        op,
        (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal),
        {"scale": scale},
        query,
        key,
        value,
        attn_bias,
        dropout_p,
        is_causal,
        scale,
    )


def _efficient_backward(
    grad_out_,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    return _backward(grad_out_, query, key, value, attn_bias, dropout_p, is_causal, scale, grad_input_mask[3])


def _cudnn(
    query,
    key,
    value,
    attn_bias,
    compute_log_sumexp,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    op = aten._scaled_dot_product_cudnn_attention.default
    return _forward(
        op,
        (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask),
        {"scale": scale},
        query,
        key,
        value,
        attn_bias,
        dropout_p,
        is_causal,
        scale,
    )


def _cudnn_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    return _backward(grad_out, query, key, value, attn_bias, dropout_p, is_causal, scale, False)[:3]


def _overrideable(
    query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
):
    op = aten._scaled_dot_product_fused_attention_overrideable.default
    return _forward(
        op,
        (query, key, value, attn_bias, dropout_p, is_causal, return_debug_mask),
        {"scale": scale},
        query,
        key,
        value,
        attn_bias,
        dropout_p,
        is_causal,
        scale,
    )


def _overrideable_backward(
    grad_out,
    query,
    key,
    value,
    attn_bias,
    grad_input_mask,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    return _backward(grad_out, query, key, value, attn_bias, dropout_p, is_causal, scale, grad_input_mask[3])


def _cudnn_batch_norm(input, weight, bias, running_mean, running_var, training, exponential_average_factor, epsilon):
    """cuDNN's batch norm as torch's CPU kernel computes it. Its reserve (cuDNN's workspace for
    the backward) depends on the LOCAL input, as on a GPU: one byte per row when training, empty
    in inference -- so a distributed call's reserve is shaped by each rank's block."""
    out, save_mean, save_invstd = aten.native_batch_norm(
        input, weight, bias, running_mean, running_var, training, exponential_average_factor, epsilon
    )
    reserve = torch.zeros(input.size(0) if training else 0, dtype=torch.uint8)
    return out, save_mean, save_invstd, reserve


def _cudnn_batch_norm_backward(
    input, grad_output, weight, running_mean, running_var, save_mean, save_var, epsilon, reserveSpace
):
    # torch calls it when training only (inference takes native_batch_norm_backward); cuDNN's
    # save_var is the inverse standard deviation, as native_batch_norm's save_invstd
    return aten.native_batch_norm_backward(
        grad_output, input, weight, running_mean, running_var, save_mean, save_var, True, epsilon, [True] * 3
    )


KERNELS = {
    "cudnn_batch_norm": _cudnn_batch_norm,
    "cudnn_batch_norm_backward": _cudnn_batch_norm_backward,
    "_scaled_dot_product_flash_attention": _flash,
    "_scaled_dot_product_flash_attention_backward": _flash_backward,
    "_scaled_dot_product_efficient_attention": _efficient,
    "_scaled_dot_product_efficient_attention_backward": _efficient_backward,
    "_scaled_dot_product_cudnn_attention": _cudnn,
    "_scaled_dot_product_cudnn_attention_backward": _cudnn_backward,
    "_scaled_dot_product_fused_attention_overrideable": _overrideable,
    "_scaled_dot_product_fused_attention_overrideable_backward": _overrideable_backward,
}
_LIBRARIES: list = []  # kept for the process: the dispatcher holds their kernels
_INSTALLED: set = set()


def install_cpu_kernels() -> None:
    """CPU kernels (above) for the ops of KERNELS that have none; idempotent."""
    missing = [
        name
        for name in KERNELS
        if name not in _INSTALLED
        and hasattr(aten, name)
        and not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU")
    ]
    if not missing:
        return
    library = torch.library.Library("aten", "IMPL")
    for name in missing:
        library.impl(name, KERNELS[name], "CPU")
        _INSTALLED.add(name)
    _LIBRARIES.append(library)


# --------------------------------------------------------------------------- the lowering


def _additive(mask, dtype):
    """A bool mask (True: attend) as the additive mask torch's kernels take (torch's
    convert_boolean_attn_mask: where(mask, 0, -inf) of scalar tensors of the query's dtype)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.scalar_tensor(0.0, dtype=dtype), torch.scalar_tensor(float("-inf"), dtype=dtype))


def lowered_sdpa(
    backend, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """F.scaled_dot_product_attention as torch's CUDA kernel lowers it to `backend` (the module
    docstring); grouped key/value heads go to the fused kernels as they are."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: allowed {BACKENDS}")
    if not enable_gqa and key.size(-3) != query.size(-3):
        raise RuntimeError("scaled_dot_product_attention: key/value heads differ from the query's without enable_gqa")
    if backend == "math":
        return aten._scaled_dot_product_attention_math(
            query,
            key,
            value,
            _additive(attn_mask, query.dtype),
            dropout_p,
            is_causal,
            None,
            scale=scale,
            enable_gqa=enable_gqa,
        )[0]
    compute_log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if backend == "flash":
        if attn_mask is not None:
            raise RuntimeError("the flash kernel takes no mask (torch picks another backend for a masked call)")
        size = query.size(-1)
        pad = -size % 8
        if pad:
            query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
        scale = 1.0 / math.sqrt(size) if scale is None else scale
        out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :size] if pad else out
    mask = _additive(attn_mask, query.dtype)
    if backend == "overrideable":
        return aten._scaled_dot_product_fused_attention_overrideable(
            query, key, value, mask, dropout_p, is_causal, False, scale=scale
        )[0]
    if backend == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, mask, compute_log_sumexp, dropout_p, is_causal, False, scale=scale
        )[0]
    if mask is not None:  # preprocess_mask: aligned to 8 on the last dim, expanded to (b, h, L, S)
        length = mask.size(-1)
        if length % 8:
            mask = F.pad(mask, (0, -length % 8))[..., :length]
        mask = mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, mask, compute_log_sumexp, dropout_p, is_causal, scale=scale
    )[0]


class CudaLowering(TorchFunctionMode):
    """Routes F.scaled_dot_product_attention to `lowered_sdpa(backend, ...)`, casting its inputs to
    the autocast dtype first where autocast is on (CUDA's autocast lists SDPA as a low-precision op)."""

    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query = args[0]
        device = query.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
            if isinstance(kwargs.get("attn_mask"), torch.Tensor) and kwargs["attn_mask"].is_floating_point():
                kwargs = dict(kwargs, attn_mask=kwargs["attn_mask"].to(dtype))
            with torch.autocast(device, enabled=False):
                return lowered_sdpa(self.backend, *args, **kwargs)
        return lowered_sdpa(self.backend, *args, **kwargs)


# --------------------------------------------------------------------------- the trace


@dataclass(frozen=True)
class Scenario:
    name: str
    backend: Optional[str]  # None: the CPU lowering (no CudaLowering)
    dtype: torch.dtype = torch.float32  # the model's parameters
    padding: bool = False  # batches with a padding attention_mask (HF then passes SDPA a mask)
    autocast: Optional[torch.dtype] = None  # torch.autocast's dtype
    scaler: bool = False  # torch.amp.GradScaler around backward and the step
    foreach: Optional[bool] = True  # AdamW's foreach: True is CUDA's default (None: the CPU one, per tensor)
    when: str = ""  # the CUDA configurations that lower SDPA this way


CPU_STEP = Scenario("CPU", None, foreach=None, when="the coverage tool's CPU step")
SCENARIOS = (
    Scenario("bf16", "flash", torch.bfloat16, when="fp16/bf16 inputs without a mask on sm80+ (A100, ...)"),
    Scenario(
        "bf16 on sm90",
        "cudnn",
        torch.bfloat16,
        when="sm90/sm100 (H100, H200, B200) with cuDNN > 9.15, which torch then prefers",
    ),
    Scenario("fp32", "efficient", when="fp32 inputs (flash and cuDNN take fp16/bf16 only)"),
    Scenario("bf16 + padding", "efficient", torch.bfloat16, padding=True, when="a mask before sm90 (flash takes none)"),
    Scenario("bf16 + padding on sm90", "cudnn", torch.bfloat16, padding=True, when="a mask on sm90/sm100"),
    Scenario(
        "fp16 autocast + GradScaler",
        "flash",
        autocast=torch.float16,
        scaler=True,
        when="fp16 mixed precision (autocast runs SDPA in fp16)",
    ),
)


def batches(config, steps: int, padding: bool = False, batch: int = 4, seq: int = 16) -> list:
    """hypershard.testing.models.make_batches' batches; with `padding`, the last sequence of each is
    left-padded by 3 tokens (attention_mask 0, labels -100), as a padded batch of a real run."""
    from .models import make_batches

    out = []
    for ids, labels in make_batches(config.vocab_size, steps, batch=batch, seq=seq):
        if not padding:
            out.append((ids, labels))
            continue
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[-1, :3] = 0
        labels = labels.clone()
        labels[-1, :3] = -100
        out.append((ids, labels, {"attention_mask": mask}))
    return out


def train(
    model,
    batches: list,
    scenario: Scenario,
    lr: float = 1e-3,
    clip: Optional[float] = 1.0,
    on_backward=None,
    device: str = "cpu",
) -> list:
    """hypershard.testing.models.train with `scenario`'s lowering, AdamW foreach setting, autocast and
    GradScaler (unscaled before on_backward and clipping, as HF's Trainer does), the batches on
    `device` (the GPU check trains on "cuda" with no lowering: the real kernels)."""
    install_cpu_kernels()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=scenario.foreach)
    scaler = torch.amp.GradScaler(device) if scenario.scaler else None
    lowering = CudaLowering(scenario.backend) if scenario.backend else contextlib.nullcontext()
    losses = []
    with lowering:
        for step, (ids, labels, *rest) in enumerate(batches):
            autocast = (
                torch.autocast(device, dtype=scenario.autocast) if scenario.autocast else contextlib.nullcontext()
            )
            extra = {k: v.to(device) for k, v in rest[0].items()} if rest else {}
            with autocast:
                loss = model(input_ids=ids.to(device), labels=labels.to(device), **extra).loss
            optimizer.zero_grad()
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(optimizer)
            if on_backward is not None:
                on_backward(step, model)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            losses.append(float(loss.detach().float().item()))
    return losses


def trace_step(scenario: Scenario, config_overrides: Optional[dict] = None) -> set:
    """The ATen ops (registry names, "aten::add.Tensor") one training step of the tiny Qwen3 (4 query,
    2 key/value heads) reaches with `scenario`, forward through the optimizer step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from .models import tiny_config, tiny_model

    install_cpu_kernels()
    config = tiny_config("qwen3", **{"num_key_value_heads": 2, **(config_overrides or {})})
    model = tiny_model(config).to(scenario.dtype)
    step = batches(config, 1, scenario.padding, batch=2)
    seen: set = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            schema = func._schema
            seen.add(schema.name + (f".{schema.overload_name}" if schema.overload_name else ""))
            return func(*args, **(kwargs or {}))

    with Record():
        train(model, step, scenario)
    return seen


def cuda_step_ops(scenarios=SCENARIOS) -> dict:
    """{op: (scenario names, lowered)}: the ops a scenario's CUDA-lowered step reaches that the
    coverage tool's CPU step (CPU_STEP) does not; `lowered`: for some scenario, the same step lowered
    for CPU (its CPU twin) does not reach the op either, so the CUDA lowering brings it rather than
    the scenario's dtype, mask or GradScaler."""
    baseline = trace_step(CPU_STEP)
    twins: dict = {}
    out: dict = {}
    for scenario in scenarios:
        twin = dataclasses.replace(scenario, name="CPU twin", backend=None, foreach=None, when="")
        if twin not in twins:
            twins[twin] = trace_step(twin)
        for op in sorted(trace_step(scenario) - baseline):
            names, lowered = out.get(op, ([], False))
            out[op] = (names + [scenario.name], lowered or op not in twins[twin])
    return dict(sorted(out.items()))
