"""make bench: hypershard's benchmark suite. Every figure is a ratio measured side by side in ONE
run (the machine is shared and noisy): the competing implementations run interleaved in the same
processes, each timing is the median of repeated samples, and min/max are kept.

Sections (see benchmarks/README.md for what each measures and how; the code is in hsbench/):

  dispatch    per-op overhead on tiny tensors, per op class: plain eager vs hypershard (and
              hypershard with its fast path off) vs torch.distributed.tensor DTensor; 1-, 2- and
              4-rank meshes, Replicate and Shard
  fallback    a few ops that have distributed rules, forced through hypershard's fallback (inputs
              gathered to Replicate) vs their rule vs plain eager on the local shard: the
              fallback's cost, the bytes it gathers, and the rule path's overhead (<= 1.2x plain)
  rotary      hypershard's fused rotary position embedding vs the same maths composed from
              cat/neg/mul/stack, forward and forward + backward, modes 0/1/3, float32 and bfloat16:
              plain tensors on one device, and DTensors on a 2-rank mesh (x sharded on heads or
              batch, strict mode) with torch DTensor running the composed form alongside
  checkpoint  sharded checkpoints (hypershard.checkpoint, torch DCP) of a Qwen3 + AdamW state on
              dp2 x tp2 vs full_tensor() + torch.save on rank 0: save/load seconds, bytes written
              per rank, rank 0's peak memory over a save, a resharding load into tp4
  fully_shard hs.fully_shard vs hypershard data parallelism vs torch FSDP2 on dp4 (Qwen3, AdamW):
              state bytes per rank vs the ideal 1/dp, step time, bytes per step vs 3 x params x
              (dp-1)/dp, the time spent waiting for all-gathers (overlap)
  step        training step of a tiny HF Qwen3 on 4 CPU ranks (dp2 x tp2, tp4): hypershard
              parallelize() vs torch DTensor tensor parallelism vs one device, each also with the
              other way of summing data-parallel gradients (per parameter / bucketed); a dp2 x tp2
              run at a size where compute dominates (17 M parameters); the bytes each rank sends
              per step and hypershard's rule-cache statistics over 20 steps
  true_size   (only when named: ~13 GB and ~15 min) Qwen3.5-0.8B at its true size, random weights
              written once as a bf16 safetensors checkpoint, loaded by hs.from_pretrained on dp2 x tp2
              (+ fully_shard over dp) and dp4 fully_shard, 2 bf16 mixed-precision AdamW steps: load time,
              bytes read and peak RSS per rank vs one device; Qwen3.5-35B-A3B cut to 2 layers (2.7 B)
              loaded in bf16 on ep4, one forward + backward
  memory      peak RSS growth and parameter + gradient + optimizer-state bytes per rank of a
              larger Qwen3 config: hypershard vs torch DTensor vs one device (measured at the end
              of the step launches)
  grad_overlap
              data-parallel gradient buckets started during backward vs all at the end (dp=4 Qwen3,
              1 MiB buckets): backward time and the exposed gradient-sum time
  context_parallel
              (~2.7 min) a
              small Qwen3 on one long sequence (8192 tokens) sharded over cp=2 and cp=4 ranks, every
              algorithm of
              hypershard.parallel.CP_ALGORITHMS, vs one device (cp=1): peak activation memory per
              rank vs cp=1 (goal ~1/cp), step time, bytes per step vs the formula from the model's
              shape
  compile     (~1 min) the demo's model on dp2 x tp2: hs.compile (inductor, the local program
              and its functional collectives in one graph; also with its waits moved) vs eager
              hypershard, forward + backward time per step and the first call's compile time
  user_rules  a custom op with a rule registered from Python (hs.register_rule) vs aten::mm with
              its native rule, 1 and 2 ranks: hypershard's per-call overhead on each
  pipelining  (only when named: ~8 min quick, ~10 GB) Qwen3.5-0.8B at true width cut to 4 layers on
              4 ranks: pp2 x dp2 (hs.pipeline, 1F1B, 4 microbatches) vs dp4 hs.fully_shard: step
              time, peak RSS per rank, bytes per axis (dp, pp), measured bubble vs (pp-1)/(m+pp-1)
  llamafactory_true_size  (only when named: ~24 GB at its peak, ~14 min on 2 cores) LlamaFactory's
              sft stage on Qwen3.5-0.8B at true width cut to 4 layers, 4 ranks, 2 steps: full fine-
              tuning on fully_shard dp4 and LoRA on dp2 x tp2, loaded shard-wise, and by
              LlamaFactory alone in one process: per-rank bytes, RSS, peaks, load s, step s, losses

Writes bench/results.json, bench/RESULTS.md and bench/results.png and prints the tables.

    .venv/bin/python benchmarks/run.py [--quick] [--sections dispatch,fallback,rotary,checkpoint,fully_shard,step,memory,grad_overlap,context_parallel,compile,user_rules,true_size,pipelining,llamafactory_true_size] [--out bench]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# hypershard (ROOT) and the sections' package hsbench (next to this file); spawned ranks inherit
# sys.path, so they find hsbench too
for path in (ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
from hsbench.chart import plot  # noqa: E402
from hsbench.checkpoint import run_checkpoint  # noqa: E402
from hsbench.common import error_text  # noqa: E402
from hsbench.compiled import run_compiled  # noqa: E402
from hsbench.context_parallel import run_context_parallel  # noqa: E402
from hsbench.dispatch import run_dispatch  # noqa: E402
from hsbench.fallback import run_fallback  # noqa: E402
from hsbench.fully_shard import run_fully_shard  # noqa: E402
from hsbench.grad_overlap import run_grad_overlap  # noqa: E402
from hsbench.llamafactory_true_size import run_llamafactory_true_size  # noqa: E402
from hsbench.memory import MEMORY_CONFIG  # noqa: E402
from hsbench.pipelining import run_pipelining  # noqa: E402
from hsbench.report import markdown, targets  # noqa: E402
from hsbench.rotary import run_rotary  # noqa: E402
from hsbench.training import run_steps  # noqa: E402
from hsbench.true_size import run_true_size  # noqa: E402
from hsbench.user_rules import run_user_rules  # noqa: E402

SECTIONS = (
    "dispatch",
    "fallback",
    "rotary",
    "checkpoint",
    "fully_shard",
    "step",
    "memory",
    "grad_overlap",
    "context_parallel",
    "compile",
    "user_rules",
    "true_size",
    "pipelining",
    "llamafactory_true_size",
)
# true_size holds ~13 GB and runs ~15 min on 2 cores, pipelining ~10 GB and ~8 min (--quick: batch
# 8 x 32; else 8 x 128): a default run (make bench) leaves them out
OPT_IN_SECTIONS = ("true_size", "pipelining", "llamafactory_true_size")
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s not in OPT_IN_SECTIONS)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/run.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: few samples and steps (about two minutes on 2 busy cores); rough numbers",
    )
    parser.add_argument(
        "--sections",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default all but {' and '.join(OPT_IN_SECTIONS)})",
    )
    parser.add_argument("--out", default=str(ROOT / "bench"), help="output folder (default bench/)")
    parser.add_argument(
        "--repeats", type=int, help="timing samples per dispatch, fallback and rotary figure (default 21; quick 3)"
    )
    parser.add_argument(
        "--sample-ms", type=float, help="length of one dispatch, fallback or rotary sample in ms (default 5; quick 3)"
    )
    parser.add_argument("--warmup", type=int, help="untimed training steps (default 3; quick 1)")
    parser.add_argument("--timed", type=int, help="timed training steps per implementation (default 10; quick 3)")
    parser.add_argument(
        "--cache-steps", type=int, help="hypershard steps for the rule-cache figures (default 20; quick 6)"
    )
    parser.add_argument("--memory-steps", type=int, help="training steps in the memory runs (default 2; quick 1)")
    parser.add_argument(
        "--true-size-scale",
        choices=("true", "smoke"),
        default="true",
        help="true_size: the true configs, or small ones of the same model types to check the "
        "code path (--quick implies smoke)",
    )
    parser.add_argument(
        "--true-size-batch",
        type=int,
        default=4,
        help="true_size: sequences per Qwen3.5-0.8B step, split over dp (default 4)",
    )
    parser.add_argument(
        "--true-size-moe-batch",
        type=int,
        default=1,
        help="true_size: sequences in the 35B-A3B forward + backward (default 1)",
    )
    parser.add_argument("--true-size-seq", type=int, default=128, help="true_size: tokens per sequence (default 128)")
    parser.add_argument("--true-size-skip-moe", action="store_true", help="true_size: the 0.8B runs only")
    parser.add_argument(
        "--no-true-size-moe-single",
        dest="true_size_moe_single",
        action="store_false",
        help="true_size: no one-device run of the 35B-A3B cut (it needs ~12 GB)",
    )
    parser.add_argument(
        "--cp-seq",
        type=int,
        help="context_parallel: tokens in the sequence, a multiple of 8 (default 8192; quick 1024)",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a launch is abandoned (default 600)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = dict(
        repeats=(3, 21), sample_ms=(3.0, 5.0), warmup=(1, 3), timed=(3, 10), cache_steps=(6, 20), memory_steps=(1, 2)
    )
    for k, (q, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, q if quick else full)
    args.sample_s = args.sample_ms / 1000
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; allowed: {','.join(SECTIONS)}")

    import torch
    import transformers

    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {msg}", flush=True)

    results: dict = {}
    if "dispatch" in sections:
        results["dispatch"] = run_dispatch(args, log)
    if "fallback" in sections:
        results["fallback"] = run_fallback(args, log)
    if "rotary" in sections:
        results["rotary"] = run_rotary(args, log)
    if "checkpoint" in sections:
        results["checkpoint"] = run_checkpoint(args, log)
    if "fully_shard" in sections:
        results["fully_shard"] = run_fully_shard(args, log)
    if "step" in sections or "memory" in sections:
        step, traffic, cache, memory = run_steps(args, log, with_memory="memory" in sections)
        if "step" in sections:
            results.update(step=step, bytes=traffic, rule_cache=cache)
        if memory:
            results["memory"] = memory
    if "grad_overlap" in sections:
        results["grad_overlap"] = run_grad_overlap(args, log)
    if "context_parallel" in sections:
        results["context_parallel"] = run_context_parallel(args, log)
    if "compile" in sections:
        results["compile"] = run_compiled(args, log)
    if "user_rules" in sections:
        results["user_rules"] = run_user_rules(args, log)
    if "true_size" in sections:
        results["true_size"] = run_true_size(args, log)
    if "pipelining" in sections:
        results["pipelining"] = run_pipelining(args, log)
    if "llamafactory_true_size" in sections:
        results["llamafactory_true_size"] = run_llamafactory_true_size(args, log)
    results["meta"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpus": os.cpu_count(),
        "quick": quick,
        "seconds": time.perf_counter() - started,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average": os.getloadavg(),
        "memory_config": MEMORY_CONFIG,
        "settings": {
            k: getattr(args, k) for k in ("repeats", "sample_ms", "warmup", "timed", "cache_steps", "memory_steps")
        },
    }
    results["targets"] = targets(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    text = markdown(results)
    (out / "RESULTS.md").write_text(text + "\n")
    try:
        plot(results, out / "results.png")
    except Exception as exc:  # noqa: BLE001 (the numbers matter more than the chart)
        print(f"chart not written: {error_text(exc)}")
    print()
    print(text)
    print(
        f"wrote {out / 'results.json'}, {out / 'RESULTS.md'}, {out / 'results.png'} "
        f"in {results['meta']['seconds']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
