"""python -m hypershard.sft: supervised fine-tuning of a causal LM on a CPU mesh, LlamaFactory-style.

    python -m hypershard.sft --model DIR_OR_TYPE --mesh dp=2,tp=2 --data FILE.json --output DIR [--resume]
    torchrun --nproc-per-node 4 -m hypershard.sft --model ... --mesh dp=2,tp=2 ...

Without torchrun's RANK/WORLD_SIZE the command spawns one local rank per mesh device itself (gloo).
See docs/sft.md for the data formats, label masking, gradient accumulation and resume.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

from ..launch.ranks import RankTimeout, mesh_argument, mesh_size, spawn_local_ranks
from .data import FORMATS, SFTError, check_batch_sizes, fail
from .train import check_pipeline, checkpoint_dir, dp_size, prepare_data, run_rank, schedule


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hypershard.sft",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--model",
        required=True,
        help="a local HF model directory, or a tiny model type of hypershard.testing.models (random init)",
    )
    p.add_argument(
        "--mesh",
        type=mesh_argument("sft"),
        default=mesh_argument("sft")("dp=2,tp=2"),
        help="mesh axes and sizes (default dp=2,tp=2): dp splits each micro-batch, tp uses the TP plan",
    )
    p.add_argument("--data", required=True, help="a JSON list or JSONL file of alpaca or sharegpt records")
    p.add_argument("--output", required=True, help="output folder: losses.json, loss_curve.png, checkpoints/, hf/")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --output")
    p.add_argument(
        "--auto-resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --output when there is one, else start "
        "(for torchrun --max-restarts: the restarted job resumes by itself; docs/faults.md)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the --model directory)")
    p.add_argument("--format", default="auto", choices=FORMATS, help="data format (default auto: detected)")
    p.add_argument("--cutoff-len", type=int, default=1024, help="tokens kept per example (default 1024)")
    p.add_argument("--batch-size", type=int, default=8, help="global batch: sequences per optimizer step (default 8)")
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="sequences per forward/backward (default: --batch-size); a multiple of dp dividing the batch",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="with a pp axis in --mesh: microbatches per step of the pipeline schedule "
        "(default: --batch-size / --micro-batch-size)",
    )
    p.add_argument(
        "--pp-schedule",
        default="1f1b",
        choices=("gpipe", "1f1b", "interleaved_1f1b"),
        help="with a pp axis: torch.distributed.pipelining's schedule (default 1f1b; interleaved_1f1b "
        "runs 2 stages per rank; docs/pipelining.md)",
    )
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    steps.add_argument("--max-steps", type=int, default=0, help="optimizer steps (overrides --epochs)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak AdamW learning rate (default 1e-4)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps (default 0)")
    p.add_argument("--warmup-ratio", type=float, default=0.0, help="warmup as a fraction of the steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.0, help="cosine floor as a fraction of --lr (default 0)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (default 1.0; 0: none)")
    p.add_argument(
        "--save-steps",
        type=int,
        default=500,
        help="checkpoint every N steps and at the end (default 500; 0: no checkpoints)",
    )
    p.add_argument("--seed", type=int, default=42, help="model init and data order seed (default 42)")
    p.add_argument("--strict", action="store_true", help="run in hypershard.strict() (no fallback)")
    p.add_argument(
        "--fully-shard",
        action="store_true",
        help="hs.fully_shard every decoder layer and the root over dp (parameters, gradients and "
        "optimizer states 1/dp per rank)",
    )
    p.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="hs.offload_optimizer: AdamW's state and step on the host, the gradients copied there and "
        "the updated parameters back each step (docs/fully_shard.md); checkpoints resume with or without it",
    )
    p.add_argument(
        "--mixed-precision",
        default="auto",
        choices=("auto", "bf16", "none"),
        help="bf16: compute in bf16 with fp32 master weights, optimizer state and gradient sums; "
        "auto (default): bf16 when --model is a checkpoint saved in bf16",
    )
    p.add_argument(
        "--recompute",
        default="none",
        choices=("none", "selective", "full"),
        help="activation recomputation of every decoder layer (docs/recompute.md): selective keeps the "
        "matmul and attention outputs and recomputes the rest; full keeps only each layer's input (default none)",
    )
    p.add_argument("--export-hf", action="store_true", help="at the end, export the model to OUTPUT/hf (safetensors)")
    p.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="end after step K, with a checkpoint there (simulates an interrupted run)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds before stuck local ranks are reported and killed, and the collective timeout "
        "(default 3600; $HYPERSHARD_COLLECTIVE_TIMEOUT overrides the collective one)",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    if args.micro_batch_size is None:
        args.micro_batch_size = args.batch_size
    if args.max_steps:
        args.epochs = 0  # one definition of the run's length (the resume check compares both)
    if args.cutoff_len < 2:
        fail(f"--cutoff-len {args.cutoff_len}", "at least 2 tokens")
    if Path(args.model).is_dir():
        args.model = str(Path(args.model).resolve())
    if args.tokenizer is not None:
        args.tokenizer = str(Path(args.tokenizer).resolve())
    args.data = str(Path(args.data).resolve())
    args.model_name = Path(args.model).name
    return args


def preflight(args) -> None:
    """The checks that need no process group, before any rank starts: the data, the tokenizer, the
    batch sizes, the schedule and the output folder."""
    _, examples = prepare_data(args)
    check_batch_sizes(args.batch_size, args.micro_batch_size, dp_size(args.mesh), len(examples))
    schedule(args, len(examples))
    check_pipeline(args)
    ckpts = checkpoint_dir(args)
    if not args.resume and not args.auto_resume and ckpts.is_dir() and any(ckpts.iterdir()):
        fail(f"--output {args.output!r} already holds checkpoints", "--resume, --auto-resume, or a new output folder")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _torchrun(args, world: int) -> dict:
    import torch
    import torch.distributed as dist

    if int(os.environ["WORLD_SIZE"]) != world:
        fail(
            f"torchrun started {os.environ['WORLD_SIZE']} ranks for a mesh of {world} devices",
            f"--nproc-per-node x nodes = {world}",
        )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from ..launch import init_torchrun_process_group
    from ..launch.faults import collective_timeout

    timeout = datetime.timedelta(seconds=collective_timeout(args.timeout))
    init_torchrun_process_group("gloo", timeout)  # keys of its own per torchrun attempt
    try:
        result = run_rank(dist.get_rank(), world, args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return result


def _report(result: dict, world: int) -> None:
    records = result["records"]
    if not records:
        print("hypershard sft: no steps to run")
        return
    last = records[-1]
    tokens = sum(r["tokens"] for r in records)
    state = "finished" if result["finished"] else f"stopped after step {last['step']} of {result['total']}"
    print(
        f"hypershard sft: {state}; loss {records[0]['loss']:.4f} -> {last['loss']:.4f}; "
        f"{tokens / max(result['seconds'], 1e-9):.0f} tokens/s over {world} ranks"
    )


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        world = mesh_size(args.mesh[0])
        if _under_torchrun():
            result = _torchrun(args, world)
            if int(os.environ["RANK"]) == 0:
                _report(result, world)
            return 0
        preflight(args)
    except SFTError as e:
        print(e, file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    mesh_text = ",".join(f"{n}={s}" for s, n in zip(*args.mesh))
    print(f"hypershard sft: {args.model_name} on a {world}-rank CPU mesh ({mesh_text}), output {args.output}")
    try:
        # The collective timeout as long as the launch's: a slow step or save of a real model must not
        # trip it; a dead rank is caught by the launcher at once anyway.
        from ..launch.faults import collective_timeout

        pg_timeout = collective_timeout(args.timeout)  # $HYPERSHARD_COLLECTIVE_TIMEOUT overrides it
        result = spawn_local_ranks(run_rank, world, args, timeout=args.timeout, pg_timeout=pg_timeout)[0]
    except mp.ProcessExitedException as e:
        print(
            f"hypershard: sft: rank {e.error_index} of {world} died (exit code {e.exit_code}) and the run "
            f"stopped; allowed: --resume (continues from the newest complete checkpoint)",
            file=sys.stderr,
        )
        return 1
    except mp.ProcessRaisedException as e:
        last = (str(e).strip().splitlines() or [""])[-1]
        if last.startswith(f"{SFTError.__module__}.{SFTError.__name__}: "):
            print(last.split(": ", 1)[1], file=sys.stderr)  # a refused argument: its one line is the story
            return 2
        print(f"hypershard: sft: rank {e.error_index} of {world} failed: {last}\n{e}", file=sys.stderr)
        return 1
    except RankTimeout as e:
        print(e, file=sys.stderr)
        return 1
    _report(result, world)
    print(f"wrote {Path(args.output) / 'losses.json'} and {Path(args.output) / 'loss_curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
