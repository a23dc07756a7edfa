"""HyperParallelTrainer: LlamaFactory's own SFT trainer (and so HF's Trainer loop) with hypershard
as the distributed backend.

Everything LlamaFactory and HF do stays theirs: the dataset, template and collator, the sampler
and its order, gradient accumulation, loss normalisation (num_items_in_batch), clipping, the
optimizer and the LR schedule, logging and callbacks. What changes is only where a multi-process
HF run would do data parallelism itself:

- the model is distributed in place by ``hs.parallelize`` (the HF tp / ep plans) and optionally
  ``hs.fully_shard``; its forward pre-hook shards every input on the batch dim over ``dp``;
- so every rank must feed the SAME global micro-batch: the dataloader is prepared as for ONE
  process (accelerate's own sampler, seeded the same on every rank) with per_device_train_batch_size
  x dp sequences -- exactly what a single-process run with that batch size reads;
- the accelerator never wraps the model in DDP (hypershard's gradient reductions already sum over
  dp) and its ``gather`` does not concatenate identical copies from every rank;
- a VLM's mrope ``position_ids`` from LlamaFactory's collator, shaped (4, batch, seq), are split on
  their batch dim (1) over dp, like the text they belong to, before the model's hook (which would
  split dim 0, the 4 rope rows) sees them;
- HF's ``torch_compile=True`` compiles through ``hs.compile`` (the local program with its
  collectives in the graph, docs/compile.md) instead of accelerate's ``torch.compile(model)``,
  which would graph-break at every DTensor;
- token counts are not summed over processes (``average_tokens_across_devices`` off): every rank
  already counts the whole global batch;
- checkpoints are written shard-wise (hypershard.checkpoint / DCP) inside HF's ``checkpoint-N``
  folders, next to HF's trainer_state.json, scheduler.pt and per-rank RNG files, and load onto
  any mesh; ``save_model()`` writes a HuggingFace folder (checkpoint.export_hf) that
  ``from_pretrained`` loads on one device.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from .args import HyperParallelArguments

try:  # the trainer LlamaFactory's own sft stage uses
    from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer
except ImportError as error:  # pragma: no cover - only without LlamaFactory
    raise ImportError(
        "hypershard: llamafactory: LlamaFactory is not installed (make setup installs requirements-llamafactory.txt)"
    ) from error

from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DistributedType, DynamoBackend
from transformers import TrainerCallback

__all__ = ["HyperParallelTrainer", "HyperParallelArguments"]

SCHEDULER_NAME = "scheduler.pt"
# Fault injection for tests: rank CRASH_RANK_ENV (default 1) exits with os._exit(1) as step
# CRASH_ENV begins, i.e. after the checkpoints of the steps before it were written.
CRASH_ENV = "HYPERSHARD_LLAMAFACTORY_CRASH_AT_STEP"
CRASH_RANK_ENV = "HYPERSHARD_LLAMAFACTORY_CRASH_RANK"
FAIL_SAVE_ENV = "HYPERSHARD_LLAMAFACTORY_FAIL_SAVE_AT_STEP"  # rank CRASH_RANK_ENV's save of that step: ENOSPC
SHARDS_DIR = "hypershard"  # checkpoint-N/hypershard/step_NNNNNNNN: the DCP shards of model + optimizer


def _rank_world() -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _plain(t):
    """A hypershard DTensor -> its global value as a plain tensor (scalars: losses, norms)."""
    from hypershard import _C

    if isinstance(t, torch.Tensor) and _C.is_dtensor(t):
        return t.full_tensor()
    return t


class _HypershardAccelerator(Accelerator):
    """HF's accelerator, less its own data parallelism (see the module docstring). Installed on the
    trainer's accelerator by changing its class, so that every setting HF gave it stays."""

    _hs_preparing_model = False

    @property
    def multi_device(self):
        return False if self._hs_preparing_model else super().multi_device

    @property
    def distributed_type(self):
        # While preparing the model, accelerate sees one process: it would otherwise wrap it in DDP,
        # while hypershard already reduces the dp gradients; autocast (bf16) still applies.
        return DistributedType.NO if self._hs_preparing_model else super().distributed_type

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        plugin = self.state.dynamo_plugin
        backend = plugin.backend
        if backend != DynamoBackend.NO:
            # HF's torch_compile (module docstring): hypershard.compile, with accelerate's settings;
            # accelerate's own torch.compile(model) is skipped
            from hypershard.compile import compile as hypershard_compile

            kwargs = plugin.to_kwargs()
            if _rank_world()[0] == 0 and not hasattr(model, "_hypershard_compiled"):
                print(
                    f"hypershard: torch_compile: the model's forward compiles through hypershard.compile({kwargs})",
                    flush=True,
                )
            hypershard_compile(model, **kwargs)
            plugin.backend = DynamoBackend.NO
        self._hs_preparing_model = True
        try:
            return super().prepare_model(model, device_placement=False, evaluation_mode=evaluation_mode)
        finally:
            self._hs_preparing_model = False
            plugin.backend = backend

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        # As accelerate prepares it for ONE process: every rank reads the whole global batch, in the
        # same order (the seedable sampler draws from the same seed on every rank).
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return data_loader
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=1,
            process_index=0,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=self.dispatch_batches,
            even_batches=self.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return prepared

    def gather(self, tensor):
        # Every rank holds the same global values (losses, token counts, eval outputs): a gather
        # would count them world times.
        return tensor

    def gather_for_metrics(self, input_data, use_gather_object=False):
        return input_data

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        return _plain(super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type))


class _CrashAtStep(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os._exit(1)


class _NoteStep(TrainerCallback):
    """What a failed collective's report says this rank was doing (hypershard.launch.faults.note)."""

    def on_step_begin(self, args, state, control, **kwargs):
        from hypershard.launch import faults

        faults.note(f"in step {state.global_step + 1} of {state.max_steps}")


class HyperParallelTrainer(CustomSeq2SeqTrainer):
    """The trainer LlamaFactory's hyper_parallel workflow builds (the ``use_hyper_parallel``
    contract): keyword arguments as CustomSeq2SeqTrainer's plus ``hp_args``."""

    def __init__(
        self,
        hp_args: Optional[HyperParallelArguments] = None,
        model=None,
        args=None,
        finetuning_args=None,
        processor=None,
        **kwargs: Any,
    ) -> None:
        import hypershard as hs

        from .adapters import check_finetuning, unwrap_peft

        hp_args = hp_args if hp_args is not None else HyperParallelArguments()
        rank, world = _rank_world()
        quantized = getattr(model, "quantization_method", None) or getattr(model, "is_quantized", False)
        self.finetuning_type = check_finetuning(finetuning_args, quantized or None, fail=hp_args._fail)
        shape, names = hp_args.mesh_spec(world)
        hp_args.check_model(model)
        self.hp_args = hp_args
        self.mesh = hs.init_device_mesh("cpu", shape, names)
        if rank == 0:
            mesh_text = " x ".join(f"{n}{s}" for n, s in zip(names, shape))
            print(f"hypershard: llamafactory: {self.finetuning_type} fine-tuning on the mesh {mesh_text}", flush=True)
        self.dp_size = shape[0]
        self.cp_size = hp_args.cp_size
        # peft: the HF model inside is what the plans name and what the hooks go on
        self._base_model, self._peft_model = unwrap_peft(model)
        self._distribute(self._base_model, args)
        if self.cp_size > 1:
            _pad_for_context_parallelism(kwargs.get("data_collator"), self.cp_size)
        # Every rank counts the whole global batch's tokens: summing them over the processes (and
        # multiplying the loss back by the process count) would count them world times.
        args.average_tokens_across_devices = False
        super().__init__(model=model, args=args, finetuning_args=finetuning_args, processor=processor, **kwargs)
        # A "device" in HF's batch size is one data-parallel rank: the global micro-batch, which
        # every rank reads whole and the model's input hook splits over dp.
        self._train_batch_size = args.per_device_train_batch_size * self.dp_size
        crash = os.environ.get(CRASH_ENV)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # torchrun restarts run clean
        if crash and first_attempt and rank == int(os.environ.get(CRASH_RANK_ENV, min(1, world - 1))):
            self.add_callback(_CrashAtStep(int(crash)))

    # --------------------------------------------------------------------------- distribution

    def _distribute(self, model, training_args=None) -> None:
        from hypershard import _C
        from hypershard.parallel import parallelize

        from . import loading

        hp = self.hp_args
        plan = None if hp.tp_plan == "auto" else dict(hp.tp_plan)
        ep_plan = None if hp.ep_plan == "auto" else dict(hp.ep_plan)
        on_meta = getattr(model, loading.SHARDED_ATTR, None) is not None
        checks = _C.check_replicas()
        if on_meta:  # (loading.py) the debug checks compare values, a collective; meta tensors have none
            _C.set_check_replicas(False)
        try:
            try:
                if self._peft_model is not None:
                    plan, ep_plan = self._adapter_plans(model, plan, ep_plan)
                parallelize(model, self.mesh, plan, ep_plan=ep_plan, cp_algorithm=hp.cp_algorithm)
            except ValueError as error:
                hp._fail(str(error))
            if hp.fully_shard:
                from hypershard.fsdp.fully_shard import fully_shard

                blocks = next(
                    (
                        m
                        for n, m in model.named_modules()
                        if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)
                    ),
                    [],
                )
                for block in blocks:  # one group per decoder layer, then the root (as fully_shard_layers)
                    fully_shard(block, self.mesh, reshard_after_forward=hp.reshard_after_forward)
                fully_shard(model, self.mesh, reshard_after_forward=hp.reshard_after_forward)
        finally:
            _C.set_check_replicas(checks)
        # each rank reads its shards of the laid-out meta model (loading.py); None: loaded whole
        self._load_report = loading.materialize(model, self.mesh) if on_meta else None
        self._log_load(self._load_report, model)
        self._recompute(model, training_args)
        param_dtype, reduce_dtype = hp.precision(model, training_args)
        if param_dtype or reduce_dtype:
            from hypershard.fsdp.fully_shard import MixedPrecisionPolicy
            from hypershard.fsdp.mixed_precision import mixed_precision

            if hp.param_dtype == "auto" and _rank_world()[0] == 0:
                print(
                    f"hypershard: llamafactory: the checkpoint is stored in bfloat16: param_dtype 'auto' trains with "
                    f"bfloat16 compute from float32 masters, gradients summed in {reduce_dtype} (hs.mixed_precision)",
                    flush=True,
                )
            # fully_shard's groups (no policy of their own) take this one too
            mixed_precision(model, MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))

    def _log_load(self, report, model) -> None:
        """One line per rank once the model is distributed: the parameter bytes it read into its
        shards against the whole model's (the level1 test reads it: about 1/world under
        fully_shard), the file bytes it read, its resident memory now and at its peak so far
        (/proc/self/status VmRSS / VmHWM), and the seconds since LlamaFactory's load_model began."""
        from . import loading

        total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        rank, world = _rank_world()
        memory = loading.rss_text()
        if report is None:
            what = f"holds the model loaded whole by LlamaFactory ({total} parameter bytes)"
        else:
            what = (
                f"loaded its shards: {report.local_bytes} of the model's {total} parameter bytes "
                f"({len(report.loaded)} tensors, {report.bytes_read} file bytes read)"
            )
        timed = loading.load_seconds_text()
        print(f"hypershard: llamafactory: rank {rank} of {world} {what}; {memory}{timed}", flush=True)

    def _recompute(self, model, training_args) -> None:
        """LlamaFactory turns transformers' gradient checkpointing on by default (its own checkpoint
        function, reentrant, around each decoder layer with trainable parameters). JSON ``recompute``
        "auto" keeps it; "full" / "selective" replace it by hs.recompute on every decoder layer
        (non-reentrant, fully_shard gathering twice per step as without it, RNG replayed); "none" turns
        it off."""
        from hypershard.parallel.recompute import recompute

        hf_on = bool(getattr(model, "is_gradient_checkpointing", False))
        rank0 = _rank_world()[0] == 0
        if self.hp_args.recompute == "auto":
            if rank0:
                what = "LlamaFactory's (transformers' gradient checkpointing)" if hf_on else "none"
                print(f"hypershard: llamafactory: recomputation: {what}", flush=True)
            return
        mode = self.hp_args.recompute_mode(hf_on)
        if hf_on:
            model.gradient_checkpointing_disable()
        if training_args is not None and getattr(training_args, "gradient_checkpointing", False):
            training_args.gradient_checkpointing = False  # HF's train() would turn its own on again
        if mode is not None:
            recompute(model, mode=mode)
        if rank0:
            was = "transformers' gradient checkpointing (LlamaFactory's) replaced by " if hf_on else ""
            print(f"hypershard: llamafactory: recomputation: {was}hs.recompute(mode={mode or 'none'!r})", flush=True)

    def _adapter_plans(self, model, plan, ep_plan) -> tuple:
        """The tp and ep plans with the LoRA adapters laid out after their base layers (adapters.py)."""
        from hypershard.parallel import ep_plan_of, tp_plan_of
        from hypershard.parallel.attention import _lay_out_attention

        from .adapters import adapter_plan

        names = self.mesh.mesh_dim_names
        if "tp" in names:
            plan = tp_plan_of(model) if plan is None else plan
            plan = adapter_plan(
                model, _lay_out_attention(plan, model, self.mesh.shape[names.index("tp")]), self.hp_args._fail
            )
        if "ep" in names:
            ep_plan = adapter_plan(model, ep_plan_of(model) if ep_plan is None else ep_plan, self.hp_args._fail)
        return plan, ep_plan

    def _get_dataloader(
        self, dataset, description, batch_size, sampler_fn=None, is_training=False, dataloader_key=None
    ):
        # Evaluation / prediction read per_device_eval_batch_size x dp sequences per batch on every
        # rank, as training does (its batch size is already _train_batch_size).
        if not is_training:
            batch_size = batch_size * self.dp_size
        return super()._get_dataloader(
            dataset,
            description,
            batch_size,
            sampler_fn=sampler_fn,
            is_training=is_training,
            dataloader_key=dataloader_key,
        )

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.__class__ = _HypershardAccelerator

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return model  # no DataParallel / DDP: hypershard is the data parallelism

    def _prepare_inputs(self, inputs):
        inputs = super()._prepare_inputs(inputs)
        positions = inputs.get("position_ids") if isinstance(inputs, dict) else None
        if isinstance(positions, torch.Tensor) and positions.dim() == 3:
            # Qwen-VL's multimodal rope: LlamaFactory's collator gives (text + 3 mrope axes, batch,
            # seq). The model's input hook splits dim 0 -- here the 4 rope rows, which dp need not
            # divide (dp 3, dp 8) and which do not line up with the dp-split hidden states. The batch
            # dim is per_device_train_batch_size x dp, always divisible, and each rank then holds the
            # positions of its own sequences. The hook leaves DTensors as they are.
            from hypershard.tensor.dtensor import distribute_tensor
            from hypershard.tensor.placement_types import Replicate, Shard

            placements = [Replicate()] * self.mesh.ndim
            placements[0] = Shard(1)  # the mesh's first axis is dp (HyperParallelArguments.mesh_spec)
            inputs["position_ids"] = distribute_tensor(positions, self.mesh, placements)
        return inputs

    # ------------------------------------------------------------------------------- training

    def get_total_train_batch_size(self, args) -> int:
        """Sequences per optimizer step: HF multiplies its batch size by its process count, but
        _train_batch_size already holds dp's share and the other ranks (tp, ep, cp) read the same
        batch. HF's "Total train batch size" log line and its samples-per-second use this."""
        return self._train_batch_size * args.gradient_accumulation_steps

    def training_step(self, model, inputs, num_items_in_batch=None):
        with _strict() if self.hp_args.strict else contextlib.nullcontext():
            loss = super().training_step(model, inputs, num_items_in_batch)
        return _plain(loss).detach()

    # ---------------------------------------------------------------------------- checkpoints

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """HF's train, resuming from COMPLETE checkpoints only (resume.py): True takes the newest
        complete checkpoint-N of output_dir (the partial ones skipped are logged); a path to a
        partial checkpoint is refused with the reason, on every rank before any collective."""
        from . import resume

        resume_from_checkpoint = resume.resolve(resume_from_checkpoint, self.args.output_dir)
        from hypershard.launch import faults

        faults.register()  # a failed collective then names the dead rank (hypershard.launch.faults)
        self.add_callback(_NoteStep())
        with faults.reporting():
            output = super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        from . import loading

        rank, world = _rank_world()  # the run's peak per rank (VmHWM), beside the load line's
        print(f"hypershard: llamafactory: rank {rank} of {world} trained; {loading.rss_text()}", flush=True)
        return output

    def _save_checkpoint(self, model, trial) -> None:
        """HF's checkpoint-N, then -- once every rank reported its part written -- the COMPLETE
        marker (resume.py). A failure on any rank raises on every rank, naming it, with no marker."""
        from hypershard import checkpoint

        from . import resume

        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        error = None
        try:
            with _disk_full_if_injected(self.state.global_step):
                super()._save_checkpoint(model, trial)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 -- (DCP's CheckpointException too) every rank raises it below, named
            error = e
        checkpoint.api._agree(f"saving {folder} (no {resume.MARKER} marker was written)", error)
        if self.args.should_save:
            try:
                resume.write_marker(folder, self.state.global_step, _rank_world()[1])
            except OSError as e:
                error = e
        checkpoint.api._agree(f"saving {folder}: its {resume.MARKER} marker", error)

    def _inner_optimizer(self):
        opt = self.optimizer
        return getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps torch's

    def _state_module(self, model=None):
        """What the DCP shards hold: the whole model, or for LoRA its trainable parameters only (the
        frozen base is the pretrained folder's; adapters.TrainableView)."""
        from .adapters import TrainableView

        model = model if model is not None else self.model
        return TrainableView(model) if self._peft_model is not None else model

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Inside a checkpoint (``_internal_call``): the model's shards only with save_only_model
        (otherwise they are written with the optimizer's, below). Called by the user / the workflow:
        a HuggingFace folder from the shards (collective), plus the tokenizer and training args.
        LoRA: peft's adapter folder (adapter_config.json + adapter_model.safetensors) in both."""
        from hypershard import checkpoint

        from .adapters import save_adapter

        output_dir = output_dir or self.args.output_dir
        if _internal_call:
            if self.args.should_save:  # what a checkpoint-N folder holds besides the weights
                os.makedirs(output_dir, exist_ok=True)
                self.model.config.save_pretrained(output_dir)
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
            if self._peft_model is not None:
                save_adapter(self._peft_model, output_dir, self.args.should_save)
            if self.args.save_only_model:
                checkpoint.save(
                    os.path.join(output_dir, SHARDS_DIR), self._state_module(), None, step=self.state.global_step
                )
            return
        if self._peft_model is not None:
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
            save_adapter(self._peft_model, output_dir, self.args.should_save)
        else:
            checkpoint.export_hf(self.model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        dist.barrier() if dist.is_initialized() else None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from hypershard import checkpoint

        checkpoint.save(
            os.path.join(output_dir, SHARDS_DIR),
            self._state_module(),
            self._inner_optimizer(),
            step=self.state.global_step,
        )
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _shards(self, checkpoint_dir: str) -> str:
        path = os.path.join(checkpoint_dir, SHARDS_DIR)
        if not os.path.isdir(path):
            self.hp_args._fail(
                f"resume_from_checkpoint {checkpoint_dir!r} holds no hypershard shards ({SHARDS_DIR}/); "
                f"allowed: a checkpoint-N folder written by a use_hyper_parallel run"
            )
        return path

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        from hypershard import checkpoint

        checkpoint.load(self._shards(resume_from_checkpoint), self._state_module(model))

    def _load_optimizer_and_scheduler(self, checkpoint_dir: Optional[str]) -> None:
        from hypershard import checkpoint

        if checkpoint_dir is None:
            return
        shards = self._shards(checkpoint_dir)
        if not self.args.save_only_model:
            checkpoint.load(shards, self._state_module(), self._inner_optimizer())
        scheduler = os.path.join(checkpoint_dir, SCHEDULER_NAME)
        if os.path.isfile(scheduler) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        from hypershard import checkpoint

        best = self.state.best_model_checkpoint
        if best:
            checkpoint.load(self._shards(best), self._state_module())


def _pad_for_context_parallelism(collator, cp_size: int) -> None:
    """A sequence sharded over cp is stored as 2 x cp equal chunks (docs/context_parallel.md): the
    collator pads every batch (on the right, labels IGNORE_INDEX) to a multiple of that too."""
    import math

    if collator is None or not hasattr(collator, "pad_to_multiple_of"):
        return
    multiple = collator.pad_to_multiple_of or 1
    collator.pad_to_multiple_of = multiple * (2 * cp_size) // math.gcd(multiple, 2 * cp_size)


@contextlib.contextmanager
def _disk_full_if_injected(step: int):
    """Fault injection (FAIL_SAVE_ENV): on rank CRASH_RANK_ENV, the checkpoint's shard writes of that
    step raise ENOSPC, as a full disk would; the other ranks' writes succeed."""
    rank, world = _rank_world()
    at = os.environ.get(FAIL_SAVE_ENV)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if not at or int(at) != step or not first_attempt or rank != int(os.environ.get(CRASH_RANK_ENV, min(1, world - 1))):
        yield
        return
    import errno

    import torch.distributed.checkpoint.filesystem as fs

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    real, fs._write_item = fs._write_item, disk_full
    try:
        yield
    finally:
        fs._write_item = real


def _strict():
    import hypershard as hs

    return hs.strict()
