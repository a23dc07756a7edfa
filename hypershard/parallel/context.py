"""Context parallelism's layout convention (docs/context_parallel.md): head-tail (zig-zag) order.

A sequence sharded over a context-parallel axis of size n is cut into 2n chunks; rank i holds chunk
i and chunk 2n-1-i, so every rank has as much of a causal mask's triangle as any other. hypershard
stores such a sequence permuted: the DTensor's sequence dim holds the chunks in the order
0, 2n-1, 1, 2n-2, ..., so a plain Shard (rank i's block = stored blocks i) gives each rank its
two chunks (models for which that order is wrong keep the natural one: ``natural_order_reason``).
The mesh records the convention (``mesh.load_balanced_sequence_axis``); the attention
rule maps stored rows to positions through it. Everything indexed by position goes through the
same permutation BEFORE it is sharded: input ids, position ids (hence the RoPE tables computed
from them), labels -- shifted by one position first, in natural order (``shift_labels``) -- and
padding masks. Ops that treat tokens alike (embedding, linear layers, norms, a loss summed over
tokens) do not care about the order.

The causal-LM loss keeps the (batch, sequence) dims (``causal_lm_loss``): transformers' loss
flattens them into one token dim, which a rank's [sequences, tokens] block on a dp x cp mesh is a
contiguous range of only with one sequence per dp rank. An MoE block flattens them too; it treats
every token alone, so its input is handed over as one run of tokens per rank
(``tokens_in_rank_order``).

The Python side only computes the permutation and installs the loss; per-op logic (the mask from
positions, the all-gather of K/V and the reduce-scatter of their gradients, the loss's global
count) is in csrc/ops.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .. import _C

__all__ = [
    "head_tail_order",
    "to_head_tail",
    "from_head_tail",
    "shift_labels",
    "causal_lm_loss",
    "use_causal_lm_loss",
    "natural_order_reason",
    "is_moe_block",
    "tokens_in_rank_order",
]


def natural_order_reason(model: torch.nn.Module) -> Optional[str]:
    """Why `model` must keep its sequences in natural order on a cp mesh (None: head-tail order
    is safe). Head-tail order is a layout the attention rule knows; code that reads the stored order
    as positions is wrong under it:
    - transformers' DeepSeek-V3.2 builds the lightning indexer's 4-D causal mask from natural
      positions itself;
    - a vision-language model scatters image features into the embeddings in the stored order of
      the image tokens (masked_scatter), which is not their natural order once permuted;
    - a linear-attention recurrence (Qwen3.5's gated delta net) runs its state along the stored
      order, and its causal conv1d's halo reads natural neighbours;
    - an attention other than sdpa (eager: matmul, softmax) adds the causal mask transformers
      builds from natural positions (the stored order would be masked as if natural: silently
      wrong); only sdpa's causal call reaches the attention rule, which places the positions."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "index_topk", None) is not None:
        return "its lightning indexer's causal mask is built from natural positions"
    if getattr(config, "vision_config", None) is not None:
        return "image features are scattered into the embeddings in the stored order of the image tokens"
    from .linear_attention import is_gated_delta_net

    if "linear_attention" in (getattr(text, "layer_types", None) or ()) or any(
        map(is_gated_delta_net, model.modules())
    ):
        return "its linear-attention recurrence and causal conv1d run along natural positions"
    # transformers runs eager attention when none is set; the choice is read here, at parallelize
    attention = getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None) or "eager"
    if attention != "sdpa":
        return f"its {attention!r} attention adds a causal mask transformers builds from natural positions"
    return None


def head_tail_order(length: int, chunks: int) -> torch.Tensor:
    """order[j] = the natural position of stored row j, for a sequence of `length` in head-tail
    order of `chunks` (= 2 x the context-parallel size) chunks. `chunks` must divide `length`."""
    if chunks <= 0 or chunks % 2 or length % chunks:
        raise ValueError(
            f"hypershard: head_tail_order: a sequence of {length} cannot be split into {chunks} "
            f"head-tail chunks; allowed: an even number of chunks dividing the length (pad the "
            f"sequence to a multiple of 2 x the context-parallel size)"
        )
    size = length // chunks
    blocks = []
    for i in range(chunks // 2):
        blocks += [torch.arange(i * size, (i + 1) * size), torch.arange((chunks - 1 - i) * size, (chunks - i) * size)]
    return torch.cat(blocks)


def to_head_tail(t: torch.Tensor, dim: int, chunks: int) -> torch.Tensor:
    """`t` (natural order along `dim`) in head-tail order: stored row j = position order[j]."""
    return t.index_select(dim, head_tail_order(t.shape[dim], chunks).to(t.device))


def from_head_tail(t: torch.Tensor, dim: int, chunks: int) -> torch.Tensor:
    """The inverse of to_head_tail."""
    order = head_tail_order(t.shape[dim], chunks).to(t.device)
    return t.index_select(dim, torch.argsort(order))


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """labels[..., 1:] followed by `ignore_index`: position p's target is token p + 1 (what
    transformers' ForCausalLMLoss does inside the loss). Done on the WHOLE natural-order sequence,
    before the head-tail permutation and the sharding, so no shard boundary cuts a target off."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


_shifted = shift_labels  # causal_lm_loss's argument of the same name (transformers') hides it


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels: Optional[torch.Tensor] = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss without its flatten: logits [B, L, V] (upcast to float) are
    cross-entropied as [B, V, L] against labels [B, L], so a batch and a sequence sharded over
    different mesh axes stay two dims whatever the number of sequences per rank. The same
    semantics: `shift_labels` taken as given (else labels shifted by one, ignore_index at the
    end); sum / num_items_in_batch when that is given, else the mean over the non-ignored
    tokens -- of the whole GLOBAL batch, as the nll rule's mean is."""
    if logits.shape[-1] != vocab_size:
        raise ValueError(
            f"hypershard: causal_lm_loss: logits of shape {list(logits.shape)} do not end in "
            f"vocab_size {vocab_size}; allowed: logits [..., vocab_size]"
        )
    logits = logits.float()
    if shift_labels is None:
        if _C.is_dtensor(labels):
            # On a load-balanced mesh the stored sequence is in head-tail order: neighbouring
            # stored rows are not neighbouring positions, so shifting them picks wrong targets.
            raise ValueError(
                "hypershard: causal_lm_loss: distributed labels without shift_labels; allowed: "
                "shift_labels shifted over the whole natural-order sequence before the head-tail "
                "permutation (hypershard.parallel.context.shift_labels; parallelize's input hook "
                "passes them)"
            )
        shift_labels = _shifted(labels, ignore_index)
    shift_labels = shift_labels.to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    # The class dim second, as cross_entropy takes it for targets with several dims.
    loss = F.cross_entropy(logits.movedim(-1, 1), shift_labels, ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def use_causal_lm_loss(model: torch.nn.Module) -> None:
    """Makes a transformers model whose loss is ForCausalLMLoss use causal_lm_loss instead (its
    ``loss_function`` setter, on this instance only). Other models and losses are left as they are."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return
    if getattr(model, "loss_function", None) is ForCausalLMLoss:
        model.loss_function = causal_lm_loss


def is_moe_block(module: torch.nn.Module) -> bool:
    """A transformers MoE block (router ``gate`` and ``experts``): Qwen3.5-MoE's and Qwen3-VL-MoE's
    SparseMoeBlock, DeepSeek-V3.2's MoE. Its forward flattens [B, L, H] into tokens."""
    return isinstance(getattr(module, "gate", None), torch.nn.Module) and isinstance(
        getattr(module, "experts", None), torch.nn.Module
    )


def _tokens_as_one_run(hidden: torch.Tensor):
    """(tokens, back) for an MoE block's input [B, L, H] whose sequence is sharded and whose rank
    blocks hold two or more sequences, else None. `tokens` is [1, B x L, H] with every rank's
    block -- its sequences' tokens, in local order -- one contiguous range of the token dim
    (sharded over the batch's axes, then the sequence's); `back(output)` puts an output of that
    layout back in `hidden`'s. Differentiable (to_local / from_local), no communication. The
    token dim's order is the ranks' order, not (batch, sequence): right for a block that treats
    every token alone (router, experts, shared experts)."""
    if not _C.is_dtensor(hidden) or hidden.dim() != 3:
        return None
    layout = _C.layout_of(hidden)
    batch_axes, sequence_axes, hidden_axes = layout.dim_axes
    if not sequence_axes or hidden_axes or layout.has_partial():
        return None
    # Decided from the GLOBAL shape (the same on every rank): even blocks of two or more sequences
    sizes = layout.mesh.shape
    batch, length, width = layout.global_shape
    batch_parts = math.prod(sizes[a] for a in batch_axes)
    sequence_parts = math.prod(sizes[a] for a in sequence_axes)
    if batch % batch_parts or length % sequence_parts or batch // batch_parts < 2:
        return None  # one sequence per rank (the block's own flatten keeps it whole) or uneven blocks
    mesh = _C.device_mesh_of(hidden)
    local = layout.local_shape_at(mesh.position)
    run = _C.Layout.create(layout.mesh, [1, batch * length, width], [[], [*batch_axes, *sequence_axes], []])

    def back(output):
        if isinstance(output, tuple):  # (hidden, router logits): the logits stay in token-run order
            return (back(output[0]), *output[1:])
        if _C.layout_of(output) != run:
            output = _C.redistribute(output, run)
        return _C.from_local(_C.to_local(output).reshape(local), mesh, layout)

    return _C.from_local(_C.to_local(hidden).reshape(1, -1, width), mesh, run), back


def tokens_in_rank_order(block: torch.nn.Module) -> None:
    """Makes MoE block `block` (is_moe_block) take a sequence-sharded input with several
    sequences per rank: its forward sees the tokens as one run per rank (_tokens_as_one_run) and
    its output goes back to the input's layout. Without this, its flatten of (batch, sequence)
    would cut through the sharded sequence (strict mode refuses the view)."""
    forward = block.forward

    def run(hidden_states, *args, **kwargs):
        relaid = _tokens_as_one_run(hidden_states)
        if relaid is None:
            return forward(hidden_states, *args, **kwargs)
        tokens, back = relaid
        return back(forward(tokens, *args, **kwargs))

    block.forward = run
