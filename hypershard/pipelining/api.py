"""hs.pipeline: a HuggingFace decoder model split into pipeline stages (hypershard.pipelining.split),
each stage's parameters hypershard DTensors on its sub-mesh (the mesh without the pp axis, laid out
by hs.parallelize: dp, tp, ep, cp), run by torch.distributed.pipelining's own stages and schedules
(GPipe, 1F1B, Interleaved1F1B) over the pp axis's process group.

What crosses a stage boundary: the LOCAL tensor of the hidden states, in the boundary layout
(the batch dim sharded over the dp axes, the sequence dim over cp, Replicate elsewhere: each rank
sends its own sequence shard; hypershard.pipelining.context); the receiver rebuilds the DTensor
from it and that layout with DTensor.from_local (no gather, no collective). A stage whose output is
laid out otherwise (a Partial left by a row-parallel layer, say) is redistributed to the boundary
layout first.

The loss: the global batch is split into microbatches along dim 0 (each one then over dp); the
last stage computes the model's own loss_function per microbatch with num_items_in_batch = the
trained tokens of the WHOLE global batch (HF's causal-LM loss is a mean over the non-ignored
shifted labels), so the microbatch losses add up to one device's loss over the same tokens and
their gradients to its gradient (schedule scale_grads=False). Gradient reduction over dp: the
dp all-reduces of every microbatch's backward are held and done once per step (hypershard's
gradient buckets, hypershard._C.hold_grad_sync).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from .. import _C
from ..parallel import parallelize
from ..parallel.context import natural_order_reason
from ..parallel.inputs import _rope_index, _shard_inputs
from ..tensor.axes import note_axes_used
from ..tensor.dtensor import DTensor, distribute_tensor
from ..tensor.placement_types import Replicate, Shard
from .context import check_sequence, later_stage_inputs, local_targets
from .recompute_and_precision import apply_stage_options, stage_options
from .shapes import DEFAULT_MAX_SHAPES, SchedulesByShape, check_max_shapes
from .split import SCHEDULES, StageSpec, _fail, check_schedule, image_token_counts, split_model, stage_model, text_model

__all__ = ["Pipeline", "StageModule", "pipeline"]


class StageModule(nn.Module):
    """What torch's PipelineStage runs for one stage: `model` is the stage's pruned copy of the HF
    model (hypershard.pipelining.split.stage_model). Its forward takes the global microbatch of
    input ids (first stage) or the previous stage's local hidden states, and returns the local
    hidden states (or, on the last stage, the local logits). Per-microbatch side inputs (images,
    M-RoPE position ids) come from `side`, one dict per microbatch, indexed by `microbatch` (the
    index torch's stage runs, set by _Stage.forward_one_chunk). Not a count of forward calls: torch
    runs the module once more before the first microbatch to infer the boundary metadata (on the
    first microbatch's inputs), and a counter then handed every microbatch the next one's images
    and position ids (the Qwen3-VL-MoE pp2 x dp2 error of issue 46)."""

    def __init__(
        self,
        model: nn.Module,
        spec: StageSpec,
        mesh=None,
        dp_axes: Sequence[int] = (),
        cp_axis: Optional[int] = None,
        head_tail: bool = False,
    ):
        super().__init__()
        self.model = model
        self.spec = spec
        self.mesh = mesh
        self.dp_axes = list(dp_axes)
        self.cp_axis = cp_axis  # the sequence sharded over it (hypershard.pipelining.context)
        self.side: list = []
        self.microbatch = 0
        self._shard = _shard_inputs(mesh, self.dp_axes, cp_axis, head_tail) if mesh is not None else None

    def boundary(self) -> list:
        placements: list = [Replicate()] * self.mesh.ndim
        for axis in self.dp_axes:
            placements[axis] = Shard(0)
        if self.cp_axis is not None:  # each rank's sequence shard crosses the boundary
            placements[self.cp_axis] = Shard(1)
        return placements

    def dp_size(self) -> int:
        size = 1
        for axis in self.dp_axes:
            size *= self.mesh.shape[axis]
        return size

    def _position_ids(self, side: dict) -> None:
        """M-RoPE position ids (3, batch, seq) split over dp on their batch dim, dim 1 (parallelize's
        input hook reads that layout only with a cp axis)."""
        ids = side.get("position_ids")
        if self.mesh is not None and isinstance(ids, torch.Tensor) and ids.dim() == 3 and not _C.is_dtensor(ids):
            placements = self.boundary()
            for axis in self.dp_axes:
                placements[axis] = Shard(1)
            side["position_ids"] = distribute_tensor(ids, self.mesh, placements)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = dict(self.side[self.microbatch]) if self.microbatch < len(self.side) else {}
        images = side.pop("images", {})
        if self.cp_axis is None:  # with cp, the input hook lays them out (batch over dp, sequence over cp)
            self._position_ids(side)
        if self.spec.first:
            kwargs = {"input_ids": x, **images, **side}
            if self._shard is not None:
                _, kwargs = self._shard(self.model, (), kwargs)
            kwargs["use_cache"] = False  # (the cp input hook sets it too)
            hidden = self.model.model(**kwargs).last_hidden_state
        else:
            if self._shard is not None:
                cp = self.mesh.shape[self.cp_axis] if self.cp_axis is not None else 1
                shape = [x.shape[0] * self.dp_size(), x.shape[1] * cp, *x.shape[2:]]
                if self.cp_axis is None:
                    _, side = self._shard(self.model, (), side)
                else:
                    side = later_stage_inputs(self._shard, self.model, side, shape[0], shape[1])
                side.pop("use_cache", None)
                x = DTensor.from_local(x, self.mesh, self.boundary(), shape=shape)
            hidden = text_model(self.model)(inputs_embeds=x, use_cache=False, **side).last_hidden_state
        out = self.model.lm_head(hidden) if self.spec.last else hidden
        if self._shard is None:
            return out
        if tuple(out.placements) != tuple(self.boundary()):
            out = out.redistribute(self.mesh, self.boundary())
        return out.to_local()


@functools.lru_cache(maxsize=None)
def _stage_class():
    """torch's PipelineStage, telling its StageModule which microbatch each forward runs."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
            self.submod.microbatch = fwd_chunk_id
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
            # fully_shard inside the stage: the gradients of the step's microbatches accumulate
            # unreduced in each group; the schedule's last backward of this stage reduce-scatters
            # their sum, once per step (FSDP2's set_requires_gradient_sync, as torch's own stage
            # does for torch's FSDP)
            for group in _fully_shard_groups(self.submod):
                group.requires_sync = bool(last_backward)
            return super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )

    return _Stage


def _fully_shard_groups(module: nn.Module) -> list:
    return [m._hs_fully_shard for m in module.modules() if hasattr(m, "_hs_fully_shard")]


def _fully_shard_stage(module: StageModule, submesh, dp_names: list) -> None:
    """hs.fully_shard on each decoder layer the stage owns, then on the StageModule itself (the
    root: what torch's stage calls, so its gather covers the embeddings, a vision tower, the final
    norm and the head), over the stage's dp axis."""
    from ..fsdp.fully_shard import _owned_parameters, fully_shard

    names = list(submesh.mesh_dim_names) if submesh is not None else []
    dp = [n for n in dp_names if n in names]
    if len(dp) != 1:
        _fail(f"fully_shard inside a stage needs one dp axis on the stage's mesh {names}, got {dp}", "a dp axis")
    layers = text_model(module.model).layers
    for i in module.spec.layers:
        fully_shard(layers[i], submesh, dp_axis=dp[0])
    if _owned_parameters(module):
        fully_shard(module, submesh, dp_axis=dp[0])
        return
    # A middle stage of an interleaved schedule holds only layers: its last layer's group is the
    # root of them all (kept gathered from its forward to its backward, as a root is; the others
    # freed after each forward and prefetched in order)
    groups = [layers[i]._hs_fully_shard for i in module.spec.layers]
    for group in groups:
        group.context = groups[-1].context


def _dp_chunk(t: torch.Tensor, mesh, dp_axes: Sequence[int]) -> torch.Tensor:
    """This rank's rows of `t` when dim 0 is sharded over `dp_axes` (major first), evenly."""
    for axis in dp_axes:
        t = t.chunk(mesh.shape[axis], 0)[mesh.coordinate(axis)]
    return t


def _split_images(input_ids: torch.Tensor, inputs: dict, counts, n: int) -> list:
    """The image inputs of each of `n` microbatches: each sample's images are the next ones in
    order (as many as its image tokens cover), their patches the next rows of pixel_values."""
    if "pixel_values" not in inputs:
        return [{} for _ in range(n)]
    token, merge = counts
    grid = inputs["image_grid_thw"]
    tokens_per_image = (grid.prod(-1) // merge**2).tolist()
    patches_per_image = grid.prod(-1).tolist()
    per_mb = input_ids.shape[0] // n
    out, image, patch = [], 0, 0
    for k in range(n):
        ids = input_ids[k * per_mb : (k + 1) * per_mb]
        need, first_image, first_patch = int((ids == token).sum()), image, patch
        while need > 0:
            need -= tokens_per_image[image]
            patch += patches_per_image[image]
            image += 1
        mb = {"pixel_values": inputs["pixel_values"][first_patch:patch], "image_grid_thw": grid[first_image:image]}
        if "mm_token_type_ids" in inputs:
            mb["mm_token_type_ids"] = inputs["mm_token_type_ids"][k * per_mb : (k + 1) * per_mb]
        out.append(mb if image > first_image else {})
    return out


class Pipeline:
    """The stages of this rank and their schedule. ``step(input_ids, labels, **inputs)`` runs one
    forward and backward of the global batch and returns one device's loss over it (the same value
    on every rank); then ``clip_grad_norm_`` and an optimizer over ``parameters()`` as usual."""

    def __init__(
        self,
        model: nn.Module,
        mesh=None,
        *,
        n_microbatches: int,
        schedule: str = "1f1b",
        stages_per_rank: int = 1,
        pp_axis: str = "pp",
        dp_axis: Union[str, Sequence[str]] = "dp",
        cp_axis: str = "cp",
        cp_load_balance: Optional[bool] = None,
        fully_shard: bool = False,
        recompute: Optional[str] = None,
        mixed_precision=None,
        max_shapes: int = DEFAULT_MAX_SHAPES,
        **parallelize_kwargs,
    ):
        recompute_mode, policy = stage_options(recompute, mixed_precision)
        check_max_shapes(max_shapes)

        names = list(mesh.mesh_dim_names) if mesh is not None else []
        if mesh is not None and pp_axis not in names:
            _fail(f"the mesh {names} has no axis {pp_axis!r}", "a mesh with a pp axis")
        pp_index = names.index(pp_axis) if mesh is not None else None
        self.pp = mesh.shape[pp_index] if mesh is not None else 1
        self.pp_rank = mesh.coordinate(pp_index) if mesh is not None else 0
        self.schedule_name = schedule
        self.n_microbatches = n_microbatches
        check_schedule(schedule, self.pp, stages_per_rank, n_microbatches)
        self.specs = split_model(model, self.pp, stages_per_rank)
        self._image_counts = image_token_counts(model)
        self._vision_outer = model.model if self._image_counts is not None else None
        self._loss_function = model.loss_function
        self._vocab_size = getattr(model.config, "text_config", model.config).vocab_size
        rest = [n for n in names if n != pp_axis]
        self.mesh = mesh
        self.submesh = mesh[rest] if rest else None
        dp_names = [dp_axis] if isinstance(dp_axis, str) else list(dp_axis)
        self.dp_axes = [rest.index(a) for a in dp_names if a in rest]
        self.pp_group = mesh.group(pp_index) if mesh is not None else None
        # a cp axis: the sequence sharded over it in every stage (hypershard.pipelining.context);
        # head-tail order decided once from the whole model, so every stage stores it alike
        self.cp_axis = rest.index(cp_axis) if cp_axis in rest else None
        if self.cp_axis is not None and cp_load_balance is None:
            cp_load_balance = natural_order_reason(model) is None
        self.head_tail = bool(self.cp_axis is not None and cp_load_balance)
        if self.cp_axis is not None and fully_shard:
            _fail("fully_shard inside a stage with a cp axis is not supported yet", "fully_shard on a pp x dp mesh")
        self.modules: list = []
        for spec in self.specs:
            if spec.rank != self.pp_rank:
                continue
            part = stage_model(model, spec)
            if self.submesh is not None:
                parallelize(
                    part,
                    self.submesh,
                    shard_inputs=False,
                    dp_axis=dp_names,
                    cp_axis=cp_axis,
                    cp_load_balance=cp_load_balance,
                    **parallelize_kwargs,
                )
                note_axes_used(self.submesh, [rest[a] for a in self.dp_axes])
            module = StageModule(part, spec, self.submesh, self.dp_axes, self.cp_axis, self.head_tail)
            if fully_shard:
                _fully_shard_stage(module, self.submesh, dp_names)
            apply_stage_options(module, recompute_mode, policy)  # hypershard.pipelining.recompute_and_precision
            self.modules.append(module)
        # torch's stages and schedule, one pair per batch shape over these same modules
        # (hypershard.pipelining.shapes); `stages` / `schedule` are the current shape's
        self.stages: list = []
        self.schedule = None
        self.schedules: Optional[SchedulesByShape] = None
        if mesh is not None:
            self.schedules = SchedulesByShape(self._build_schedule, max_shapes)
            self.stages, self.schedule = self.schedules.unclaimed
        self._num_items = 1
        self._shape: Optional[tuple] = None

    def _build_schedule(self) -> tuple:
        """Fresh torch stages over this rank's StageModules and their schedule (no communication:
        torch infers the boundary metadata on the schedule's first step)."""
        from torch.distributed import pipelining

        device = torch.device(self.mesh.device_type)
        stages = [
            _stage_class()(module, module.spec.index, len(self.specs), device, group=self.pp_group)
            for module in self.modules
        ]
        cls = getattr(pipelining, SCHEDULES[self.schedule_name])
        run = stages if self.schedule_name == "interleaved_1f1b" else stages[0]
        return stages, cls(run, self.n_microbatches, loss_fn=self._schedule_loss, scale_grads=False)

    def _schedule_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # looked up at each call, so every shape's schedule runs the current _microbatch_loss
        return self._microbatch_loss(logits, labels)

    # ------------------------------------------------------------------ parameters

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """(name in the full model, parameter) of this rank's stages."""
        for module in self.modules:
            yield from module.model.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self) -> dict:
        """This rank's stages' state dicts merged: a slice of the full model's state dict, under its
        names (a stage is a pruned copy of the model). hypershard.checkpoint.save/load take a
        Pipeline as the model: each pp rank writes and reads its stages' entries, the dp/tp/ep
        shards as for any parallelized model, so the checkpoint holds the full model's names
        once and loads into another split or a model without pp."""
        state: dict = {}
        for module in self.modules:
            state.update(module.model.state_dict())
        return state

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def train(self, mode: bool = True) -> "Pipeline":
        """Sets this rank's stages to training (or eval) mode, as nn.Module.train."""
        for module in self.modules:
            module.train(mode)
        return self

    def eval(self) -> "Pipeline":
        return self.train(False)

    # ------------------------------------------------------------------ a step

    def check_batch(self, batch: int, length: Optional[int] = None) -> None:
        """The batch checks (and with a cp axis the sequence length's), on every rank before any
        collective."""
        n = self.n_microbatches
        if batch % n:
            _fail(f"{n} microbatches do not divide the batch of {batch}", f"a divisor of {batch}")
        dp = 1
        for axis in self.dp_axes:
            dp *= self.submesh.shape[axis]
        if (batch // n) % dp:
            _fail(
                f"a microbatch of {batch // n} samples cannot be split evenly over dp size {dp}",
                f"microbatches of a multiple of {dp} samples",
            )
        if length is not None:
            check_sequence(length, self.submesh, self.cp_axis, self.head_tail)

    def _microbatch_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """HF's causal-LM loss of this rank's tokens of one microbatch, summed and divided by the
        global batch's trained tokens."""
        shifted = {}
        if self.cp_axis is not None:  # the targets shifted over the whole sequence, then this rank's block
            labels = local_targets(labels, self.submesh, self.dp_axes, self.cp_axis, self.head_tail)
            shifted = {"shift_labels": labels}
        elif self.submesh is not None:
            labels = _dp_chunk(labels, self.submesh, self.dp_axes)
        return self._loss_function(
            logits=logits, labels=labels, vocab_size=self._vocab_size, num_items_in_batch=self._num_items, **shifted
        )

    def _side_inputs(self, input_ids: torch.Tensor, inputs: dict) -> list:
        n = self.n_microbatches
        per_mb = input_ids.shape[0] // n
        side = [{} for _ in range(n)]
        if self._image_counts is not None:
            images = _split_images(input_ids, inputs, self._image_counts, n)
            for k in range(n):
                ids = input_ids[k * per_mb : (k + 1) * per_mb]
                kwargs = {"input_ids": ids, **images[k]}
                position_ids = _rope_index(self._vision_outer, kwargs)
                if position_ids is not None:
                    side[k]["position_ids"] = position_ids
                side[k]["images"] = {key: v for key, v in images[k].items()}
        return side

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, **inputs) -> float:
        """Forward and backward of the global batch (the same tensors on every rank); returns one
        device's loss over it. Gradients accumulate into the stages' parameters' .grad."""
        if self.schedule is None:
            _fail("a pipeline without a mesh cannot run a schedule", "a mesh with a pp axis")
        self.check_batch(input_ids.shape[0], input_ids.shape[-1])
        unknown = set(inputs) - {"pixel_values", "image_grid_thw", "mm_token_type_ids"}
        if unknown:
            _fail(f"inputs {sorted(unknown)} are not passed through the pipeline", "input_ids, labels and images")
        # the same global shape on every rank: the same cached / built / dropped pair everywhere
        self._shape = tuple(input_ids.shape)
        self.stages, self.schedule = self.schedules.get(self._shape)
        self._num_items = int((labels[:, 1:] != -100).sum())
        side = self._side_inputs(input_ids, inputs)
        for module in self.modules:
            module.side, module.microbatch = side, 0
        losses: list = []
        last = self.specs[-1].rank == self.pp_rank
        with hold_grad_sync():
            self.schedule.step(input_ids, target=labels, losses=losses)
        for stage in self.stages:  # an idle shape's stages keep no outputs (the last stage's logits)
            stage.clear_runtime_states()
        total = torch.zeros((), dtype=torch.float64)
        if last:
            total = sum(loss.detach().to(torch.float64) for loss in losses)
            for axis in self.dp_axes + ([self.cp_axis] if self.cp_axis is not None else []):
                dist.all_reduce(total, group=self.submesh.group(axis))
        dist.broadcast(total, group=self.pp_group, group_src=self.specs[-1].rank)
        return float(total)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_ over every stage's gradients: the squared norms of this
        rank's stages added, then summed over the pp axis."""
        squares = torch.zeros((), dtype=torch.float64)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        for g in grads:
            norm = torch.linalg.vector_norm(g)
            if _C.is_dtensor(norm):
                norm = norm.to_local()
            squares += norm.detach().to(torch.float64) ** 2
        if self.pp_group is not None:
            dist.all_reduce(squares, group=self.pp_group)
        total = float(squares.sqrt())
        coef = min(max_norm / (total + 1e-6), 1.0)
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
        return total


@contextlib.contextmanager
def hold_grad_sync():
    """Holds the dp gradient reductions of the backward passes inside (one per microbatch) and
    does them once on exit (hypershard._C.hold_grad_sync); without that binding, a no-op."""
    hold = getattr(_C, "hold_grad_sync", None)
    if hold is None:
        yield
        return
    hold(True)
    try:
        yield
    finally:
        hold(False)


def pipeline(
    model: nn.Module,
    mesh,
    *,
    n_microbatches: int,
    schedule: str = "1f1b",
    stages_per_rank: Optional[int] = None,
    **kwargs,
) -> Pipeline:
    """Splits `model` over `mesh`'s pp axis (hypershard.pipelining.split), lays each stage out on
    the rest of the mesh with hs.parallelize and returns the Pipeline (its stages and schedule).
    `stages_per_rank`: virtual stages per rank (default 2 for interleaved_1f1b, else 1).
    `fully_shard=True`: each stage's decoder layers, then its root, hs.fully_shard'ed over the dp
    axis (gathered per microbatch, gradients reduce-scattered once per step; docs/pipelining.md).
    `recompute="full" | "selective"`: hs.recompute on each stage's decoder layers, after fully_shard;
    `mixed_precision=True` (bf16 compute, fp32 masters and gradient sums) or a hs.MixedPrecisionPolicy:
    hs.mixed_precision on each stage, last (hypershard.pipelining.recompute_and_precision).
    Batches may change shape from step to step (sequence length, batch size): torch's stages and
    schedule are built per shape over the same stage modules, the `max_shapes` (default 8) most
    recently used kept (hypershard.pipelining.shapes)."""
    if stages_per_rank is None:
        stages_per_rank = 2 if schedule == "interleaved_1f1b" else 1
    return Pipeline(
        model, mesh, n_microbatches=n_microbatches, schedule=schedule, stages_per_rank=stages_per_rank, **kwargs
    )
