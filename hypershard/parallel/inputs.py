"""A model's forward inputs laid out on the mesh: the batch split over dp, the sequence over cp
(head-tail order for causal load balance; docs/context_parallel.md), linear attention installed for cp.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import _C
from ..tensor.dtensor import distribute_tensor
from ..tensor.placement_types import Replicate, Shard
from .context import (
    shift_labels,
    to_head_tail,
)
from .styles import _text_config

__all__ = ["CP_ALGORITHMS"]


# Forward arguments whose dim 0 is not the batch: a vision model's patches of all images and
# their grid sizes. They stay Replicate (every data-parallel rank runs the vision tower on all of
# them); the text-side tensors are split over dp.
_NOT_BATCH_INPUTS = frozenset({"pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw"})


# Context parallelism (docs/context_parallel.md): the algorithms the attention rule plans.
CP_ALGORITHMS = ("all_gather_kv", "ulysses", "ring")
# Forward arguments whose last dim is the sequence (position ids: also M-RoPE's (3, batch, seq)).
_SEQUENCE_INPUTS = frozenset({"input_ids", "labels", "shift_labels", "position_ids", "token_type_ids"})


def _rope_index(module, kwargs: dict):
    """A vision-language model's M-RoPE position ids (3, batch, seq) for the natural-order plain
    inputs, from its own get_rope_index (images and videos get positions from their grids); None
    when the model has none or the batch has no image or video."""
    owner = next((m for m in (module, getattr(module, "model", None)) if hasattr(m, "get_rope_index")), None)
    grids = {k: kwargs.get(k) for k in ("image_grid_thw", "video_grid_thw")}
    if owner is None or all(g is None for g in grids.values()):
        return None
    extra = {k: kwargs[k] for k in ("mm_token_type_ids", "attention_mask") if kwargs.get(k) is not None}
    position_ids, _ = owner.get_rope_index(kwargs["input_ids"], **grids, **extra)
    return position_ids


def _head_tail_inputs(kwargs: dict, chunks: int, module=None) -> dict:
    """The forward's keyword tensors in head-tail order along the sequence (hypershard.parallel.context),
    natural-order work done first: labels shifted by one position over the WHOLE sequence (passed as
    ``shift_labels``, which transformers' ForCausalLMLoss then takes as they are), position ids made
    when the caller gave none, an all-ones attention mask always (see below). A padding mask is
    taken only on the right (_right_padding_dropped); others are refused: transformers builds the
    mask's causal part from natural positions. `chunks` 0: the sequence stays in natural order
    (a model that keeps it, see parallelize)."""
    kwargs = dict(kwargs)
    ids = kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    source = ids if isinstance(ids, torch.Tensor) else embeds
    if not isinstance(source, torch.Tensor) or _C.is_dtensor(source):
        return kwargs
    batch, length = source.shape[0], source.shape[1]
    if chunks and length % chunks:
        raise ValueError(
            f"hypershard: parallelize: a sequence of {length} tokens cannot be stored in head-tail "
            f"order of {chunks} chunks (2 x the context-parallel size); allowed: sequences padded to "
            f"a multiple of {chunks}"
        )
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not _C.is_dtensor(mask) and not bool(mask.bool().all()):
        _right_padding_dropped(mask, kwargs, module)
    # Always an all-ones mask: without one (and without a KV cache, use_cache=False) transformers
    # reads head-tail position ids as packed sequences and masks across their "boundaries"; with
    # one it sees nothing to mask and attention runs is_causal over the global positions.
    kwargs["attention_mask"] = torch.ones(batch, length, dtype=torch.long, device=source.device)
    if kwargs.get("position_ids") is None and module is not None and isinstance(ids, torch.Tensor):
        kwargs["position_ids"] = _rope_index(module, kwargs)
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = torch.arange(length, device=source.device).expand(batch, length)
    targets = _shifted_targets(kwargs)
    if targets is not None:
        kwargs["labels"] = kwargs["shift_labels"] = targets
    if not chunks:  # natural order
        return kwargs
    for name, value in list(kwargs.items()):
        if isinstance(value, torch.Tensor) and not _C.is_dtensor(value) and value.dim() > 0:
            if name in _SEQUENCE_INPUTS:
                kwargs[name] = to_head_tail(value, value.dim() - 1, chunks)
            elif name == "inputs_embeds":
                kwargs[name] = to_head_tail(value, 1, chunks)
    return kwargs


def _shifted_targets(kwargs: dict) -> Optional[torch.Tensor]:
    """Position p's target for every p, as transformers' ForCausalLMLoss takes it: the caller's
    ``shift_labels`` when given, else ``labels`` shifted by one (on the whole natural-order
    sequence); None without either."""
    if isinstance(kwargs.get("shift_labels"), torch.Tensor):
        return kwargs["shift_labels"]
    return shift_labels(kwargs["labels"]) if isinstance(kwargs.get("labels"), torch.Tensor) else None


def _right_padding_dropped(mask: torch.Tensor, kwargs: dict, module) -> None:
    """Checks that padding `mask` [B, L] can be replaced by all ones, else raises: every row
    padded on the right only, no trained target on a pad position, and no auxiliary router loss.
    Then no real token attends to a later pad (the models are causal; a causal conv or
    recurrence reads only earlier tokens), so every real position's output and every trained
    token's loss are the ones the mask gives; only the pads' own outputs differ, and nothing
    trains on them. A left-padded row needs the mask's causal part at global positions, which
    transformers builds from natural ones."""
    if mask.dim() != 2:
        raise ValueError(
            f"hypershard: parallelize: a {mask.dim()}-D attention_mask on a context-parallel mesh (its "
            "positions would be read as natural ones); allowed: a 2-D mask padding on the right, or none"
        )
    keep = mask.bool()
    lengths = keep.sum(-1, keepdim=True)
    positions = torch.arange(keep.shape[-1], device=keep.device)
    if not torch.equal(keep, positions < lengths):
        raise ValueError(
            "hypershard: parallelize: a padding attention_mask on a context-parallel mesh must pad on "
            "the right (transformers builds the causal part of a left-padding mask from natural "
            "positions); allowed: right padding with labels -100 on the pads, packing, or no mask"
        )
    shifted = _shifted_targets(kwargs)
    if shifted is not None and bool((shifted[~keep] != -100).any()):
        raise ValueError(
            "hypershard: parallelize: a right-padding attention_mask on a context-parallel mesh with "
            "a trained target on a pad position (the mask is replaced by all ones, which changes the "
            "pads' own outputs); allowed: labels -100 on every pad token"
        )
    config = _text_config(module) if module is not None else None
    router_loss = kwargs.get("output_router_logits")  # the forward's argument wins over the config
    if router_loss is None:
        router_loss = getattr(config, "output_router_logits", False)
    if router_loss:
        raise ValueError(
            "hypershard: parallelize: a padding attention_mask on a context-parallel mesh with the "
            "auxiliary router loss (output_router_logits): it would count the pad tokens once the "
            "mask is replaced by all ones; allowed: output_router_logits=False, or no padding"
        )


def _shard_inputs(mesh, dp_axis, cp_axis: Optional[int] = None, head_tail: bool = True):
    # dp_axis: None, a mesh axis index, or a list of them (HSDP: the batch split over both data-parallel axes)
    dp_axes = [] if dp_axis is None else [dp_axis] if isinstance(dp_axis, int) else list(dp_axis)

    def distribute(t, batch: bool = True, sequence_dim: Optional[int] = None):
        if not isinstance(t, torch.Tensor) or _C.is_dtensor(t) or t.dim() == 0:
            return t
        placements: list = [Replicate()] * mesh.ndim
        for axis in dp_axes if batch else ():
            # M-RoPE position ids are (3, batch, seq): their batch is dim 1
            placements[axis] = Shard(1 if sequence_dim == 2 and t.dim() == 3 and t.shape[0] == 3 else 0)
        if cp_axis is not None and sequence_dim is not None:
            placements[cp_axis] = Shard(sequence_dim)
        return distribute_tensor(t, mesh, placements)

    def sequence_dim(name: str, t) -> Optional[int]:
        if cp_axis is None or not isinstance(t, torch.Tensor):
            return None
        return t.dim() - 1 if name in _SEQUENCE_INPUTS else 1 if name == "inputs_embeds" else None

    def hook(module, args, kwargs):
        if cp_axis is not None:
            if args:  # a positional input_ids, as HF's forward names it
                kwargs = {"input_ids": args[0], **kwargs}
                args = args[1:]
            kwargs = _head_tail_inputs(kwargs, 2 * mesh.shape[cp_axis] if head_tail else 0, module)
            if module.training:
                # A training forward needs no cache, and a linear-attention layer's cache would
                # copy this rank's conv and recurrent states into whole plain tensors.
                kwargs.setdefault("use_cache", False)
        return (
            tuple(distribute(a) for a in args),
            {k: distribute(v, k not in _NOT_BATCH_INPUTS, sequence_dim(k, v)) for k, v in kwargs.items()},
        )

    return hook


def _install_linear_attention(model: nn.Module, mesh, cp_axis: int) -> int:
    from .linear_attention import install_context_parallel_linear_attention

    return install_context_parallel_linear_attention(model, mesh, cp_axis)
