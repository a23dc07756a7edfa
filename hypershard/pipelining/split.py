"""Stage split of a HuggingFace decoder model for pipeline parallelism, from the model's own modules.

A stage is a pruned copy of the whole causal-LM model: the decoder layers it does not own are
replaced by a pass-through module (``hidden_states`` in, ``hidden_states`` out), the embeddings
(and a vision-language model's vision tower) are dropped from every stage but the first, and the
final norm (an ``nn.Identity`` in its place) and the LM head from every stage but the last.
Parameter names stay the full model's (``model.layers.7.mlp.gate_proj.weight`` on whichever
stage owns layer 7), so a stage's state dict is a slice of the model's and checkpoints need no
renaming.

What of the model's forward had to be reproduced, and what is the model's own:

- Each stage runs the model's OWN base-model forward (``model.model`` or, for a vision-language
  model after the first stage, ``model.model.language_model``) with ``inputs_embeds`` = the hidden
  states received from the previous stage. So the rotary embeddings, the causal / recurrent /
  indexer masks (``config.layer_types[i]`` per global layer index ``i``: the pass-through layers
  keep the indices global) and a vision model's deepstack injection are computed by transformers'
  own code, on the stage that needs them, and follow transformers when it changes.
- Reproduced here: the LM head call (``lm_head(hidden_states)``, as the causal-LM forward does
  with ``logits_to_keep=0``), the loss through the model's own ``loss_function`` with
  ``num_items_in_batch`` (token-count weighting over the global batch), and a vision-language
  model's M-RoPE position ids (``get_rope_index`` of the model, computed once per microbatch and
  handed to every stage, since the later stages do not see the input ids or images).

How it is kept in step with transformers: `check_model` refuses, with one line naming what is
missing, a model whose structure differs from what the split relies on -- a base model without
``embed_tokens`` / ``layers`` / ``norm`` / ``rotary_emb`` (the modules of transformers'
``base_model_pp_plan``), a ``layers`` list whose length is not ``num_hidden_layers``, a base
forward without ``inputs_embeds`` / ``position_ids`` / ``attention_mask`` parameters, no
``lm_head`` or ``loss_function``, tied input and output embeddings (they would live on two
stages), the auxiliary router loss, or deepstack visual features injected after the first
stage's layers. The unit test runs every target model's stages in sequence on one process and
requires the full model's logits.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

__all__ = [
    "PipelineError",
    "SCHEDULES",
    "StageSpec",
    "check_model",
    "check_schedule",
    "split_model",
    "stage_model",
]

# --pp-schedule name -> torch.distributed.pipelining schedule class name
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


class PipelineError(ValueError):
    """A pipeline that cannot be built or run as asked (one line, hypershard's error format)."""


def _fail(problem: str, allowed: str) -> None:
    raise PipelineError(f"hypershard: pipeline: {problem}; allowed: {allowed}")


@dataclass
class StageSpec:
    """One pipeline stage: its index, the pp rank that runs it, the global decoder-layer indices it
    owns and the model's module names it holds (besides the pass-through layers)."""

    index: int
    rank: int
    layers: tuple
    modules: list = field(default_factory=list)
    first: bool = False
    last: bool = False


def _parts(model: nn.Module):
    """(outer base model, text model, text config) of a causal-LM or vision-language model."""
    outer = getattr(model, "model", None)
    text = getattr(outer, "language_model", outer)
    config = getattr(model.config, "text_config", model.config)
    return outer, text, config


def check_model(model: nn.Module) -> None:
    """Raises PipelineError naming what is missing when `model` is not built the way the split
    expects (see the module docstring)."""
    outer, text, config = _parts(model)
    name = type(model).__name__
    if outer is None:
        _fail(f"{name} has no base model at .model", "a transformers *ForCausalLM / *ForConditionalGeneration")
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if getattr(text, attr, None) is None:
            _fail(
                f"{name}'s decoder {type(text).__name__} has no {attr!r}",
                "a decoder with embed_tokens, layers, norm and rotary_emb (transformers' base_model_pp_plan)",
            )
    plan = getattr(config, "base_model_pp_plan", None) or {}
    missing = [key for key in plan if getattr(text, key, None) is None]
    if missing:
        _fail(f"{name}'s base_model_pp_plan names {missing}, which its decoder lacks", "the plan's modules present")
    if not isinstance(text.layers, nn.ModuleList) or len(text.layers) != config.num_hidden_layers:
        _fail(
            f"{name}'s decoder layers are not a ModuleList of num_hidden_layers={config.num_hidden_layers}",
            "layers indexed by their global layer index",
        )
    params = inspect.signature(text.forward).parameters
    for arg in ("inputs_embeds", "position_ids", "attention_mask"):
        if arg not in params:
            _fail(f"{type(text).__name__}.forward has no {arg!r} argument", "a decoder forward taking inputs_embeds")
    if getattr(model, "lm_head", None) is None or not hasattr(model, "loss_function"):
        _fail(f"{name} has no lm_head or loss_function", "a causal-LM model with its head and loss")
    if getattr(model.config, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False):
        _fail(
            f"{name} ties lm_head to embed_tokens (they sit on the first and the last stage)",
            "tie_word_embeddings=False",
        )
    if getattr(config, "output_router_logits", False) or getattr(model.config, "output_router_logits", False):
        _fail(f"{name} adds the auxiliary router loss (output_router_logits)", "output_router_logits=False")


def check_schedule(schedule: str, pp: int, stages_per_rank: int, n_microbatches: int) -> None:
    """torch's rules for the schedule's microbatch count, checked before anything is built."""
    if schedule not in SCHEDULES:
        _fail(f"unknown schedule {schedule!r}", ", ".join(SCHEDULES))
    if n_microbatches < 1:
        _fail(f"{n_microbatches} microbatches", "at least 1")
    if schedule != "interleaved_1f1b" and stages_per_rank != 1:
        _fail(f"{stages_per_rank} stages per rank with schedule {schedule!r}", "1, or schedule interleaved_1f1b")
    if schedule == "1f1b" and n_microbatches < pp:
        _fail(f"schedule 1f1b on {pp} stages needs at least {pp} microbatches, got {n_microbatches}", f">= {pp}")
    if schedule == "interleaved_1f1b":
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            _fail(
                f"schedule interleaved_1f1b on pp={pp} runs max(1, {n_microbatches} // {pp}) = {rounds} rounds, "
                f"which do not divide {n_microbatches} microbatches",
                f"a multiple of pp ({pp}) or fewer than {2 * pp} microbatches that the rounds divide",
            )


def split_model(model: nn.Module, pp: int, stages_per_rank: int = 1) -> list:
    """The StageSpec of every stage (pp * stages_per_rank of them; stage s runs on pp rank s % pp):
    contiguous runs of decoder layers, the earlier stages one layer more when they do not divide;
    embeddings (and a vision tower) on the first stage, norm, head and loss on the last."""
    check_model(model)
    outer, text, config = _parts(model)
    layers = config.num_hidden_layers
    n = pp * stages_per_rank
    if pp < 1 or stages_per_rank < 1:
        _fail(f"pp={pp}, stages_per_rank={stages_per_rank}", "positive sizes")
    if n > layers:
        _fail(
            f"{n} stages (pp={pp} x {stages_per_rank} per rank) for {layers} decoder layers", f"at most {layers} stages"
        )
    prefix = "model.language_model" if text is not outer else "model"
    visual = getattr(outer, "visual", None)
    specs, start = [], 0
    for s in range(n):
        count = layers // n + (1 if s < layers % n else 0)
        spec = StageSpec(s, s % pp, tuple(range(start, start + count)), first=s == 0, last=s == n - 1)
        start += count
        if spec.first:
            spec.modules.append(f"{prefix}.embed_tokens")
            if visual is not None:
                spec.modules.append("model.visual")
        spec.modules.append(f"{prefix}.rotary_emb")
        spec.modules += [f"{prefix}.layers.{i}" for i in spec.layers]
        if spec.last:
            spec.modules += [f"{prefix}.norm", "lm_head"]
        specs.append(spec)
    deepstack = list(getattr(getattr(model.config, "vision_config", None), "deepstack_visual_indexes", None) or [])
    if visual is not None and deepstack and len(deepstack) > len(specs[0].layers):
        _fail(
            f"the vision tower's {len(deepstack)} deepstack features go into layers 0..{len(deepstack) - 1}, "
            f"but the first stage holds {len(specs[0].layers)} layer(s)",
            f"a first stage with at least {len(deepstack)} layers (fewer stages)",
        )
    return specs


class PassThroughLayer(nn.Module):
    """A decoder layer another stage owns: returns the hidden states it gets."""

    def __init__(self, index: int):
        super().__init__()
        self.layer_index = index

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def stage_model(model: nn.Module, spec: StageSpec) -> nn.Module:
    """A copy of `model` holding only `spec`'s modules (module names unchanged); `model` itself is
    left as it was."""
    outer, text, _ = _parts(model)
    saved = []  # (owner, attribute, original)

    def swap(owner, attr, value):
        saved.append((owner, attr, owner._modules[attr]))
        owner._modules[attr] = value

    try:
        for i in range(len(text.layers)):
            if i not in spec.layers:
                swap(text.layers, str(i), PassThroughLayer(i))
        if not spec.first:
            swap(text, "embed_tokens", None)
            if "visual" in outer._modules:
                swap(outer, "visual", None)
        if not spec.last:
            swap(text, "norm", nn.Identity())
            swap(model, "lm_head", None)
        return copy.deepcopy(model)
    finally:
        for owner, attr, original in reversed(saved):
            owner._modules[attr] = original


def text_model(model: nn.Module) -> nn.Module:
    """The decoder (language model) of a stage model."""
    return _parts(model)[1]


def image_token_counts(model: nn.Module) -> Optional[tuple]:
    """(image token id, spatial merge size) of a vision-language model, or None."""
    config = model.config
    if getattr(config, "vision_config", None) is None or getattr(config, "image_token_id", None) is None:
        return None
    return config.image_token_id, config.vision_config.spatial_merge_size
