"""The SFT training loop that every rank runs: tokenizer, data, model (a local HF directory read
shard by shard with hs.from_pretrained, or a tiny config built whole and parallelize()d on the mesh),
AdamW + clip_grad_norm_ + warmup/cosine LambdaLR, gradient accumulation over micro-batches, checkpoints
(hypershard.checkpoint), losses.json and loss_curve.png."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from .data import (
    check_batch_sizes,
    collate,
    encode_all,
    fail,
    global_batch,
    load_records,
    lr_factor,
    micro_batches,
    to_messages,
    trained_tokens,
    warmup_steps,
)

CRASH_ENV = "HYPERSHARD_SFT_CRASH_AT_STEP"  # fault injection: a rank exits in the middle of this step
CRASH_RANK_ENV = "HYPERSHARD_SFT_CRASH_RANK"  # which rank (default 1, or 0 on one rank)
CRASH_IN_ENV = "HYPERSHARD_SFT_CRASH_IN"  # "step" (default: between a forward and its backward) or "save"
# (mid-write of that step's checkpoint: after the rank's first item is written)
CRASH_SIGNAL_ENV = "HYPERSHARD_SFT_CRASH_SIGNAL"  # "exit" (default: os._exit(1)) or "kill" (SIGKILL)
# Under torchrun the fault is injected in the first attempt only (TORCHELASTIC_RESTART_COUNT 0): the
# restarted job runs clean (docs/faults.md).
# Arguments a resumed run must share with the checkpoint: they fix the data order, the schedule and
# the model. The mesh and --micro-batch-size may change (the same gradient up to rounding).
RESUME_MUST_MATCH = (
    "model",
    "tokenizer",
    "data",
    "format",
    "cutoff_len",
    "batch_size",
    "epochs",
    "max_steps",
    "lr",
    "warmup_steps",
    "warmup_ratio",
    "min_lr_ratio",
    "weight_decay",
    "clip",
    "seed",
)


def tiny_types() -> list:
    from hypershard.testing.models import _MODEL_CLASSES, TINY_CONFIGS

    return sorted(t for t in TINY_CONFIGS if t not in _MODEL_CLASSES)


def load_tokenizer(path):
    """A transformers tokenizer from a local directory (never the hub)."""
    from transformers import AutoTokenizer

    if path is None or not Path(path).is_dir():
        fail(
            f"tokenizer {str(path)!r} is not a directory",
            "--tokenizer DIR (a saved tokenizer), or a --model DIR that holds one",
        )
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        fail(f"tokenizer {str(path)!r} has neither a pad nor an eos token", "a tokenizer with one of them")
    return tokenizer


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def build_model(model: str, vocab: int, seed: int, cutoff_len: int):
    """--model DIR: from_pretrained (float32, local files only); a tiny type: tiny_config with the
    tokenizer's vocabulary rounded up to a multiple of 8 (tp sizes up to 8 divide it)."""
    from hypershard.testing.models import TINY_CONFIGS, tiny_config, tiny_model

    if Path(model).is_dir():
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        net = AutoModelForCausalLM.from_pretrained(
            model, local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
        )
        size = net.get_input_embeddings().weight.shape[0]
        if size < vocab:
            fail(
                f"model {model!r} has {size} embeddings, fewer than the tokenizer's {vocab} tokens",
                "a tokenizer whose vocabulary the model covers",
            )
        return net.float().train()
    if model not in tiny_types():
        fail(f"--model {model!r} is neither a directory nor a tiny model type", f"a directory, or {tiny_types()}")
    overrides = {"vocab_size": 8 * math.ceil(vocab / 8)}
    if "max_position_embeddings" in TINY_CONFIGS[model]:
        overrides["max_position_embeddings"] = max(TINY_CONFIGS[model]["max_position_embeddings"], cutoff_len)
    return tiny_model(tiny_config(model, **overrides), seed=seed)


def prepare_data(args) -> tuple:
    """(tokenizer, [(input_ids, labels), ...]) from the arguments; the same on every rank."""
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    examples = encode_all(to_messages(load_records(args.data), args.format), tokenizer, args.cutoff_len)
    return tokenizer, examples


def schedule(args, n_examples: int) -> tuple:
    """(steps per epoch, total steps, warmup steps)."""
    per_epoch = n_examples // args.batch_size
    total = args.max_steps if args.max_steps else args.epochs * per_epoch
    if total < 1:
        fail(f"{total} training steps (--epochs {args.epochs}, --max-steps {args.max_steps})", "at least one step")
    return per_epoch, total, warmup_steps(total, args.warmup_steps, args.warmup_ratio)


def axis_size(mesh_spec, name: str) -> int:
    shape, names = mesh_spec
    return shape[names.index(name)] if name in names else 1


def dp_size(mesh_spec) -> int:
    return axis_size(mesh_spec, "dp")


def checkpoint_dir(args) -> Path:
    return Path(args.output) / "checkpoints"


def _must_match(args) -> dict:
    return {k: getattr(args, k) for k in RESUME_MUST_MATCH}


def _resume(args, model, optimizer, scheduler) -> tuple:
    """Loads the newest complete checkpoint; returns (step, records so far, checkpoint path)."""
    from hypershard import checkpoint

    path, skipped = checkpoint.resume_point(checkpoint_dir(args))
    if path is None:
        partial = "".join(f"; skipped {p.name}: {why}" for p, why in skipped)
        fail(
            f"--resume: no complete checkpoint in {str(checkpoint_dir(args))!r}{partial}",
            "an --output folder of an earlier run with checkpoints",
        )
    if skipped and torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
        print(checkpoint.skipped_message(path, skipped), file=sys.stderr, flush=True)  # never deleted
    saved = checkpoint.read_extra(path)["args"]  # checked before loading: a clear error, not a shape clash
    for key, value in _must_match(args).items():
        if saved.get(key) != value:
            fail(
                f"--resume: checkpoint {str(path)!r} was written with {key}={saved.get(key)!r}, this run has {value!r}",
                "the checkpoint's value",
            )
    extra = checkpoint.load(path, model, optimizer)
    scheduler.load_state_dict(extra["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # the schedule's lr, whatever the optimizer's saved param groups held
    return extra["step"], list(extra["losses"]), path


def _has_checkpoint(args) -> bool:
    """--auto-resume: whether there is a complete checkpoint to continue from (every rank reads the
    same folder before any rank saves, so all decide alike)."""
    from hypershard import checkpoint

    path, skipped = checkpoint.resume_point(checkpoint_dir(args))
    if path is None and skipped and torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
        print(checkpoint.skipped_message(None, skipped, "starting"), file=sys.stderr, flush=True)
    return path is not None


def _save(args, model, optimizer, scheduler, step: int, per_epoch: int, micro_per_step: int, records: list):
    from hypershard import checkpoint

    epoch, index = divmod(step, per_epoch)  # the position of the NEXT step
    extra = {
        "step": step,
        "epoch": epoch,
        "batch_in_epoch": index,
        "micro_batches_consumed": step * micro_per_step,
        "scheduler": scheduler.state_dict(),
        "losses": records,
        "args": _must_match(args),
        "mesh": list(map(list, args.mesh)),
        "micro_batch_size": args.micro_batch_size,
    }
    return checkpoint.save(checkpoint_dir(args), model, optimizer, step=step, extra=extra)


def _crash_step(world: int, rank: int, where: str = "step") -> Optional[int]:
    step = os.environ.get(CRASH_ENV)
    target = int(os.environ.get(CRASH_RANK_ENV, min(1, world - 1)))
    if os.environ.get(CRASH_IN_ENV, "step") != where or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    return int(step) if step and rank == target else None


def _die() -> None:
    """Fault injection: this rank ends at once, as a crash or the OOM killer would end it."""
    if os.environ.get(CRASH_SIGNAL_ENV, "exit") == "kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _die_mid_save() -> None:
    """Fault injection: the rank dies in its checkpoint write, after its first item is written."""
    import torch.distributed.checkpoint.filesystem as fs

    write_item = fs._write_item

    def write_then_die(*args, **kwargs):
        result = write_item(*args, **kwargs)
        _die()
        return result

    fs._write_item = write_then_die


def accumulate(model, batches: list, n_items: int, crash: bool = False) -> float:
    """Forward and backward of every micro-batch of one global batch (gradients accumulate in .grad);
    returns the step loss, the sum of the micro-batch losses. Each micro-batch's loss is its summed
    token losses over `n_items`, the trained tokens of the WHOLE global batch (HF's num_items_in_batch),
    so the accumulated gradient is the one of a single large batch."""
    loss_sum = 0.0
    for batch in batches:
        loss = model(**batch, num_items_in_batch=max(n_items, 1)).loss
        if crash:
            _die()  # fault injection: die between a forward and its backward
        loss.backward()
        loss_sum += float(loss.detach().item())
    return loss_sum


def _fully_shard(model, mesh) -> None:
    """hs.fully_shard on every decoder layer and the root (docs/fully_shard.md): parameters,
    gradients and AdamW states 1/dp per rank; the checkpoints save and reshard the shards."""
    from hypershard.checkpoint.pretrained import fully_shard_layers

    fully_shard_layers(model, mesh)


def check_pipeline(args) -> None:
    """With a pp axis in --mesh: the options the pipeline does not take yet, and the schedule's
    microbatch rules (hypershard.pipelining), refused before any rank starts."""
    names = list(args.mesh[1])
    if "pp" not in names:
        return
    unsupported = [
        flag
        for flag, on in (
            ("--fully-shard without a dp axis", getattr(args, "fully_shard", False) and "dp" not in names),
            # the export gathers one whole model: the stages' ranks would each hold only their part
            ("--export-hf", args.export_hf),
            ("--fully-shard with a cp axis", getattr(args, "fully_shard", False) and "cp" in names),
        )
        if on
    ]
    if unsupported:
        fail(
            f"a pp axis with {', '.join(unsupported)}",
            "pp with dp, tp, ep, cp and --fully-shard (without cp), checkpoints and --resume (a pipeline's "
            "checkpoint resumes on any mesh); --export-hf after resuming the checkpoint without pp",
        )
    from hypershard.pipelining import PipelineError, check_schedule

    pp = axis_size(args.mesh, "pp")
    if args.microbatches is None:
        args.microbatches = args.batch_size // args.micro_batch_size
    try:
        check_schedule(args.pp_schedule, pp, 2 if args.pp_schedule == "interleaved_1f1b" else 1, args.microbatches)
    except PipelineError as e:
        fail(str(e).split(": ", 2)[2].split("; allowed: ")[0], str(e).split("; allowed: ")[1])
    if args.batch_size % args.microbatches or (args.batch_size // args.microbatches) % dp_size(args.mesh):
        fail(
            f"--microbatches {args.microbatches} of a --batch-size {args.batch_size} split over dp={dp_size(args.mesh)}",
            "microbatches dividing the batch into a multiple of dp samples each",
        )


def _pipeline_model(args, mesh, vocab: int):
    """The model split into pipeline stages over the pp axis (hs.pipeline), each stage parallelized on
    the rest of the mesh; with --fully-shard its layers and root fully sharded over dp, then
    --recompute and --mixed-precision applied to each stage (docs/pipelining.md). A --model folder
    is read by hs.from_pretrained with the pp axis, each rank only its stages' shards."""
    import hypershard as hs

    options = dict(
        n_microbatches=args.microbatches,
        schedule=args.pp_schedule,
        fully_shard=getattr(args, "fully_shard", False),
        recompute=None if getattr(args, "recompute", "none") == "none" else args.recompute,
        mixed_precision=precision_of(args) == "bf16",
    )
    if Path(args.model).is_dir():
        size = json.loads((Path(args.model) / "config.json").read_text()).get("vocab_size", vocab)
        if size < vocab:
            fail(
                f"model {args.model!r} has {size} embeddings, fewer than the tokenizer's {vocab} tokens",
                "a tokenizer whose vocabulary the model covers",
            )
        return hs.from_pretrained(args.model, mesh, dtype=torch.float32, **options).train()
    # a tiny type, built from a seed whole on every rank before the split
    return hs.pipeline(build_model(args.model, vocab, args.seed, args.cutoff_len), mesh, **options)


def distributed_model(args, mesh, vocab: int):
    """The model on `mesh`: --model DIR is read by hs.from_pretrained straight into each rank's
    shards (docs/loading.md; float32, the TP/EP plans, --fully-shard applied on the meta model, tensors
    the folder lacks initialised as one device would from --seed); a tiny type is built whole,
    then parallelized (and fully sharded)."""
    from hypershard.parallel import parallelize

    fully = getattr(args, "fully_shard", False)
    if fully and "dp" not in mesh.mesh_dim_names:
        fail("--fully-shard needs a dp axis in --mesh", "a mesh such as dp=2,tp=2")
    if Path(args.model).is_dir():
        from hypershard.checkpoint.pretrained import from_pretrained

        model = from_pretrained(args.model, mesh, fully_shard=fully, dtype=torch.float32, seed=args.seed)
        size = model.get_input_embeddings().weight.shape[0]
        if size < vocab:
            fail(
                f"model {args.model!r} has {size} embeddings, fewer than the tokenizer's {vocab} tokens",
                "a tokenizer whose vocabulary the model covers",
            )
        return _with_precision(model.train(), args)
    model = parallelize(build_model(args.model, vocab, args.seed, args.cutoff_len), mesh)
    if fully:
        _fully_shard(model, mesh)
    return _with_precision(model, args)


def checkpoint_dtype(model: str) -> Optional[str]:
    """The dtype a HuggingFace folder's config.json declares ("bfloat16", ...), None without one."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    for where in (config, config.get("text_config") or {}):
        value = where.get("dtype") or where.get("torch_dtype")
        if value:
            return str(value).replace("torch.", "")
    return None


def precision_of(args) -> str:
    """--mixed-precision: bf16 or none; auto is bf16 for a checkpoint saved in bf16 (it was trained and
    will be served in bf16: the standard recipe, fp32 masters, docs/mixed_precision.md), else none."""
    choice = getattr(args, "mixed_precision", "none")
    if choice == "auto":
        return "bf16" if checkpoint_dtype(args.model) == "bfloat16" else "none"
    return choice


def _with_precision(model, args):
    import hypershard as hs

    if getattr(args, "recompute", "none") != "none":  # before mixed precision: the casts are recomputed too
        hs.recompute(model, mode=args.recompute)
    return hs.mixed_precision(model) if precision_of(args) == "bf16" else model


def run_rank(rank: int, world: int, args) -> dict:
    """One rank's training (_run_rank); a failed collective is re-raised naming this rank, the step,
    the operation and the dead peers (hypershard.launch.faults)."""
    from hypershard.launch import faults

    faults.register()
    with faults.reporting():
        return _run_rank(rank, world, args)


def _run_rank(rank: int, world: int, args) -> dict:
    """One rank's training; rank 0 writes the outputs. Returns the step records and the time."""
    import hypershard as hs
    from hypershard.launch import faults

    torch.manual_seed(args.seed)
    mesh = hs.init_device_mesh("cpu", *args.mesh)
    tokenizer, examples = prepare_data(args)
    check_batch_sizes(args.batch_size, args.micro_batch_size, dp_size(args.mesh), len(examples))
    per_epoch, total, warmup = schedule(args, len(examples))
    pipe = None
    if "pp" in args.mesh[1]:
        check_pipeline(args)
        model = pipe = _pipeline_model(args, mesh, len(tokenizer))
    else:
        model = distributed_model(args, mesh, len(tokenizer))
    if getattr(args, "offload_optimizer", False):
        optimizer = hs.offload_optimizer(
            model.parameters(), torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, warmup, args.min_lr_ratio))
    start, records, resumed_from = 0, [], None
    if args.resume or (getattr(args, "auto_resume", False) and _has_checkpoint(args)):
        start, records, resumed_from = _resume(args, model, optimizer, scheduler)
    stop = min(total, args.stop_after) if args.stop_after else total
    micro_per_step = args.batch_size // args.micro_batch_size
    crash_at = _crash_step(world, rank)
    crash_in_save = _crash_step(world, rank, "save")
    pad = pad_id(tokenizer)
    # A sharded sequence is stored head-tail in 2 x cp chunks (docs/context_parallel.md), where
    # parallelize replaces a right-padding attention_mask by all ones. The batches are padded on
    # the right with labels -100 and the models are causal: no real token attends to (or, through
    # a causal conv or recurrence, reads) a later pad token, so without the mask every trained
    # token's loss is the same. (A MoE's auxiliary balance loss would count the pad tokens: the
    # SFT trains without it.)
    context_parallel = "cp" in args.mesh[1]  # parallelize treats a cp axis of any size as one
    # (with pp too: each batch padded to its own longest; the pipeline builds torch's stages per
    # batch shape, hypershard.pipelining.shapes)
    multiple = 2 * axis_size(args.mesh, "cp") if context_parallel else 1

    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc=f"sft {args.model_name} on {world} ranks", unit="step")
    began = time.perf_counter()
    with hs.strict() if args.strict else contextlib.nullcontext():
        for step in range(start, stop):
            faults.note(f"in step {step + 1} of {total}")
            tic = time.perf_counter()
            epoch, _, indices = global_batch(len(examples), args.batch_size, args.seed, step)
            batches = [
                collate([examples[i] for i in mb], pad, multiple)
                for mb in ([indices] if pipe is not None else micro_batches(indices, args.micro_batch_size))
            ]
            tokens = sum(int(b["attention_mask"].sum()) for b in batches)
            if context_parallel or pipe is not None:  # right padding with labels -100: see above
                for batch in batches:
                    del batch["attention_mask"]
            n_items = sum(trained_tokens(b["labels"]) for b in batches)
            lr = scheduler.get_last_lr()[0]
            optimizer.zero_grad(set_to_none=True)
            if pipe is not None:  # the schedule splits the global batch into --microbatches
                loss_sum = pipe.step(batches[0]["input_ids"], batches[0]["labels"])
            else:
                loss_sum = accumulate(model, batches, n_items, crash=crash_at == step + 1)
            grad_norm = None
            if args.clip > 0 and pipe is not None:
                grad_norm = pipe.clip_grad_norm_(args.clip)
            elif args.clip > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).item())
            optimizer.step()
            scheduler.step()
            seconds = time.perf_counter() - tic
            records.append(
                {
                    "step": step + 1,
                    "epoch": epoch,
                    "loss": loss_sum,
                    "lr": lr,
                    "tokens": tokens,
                    "trained_tokens": n_items,
                    "grad_norm": grad_norm,
                    "seconds": seconds,
                }
            )
            done = step + 1
            # Checkpoints every --save-steps steps and at the end (0: none); --stop-after always leaves one.
            if (args.save_steps and done % args.save_steps == 0) or (
                done == stop and (args.save_steps or args.stop_after)
            ):
                faults.note(f"saving the checkpoint of step {done}")
                if crash_in_save == done:
                    _die_mid_save()
                _save(args, model, optimizer, scheduler, done, per_epoch, micro_per_step, records)
            if bar is not None:
                bar.set_postfix(loss=f"{loss_sum:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens / seconds:.0f}")
                bar.update(1)
    elapsed = time.perf_counter() - began
    if bar is not None:
        bar.close()
    finished = records[-1]["step"] == total if records else False
    if args.export_hf and finished:
        from hypershard import checkpoint

        checkpoint.export_hf(model, Path(args.output) / "hf")
        if rank == 0:
            tokenizer.save_pretrained(Path(args.output) / "hf")
    if rank == 0:
        write_outputs(Path(args.output), records, args, total, resumed_from)
    return {
        "records": records,
        "seconds": elapsed,
        "total": total,
        "finished": finished,
        "resumed_from": None if resumed_from is None else str(resumed_from),
    }


def write_outputs(out: Path, records: list, args, total: int, resumed_from) -> None:
    """losses.json (every step's loss, lr, tokens) and loss_curve.png."""
    out.mkdir(parents=True, exist_ok=True)
    mesh_text = ",".join(f"{n}={s}" for s, n in zip(*args.mesh))
    summary = {
        "model": args.model,
        "mesh": mesh_text,
        "batch_size": args.batch_size,
        "micro_batch_size": args.micro_batch_size,
        "total_steps": total,
        "resumed_from": None if resumed_from is None else str(resumed_from),
        "steps": records,
    }
    (out / "losses.json").write_text(json.dumps(summary, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], "o-", linewidth=1.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"SFT {args.model_name} ({mesh_text})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png")
    plt.close(fig)
