"""Context parallelism's layout convention (docs/context_parallel.md): head-tail (zig-zag) order.

A sequence sharded over a context-parallel axis of size n is cut into 2n chunks; rank i holds chunk
i and chunk 2n-1-i, so every rank has as much of a causal mask's triangle as any other. hypershard
stores such a sequence permuted: the DTensor's sequence dim holds the chunks in the order
0, 2n-1, 1, 2n-2, ..., so a plain Shard (rank i's block = stored blocks i) gives each rank its
two chunks. The mesh records the convention (``mesh.load_balanced_sequence_axis``); the attention
rule maps stored rows to positions through it. Everything indexed by position goes through the
same permutation BEFORE it is sharded: input ids, position ids (hence the RoPE tables computed
from them), labels -- shifted by one position first, in natural order (``shift_labels``) -- and
padding masks. Ops that treat tokens alike (embedding, linear layers, norms, a loss summed over
tokens) do not care about the order.

The Python side only computes the permutation; per-op logic (the mask from positions, the
all-gather of K/V and the reduce-scatter of their gradients) is in csrc/ops/attention.cpp.
"""

from __future__ import annotations

import torch

__all__ = ["head_tail_order", "to_head_tail", "from_head_tail", "shift_labels"]


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
