"""Batches whose shape changes from step to step through one Pipeline (docs/pipelining.md).

torch's PipelineStage infers its boundary metadata (the shapes and dtypes of what crosses to the
next stage, and of the gradients coming back) once, on the first step its schedule runs, and sizes
its P2P receive buffers from it (stage.py: _prepare_forward_infra / _prepare_backward_infra, run by
the schedule's _initialize_pp_stages only while not yet initialised; later steps reuse the buffers
and check nothing). A batch of another shape would be received into buffers of the old one. torch
re-infers only on an eval <-> train switch.

So each batch shape gets its own torch stage objects and schedule, built by torch's public
constructors over the SAME StageModules (the same parameters, fully_shard groups, recomputation
and precision hooks): a PipelineStage holds only the module, its stage index, the pp group and the
per-shape buffers. Built lazily on the first step of a shape, kept by shape, least recently used
dropped beyond `max_shapes` (its buffers freed; the shape, if it comes back, is built again).

Why no rank can disagree: every rank is handed the same global batch, so every rank sees the same
sequence of shapes and makes the same hit / build / drop decision at the same step with no
agreement. The constructors do no communication (dist.get_rank / get_world_size of the pp group
only). The first step of a new entry runs torch's initialisation inside schedule.step, on every
rank in that same step: the warm-up vote and the metadata as P2P between neighbouring stages (both
building it), and one forward and input-gradient backward of the first microbatch per stage,
whose collectives (tp, ep, cp, fully_shard's gathers) run on the stage's sub-mesh, whose ranks all
hold the same stages -- the same calls the first step of the first shape makes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from .split import _fail

__all__ = ["DEFAULT_MAX_SHAPES", "SchedulesByShape", "check_max_shapes"]

# Each entry holds, per stage of this rank, a receive buffer of one microbatch's boundary activations
# and one of their gradients per microbatch (torch's args_recv_info / grad_recv_info): about
# 2 x n_microbatches x (microbatch / dp) x (seq / cp) x hidden elements per stage and shape.
DEFAULT_MAX_SHAPES = 8


def check_max_shapes(max_shapes) -> int:
    """On every rank before any collective (hs.pipeline's argument)."""
    if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
        _fail(f"max_shapes={max_shapes!r} is not a number of batch shapes", "an int >= 1")
    return max_shapes


class SchedulesByShape:
    """(torch stages, schedule) per batch shape. `build()` makes a fresh pair over the pipeline's
    StageModules. The first pair is built at once (so `Pipeline.stages` / `.schedule` exist before the
    first step) and taken by the first shape; `built` and `dropped` count pairs made and let go."""

    def __init__(self, build: Callable[[], tuple], max_shapes: int = DEFAULT_MAX_SHAPES):
        self._build = build
        self.max_shapes = check_max_shapes(max_shapes)
        self._entries: OrderedDict = OrderedDict()
        self.unclaimed = build()
        self.built, self.dropped = 1, 0

    def shapes(self) -> list:
        """The shapes held, least recently used first."""
        return list(self._entries)

    def get(self, shape: tuple) -> tuple:
        """The pair for `shape`: the held one (now the most recent), else the unclaimed first pair or a
        new one; beyond max_shapes the least recently used is dropped first."""
        if shape in self._entries:
            self._entries.move_to_end(shape)
            return self._entries[shape]
        if len(self._entries) >= self.max_shapes:
            self._entries.popitem(last=False)
            self.dropped += 1
        if self.unclaimed is not None:
            pair, self.unclaimed = self.unclaimed, None
        else:
            pair = self._build()
            self.built += 1
        self._entries[shape] = pair
        return pair
