"""Context parallelism inside pipeline stages: a cp axis on the stages' mesh (docs/pipelining.md).

Each stage is laid out by hs.parallelize on the mesh without pp, cp included: its parameters
Replicate on cp, the mesh declared load-balanced on cp when the model allows head-tail order
(hypershard.parallel.context.natural_order_reason), linear attention passed rank to rank, the
chosen cp_algorithm. What the pipeline adds:

- The first stage's inputs go through parallelize's own input hook with the cp axis
  (hypershard.parallel.inputs._shard_inputs): input ids and position ids permuted to head-tail
  order and sharded on their sequence dim, an all-ones attention mask -- the same calls as the
  non-pp path. A later stage has no input ids: it runs the same hook on a stand-in of their shape
  (``later_stage_inputs``), so its position ids and mask are the first stage's.
- The boundary: batch over dp, sequence over cp; every rank sends its own sequence shard of the
  hidden states, and the receiver rebuilds the DTensor from it (no gather).
- The loss: the labels shifted by one over the WHOLE natural-order sequence, permuted as the input
  ids were, and this rank's [batch over dp, sequence over cp] block taken (``local_targets``); the
  last stage's local logits are cross-entropied against that block, summed and divided by the
  global batch's trained tokens, so the ranks' losses (and gradients) add up to one device's.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..parallel.context import shift_labels, to_head_tail
from .split import _fail

__all__ = ["check_sequence", "later_stage_inputs", "local_targets", "sequence_parts"]


def sequence_parts(mesh, cp_axis: Optional[int], head_tail: bool) -> int:
    """The number of equal chunks a sequence is cut into: 2 x cp in head-tail order, cp in natural
    order, 1 without a cp axis."""
    if mesh is None or cp_axis is None:
        return 1
    return mesh.shape[cp_axis] * (2 if head_tail else 1)


def check_sequence(length: int, mesh, cp_axis: Optional[int], head_tail: bool) -> None:
    """On every rank before any collective: the sequence must split evenly over cp (the boundary's
    local shards are rebuilt into DTensors of cp x their length). hs.pipeline does not pad: the caller
    pads with labels -100 (hypershard.sft pads each batch to a multiple of 2 x cp)."""
    parts = sequence_parts(mesh, cp_axis, head_tail)
    if length % parts:
        order = f"head-tail order of {parts} chunks (2 x cp)" if head_tail else f"{parts} equal shards (natural order)"
        _fail(
            f"a sequence of {length} tokens cannot be split over cp={mesh.shape[cp_axis]} in {order}",
            f"sequences padded to a multiple of {parts}",
        )


def local_targets(
    labels: torch.Tensor, mesh, dp_axes: Sequence[int], cp_axis: Optional[int], head_tail: bool
) -> torch.Tensor:
    """This rank's block of position p's target (token p + 1) for the microbatch's global `labels`
    [batch, seq]: shifted over the whole natural-order sequence FIRST (no shard boundary cuts a
    target off), permuted to head-tail order when the mesh is load-balanced, then the rows of this
    rank's dp coordinates and the columns of its cp coordinate (the stored order's even blocks, as
    Shard(1) lays the logits out)."""
    targets = shift_labels(labels)
    if head_tail:
        targets = to_head_tail(targets, targets.dim() - 1, sequence_parts(mesh, cp_axis, True))
    for axis in dp_axes:
        targets = targets.chunk(mesh.shape[axis], 0)[mesh.coordinate(axis)]
    return targets.chunk(mesh.shape[cp_axis], 1)[mesh.coordinate(cp_axis)].contiguous()


def later_stage_inputs(shard_hook, model, side: dict, batch: int, length: int) -> dict:
    """A later stage's keyword inputs on a cp mesh: parallelize's input hook run on a stand-in of
    the input ids' shape [batch, length] (zeros; dropped again), so the position ids (arange, or the
    side's M-RoPE ids) and the all-ones attention mask are made, permuted and sharded exactly as
    for the first stage."""
    stand_in = torch.zeros(batch, length, dtype=torch.long)
    _, kwargs = shard_hook(model, (), {"input_ids": stand_in, **side})
    kwargs.pop("input_ids")
    return kwargs
