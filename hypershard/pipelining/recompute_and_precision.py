"""Activation recomputation and mixed precision inside each pipeline stage: what
``hs.pipeline(..., recompute=..., mixed_precision=...)`` applies to every StageModule of this rank,
after parallelize and fully_shard, in the order a model without pp takes them (docs/recompute.md):
fully_shard, then hs.recompute, then hs.mixed_precision.

- recompute: hs.recompute on the decoder layers the stage OWNS (the pass-through modules standing
  in for the other stages' layers hold nothing to recompute). torch's stage runs a microbatch's
  backward with torch.autograd.backward on the stage's outputs, so the non-reentrant checkpoint
  recomputes each layer in that microbatch's backward, as on one device.
- mixed precision: hs.mixed_precision on the StageModule, the root torch's stage calls (its casts
  on every module that owns parameters, the fully_shard groups given the policy). Its floating
  input (the previous stage's hidden states) is cast to param_dtype as a root's is; those states
  cross the boundary already in param_dtype, as one device's residual stream between layers is.
  The last stage's logits stay in param_dtype and the model's own loss_function upcasts them, as
  the causal-LM forward does on one device.

Both are checked (`stage_options`) before the split, on every rank, before any collective."""

from __future__ import annotations

from typing import Optional, Union

from torch import nn

from .split import _fail, text_model

__all__ = ["apply_stage_options", "stage_options"]


def stage_options(recompute: Optional[str], mixed_precision) -> tuple:
    """(recompute mode or None, MixedPrecisionPolicy or None) from hs.pipeline's arguments:
    `recompute` None, "full" or "selective"; `mixed_precision` None / False, True (the standard bf16
    recipe, hypershard.fsdp.mixed_precision.BF16) or a hs.MixedPrecisionPolicy."""
    from ..fsdp.mixed_precision import BF16, MixedPrecisionPolicy, _check_policy
    from ..parallel.recompute import MODES

    if recompute is not None and recompute not in MODES:
        _fail(f"recompute={recompute!r} is not a recomputation mode", f"None or one of {list(MODES)}")
    if mixed_precision is None or mixed_precision is False:
        return recompute, None
    if mixed_precision is True:
        return recompute, BF16
    if not isinstance(mixed_precision, MixedPrecisionPolicy):
        _fail(
            f"mixed_precision={mixed_precision!r} is a {type(mixed_precision).__name__}",
            "None, True (bf16 compute, fp32 gradient sums) or a hypershard.MixedPrecisionPolicy",
        )
    return recompute, _check_policy(mixed_precision)


def apply_stage_options(module: nn.Module, recompute: Optional[str], policy: Union[None, object]) -> None:
    """hs.recompute on the stage's own decoder layers, then hs.mixed_precision on the StageModule
    (`module`, already parallelized and, if asked, fully sharded)."""
    from ..fsdp.mixed_precision import mixed_precision
    from ..parallel.recompute import recompute as recompute_layers

    if recompute is not None:
        layers = text_model(module.model).layers
        recompute_layers(module, mode=recompute, modules=[layers[i] for i in module.spec.layers])
    if policy is not None:
        mixed_precision(module, policy)
