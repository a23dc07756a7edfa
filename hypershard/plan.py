"""The planner: one real training step of a true-size model, as one rank of a simulated mesh.

    python -m hypershard.plan --model deepseek_v32 --mesh dp=32,ep=8 --fully-shard --seq 4096 --batch 32
    python -m hypershard.plan --model qwen3_5_moe_text --mesh dp=8,tp=2,ep=4 --memory-per-rank 80

`--model`: a transformers model_type (its default config: deepseek_v32 is DeepSeek-V3.2 671B,
qwen3_5_moe_text Qwen3.5-35B-A3B), a published config by name (qwen3_5_0_8b, qwen3_vl_30b_a3b), or
a save_pretrained folder. The model is built on the meta device, parallelized with its own HF plans
(tp / ep axes; the batch split over dp) and optionally fully sharded over dp, and one forward,
backward, clip_grad_norm_ and AdamW step runs through hypershard's dispatcher, rules and
redistribution on a simulated mesh (hypershard/planner/world.py): nothing is computed, allocated or
sent. Printed for the simulated rank (--rank, default 0): bytes of parameters, gradients and
optimizer state; the peak of activations (everything else the step holds, hypershard/planner/
memory.py); bytes sent per mesh axis (per phase) and the collectives issued. Ranks with the same
coordinates on the axes that shard a tensor hold the same bytes; rank 0 holds the first
(largest) chunk of every uneven shard, so its figures are the largest. See docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .launch import parse_mesh
from .planner.run import PlanReport, plan_step
from .planner.step import PUBLISHED, load_config

__all__ = ["format_report", "main"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def format_report(r: PlanReport, memory_per_rank: float = 0.0) -> str:
    coords = ", ".join(f"{a}={c}" for a, c in r.coordinates.items())
    mesh = ",".join(f"{a}={n}" for a, n in r.mesh.items())
    lines = [
        f"{r.model}: {r.total_parameters / 1e9:.2f} B parameters on mesh {mesh}; rank {r.rank} ({coords})",
        f"  {'parameters':<22}{_size(r.parameters):>12}",
        f"  {'gradients':<22}{_size(r.gradients):>12}",
        f"  {'optimizer state':<22}{_size(r.optimizer):>12}",
        f"  {'activations (peak)':<22}{_size(r.activations):>12}",
        f"  {'peak of the step':<22}{_size(r.peak):>12}",
    ]
    lines.append("  bytes sent per step, by mesh axis:")
    for axis, b in sorted(r.axis_bytes.items()):
        phases = ", ".join(
            f"{p} {_size(n)}" for key, n in r.phase_bytes.items() for p, a in [key.split(" ", 1)] if a == axis and n
        )
        lines.append(f"    {axis:<8}{_size(b):>12}   ({phases})")
    lines.append("  collectives issued (count, bytes sent):")
    for key, n in r.collectives.items():
        lines.append(f"    {key:<26}{n:>6}  {_size(r.collective_bytes.get(key, 0)):>12}")
    if r.issuers:
        lines.append("  where the bytes come from (the line whose op issued them):")
        for axis, kind, where, n in r.issuers[:12]:
            lines.append(f"    {axis:<5}{kind:<15}{_size(n):>12}  {where}")
    if r.uncounted:
        lines.append(f"  ({r.uncounted} collectives hypershard did not count: costed by ring formulas)")
    if memory_per_rank:
        over = r.over(memory_per_rank)
        if over:
            shares = ", ".join(f"{c} {_size(getattr(r, c))}" for c in over)
            lines.append(
                f"  DOES NOT FIT {_size(memory_per_rank)} per rank: peak {_size(r.peak)} is "
                f"{_size(r.peak - memory_per_rank)} over; largest first: {shares}; over on its own: "
                + (", ".join(c for c in over if getattr(r, c) > memory_per_rank) or "none")
            )
        else:
            lines.append(f"  fits {_size(memory_per_rank)} per rank ({_size(memory_per_rank - r.peak)} to spare)")
    lines.append("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in r.seconds.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hypershard.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", required=True, help=f"a model_type, a save_pretrained folder, or one of {sorted(PUBLISHED)}"
    )
    parser.add_argument("--mesh", required=True, help="axis=size,... with axes among dp, tp, ep (e.g. dp=32,ep=8)")
    parser.add_argument("--fully-shard", action="store_true", help="hs.fully_shard every decoder layer over dp")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--batch", type=int, default=0, help="sequences per step in all (default: the dp size)")
    parser.add_argument("--rank", type=int, default=0, help="the rank simulated (default 0)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="of the parameters")
    parser.add_argument(
        "--compute-dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="with --fully-shard: the gathered parameters' dtype (mixed precision)",
    )
    parser.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the config's)")
    parser.add_argument("--memory-per-rank", type=float, default=0.0, help="GB per rank: say whether the step fits")
    parser.add_argument(
        "--trace", action="store_true", help="attribute each collective's bytes to the source line that issued it"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    shape, names = parse_mesh(args.mesh)
    mesh = dict(zip(names, shape))
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    config = load_config(args.model, **overrides)
    batch = args.batch or mesh.get("dp", 1)
    started = time.perf_counter()
    report = plan_step(
        config,
        mesh,
        name=args.model,
        rank=args.rank,
        fully_shard=args.fully_shard,
        batch=batch,
        seq=args.seq,
        dtype=_DTYPES[args.dtype],
        compute_dtype=_DTYPES[args.compute_dtype] if args.compute_dtype else None,
        trace=args.trace,
    )
    report.seconds["total"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(format_report(report, args.memory_per_rank * 1e9))
    return 1 if args.memory_per_rank and report.over(args.memory_per_rank * 1e9) else 0


if __name__ == "__main__":
    sys.exit(main())
