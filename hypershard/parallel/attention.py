"""Attention heads on tp, laid out before anything is distributed.

Attention heads on tp are laid out before anything is distributed (``_attention_layout``), so that a
plan ``parallelize`` accepts also runs in strict mode:

- KV heads that tp divides: the plan as written (q/k/v colwise, o rowwise);
- tp a multiple of the KV heads (e.g. 2 KV heads on tp=4): the ``k_proj``/``v_proj`` colwise entries
  become ``replicate`` -- every rank keeps every KV head, as Megatron replicates them, and the
  attention rule reads the one KV head its rank's query heads share;
- otherwise (e.g. 3 KV heads on tp=2: rank 0's query heads 0-2 read KV heads 0 and 1, rank 1's 3-5
  read 1 and 2) the KV heads can be neither split nor read from one group per rank, so every entry
  of that attention module becomes ``replicate``: each tp rank runs every head (a warning says so),
  the rest of the model keeps its plan.

A ``num_attention_heads`` that tp does not divide, or that is not a multiple of
``num_key_value_heads``, is refused up front with the reason.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from torch import nn

from .styles import _STYLES, _text_config

# ------------------------------------------------------------------------------ attention heads


# How a tp plan's attention is laid out (see _attention_layout).
HEADS_SHARDED, KV_REPLICATED, ATTENTION_REPLICATED = "heads_sharded", "kv_replicated", "attention_replicated"


def _attention_layout(model: nn.Module, tp_size: int) -> str:
    """How the attention of `model`'s tp plan is laid out on `tp_size` ranks, decided before any
    forward so that strict mode runs what parallelize accepts. Query head i reads KV head
    i // group (group = query heads / KV heads); tp gives each rank a block of query heads.

    - HEADS_SHARDED: tp divides the KV heads, every rank holds whole KV groups (the plan as written);
    - KV_REPLICATED: tp is a multiple of the KV heads, so every rank's query heads lie in one group;
      k_proj / v_proj stay whole and the attention rule reads that group's KV head locally;
    - ATTENTION_REPLICATED: any other KV count (3 KV heads on tp=2: rank 0's query heads 0-2 read KV
      heads 0 and 1, rank 1's 3-5 read 1 and 2 -- neither a block of KV heads per rank nor one group
      per rank, so no layout with sharded query heads runs); the attention runs whole on every tp rank.

    Refused (ValueError naming the config fields): query heads that tp does not divide, and query
    heads that are not a multiple of the KV heads."""
    text = _text_config(model)
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None)
    if tp_size <= 1 or not heads:
        return HEADS_SHARDED
    if heads % tp_size:
        raise ValueError(
            f"hypershard: parallelize: config.num_attention_heads={heads} is not divisible by the "
            f"tensor-parallel size {tp_size}; allowed: a tp size that divides it"
        )
    if kv is None:
        return HEADS_SHARDED
    if kv <= 0 or heads % kv:
        raise ValueError(
            f"hypershard: parallelize: config.num_attention_heads={heads} is not a multiple of "
            f"config.num_key_value_heads={kv}: the query heads cannot be grouped over the key/value "
            f"heads, so no tensor-parallel layout of the attention exists; allowed: "
            f"num_key_value_heads dividing num_attention_heads"
        )
    if kv % tp_size == 0:
        return HEADS_SHARDED
    group, local_heads = heads // kv, heads // tp_size
    return KV_REPLICATED if group % local_heads == 0 else ATTENTION_REPLICATED


def _attention_modules(plan: Mapping[str, str]) -> tuple:
    """The plan's attention module patterns (those with q_proj / k_proj / v_proj entries), each with a trailing dot."""
    return tuple(
        sorted(
            {
                pattern.rsplit(".", 1)[0] + "."
                for pattern in plan
                if pattern.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")
            }
        )
    )


def _lay_out_attention(plan: dict, model: nn.Module, tp_size: int) -> dict:
    """`plan` with its attention entries rewritten for `_attention_layout` (others as they are)."""
    layout = _attention_layout(model, tp_size)
    if layout == KV_REPLICATED:
        return {
            pattern: "replicate"
            if pattern.rsplit(".", 1)[-1] in ("k_proj", "v_proj") and str(name).startswith("colwise")
            else name
            for pattern, name in plan.items()
        }
    modules = _attention_modules(plan)
    if layout == HEADS_SHARDED or not modules:
        return plan
    text = _text_config(model)
    warnings.warn(
        f"hypershard: parallelize: {text.num_key_value_heads} key/value heads (grouped under "
        f"{text.num_attention_heads} query heads) cannot be laid out with the query heads sharded over "
        f"tp={tp_size} (tp neither divides them nor is a multiple of them): the attention modules "
        f"{list(modules)} are replicated on tp (every rank runs every head)",
        stacklevel=3,
    )
    # Unknown styles stay, for the check that names them.
    return {
        pattern: "replicate" if pattern.startswith(modules) and name in _STYLES else name
        for pattern, name in plan.items()
    }
