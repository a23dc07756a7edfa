"""The planner: one real training step of a true-size model, as one rank of a simulated mesh.

    python -m hypershard.plan --model deepseek_v32 --mesh dp=32,ep=8 --fully-shard --seq 4096 --batch 32
    python -m hypershard.plan --model qwen3_5_moe_text --mesh dp=8,tp=2,ep=4 --memory-per-rank 80
    python -m hypershard.plan --model deepseek_v32 --search --world 256 --memory-per-rank 80 --compute-dtype bfloat16

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
(largest) chunk of every uneven shard, so its figures are the largest. `--device` (default cuda)
picks whose kernels the step takes; `--recompute`, a cp axis with `--cp-algorithm`, HSDP (`--hsdp R`
or a dp_replicate axis) and `--offload-optimizer` are the library's settings; `--search` ranks the
meshes of `--world` ranks.
See docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ..launch.ranks import mesh_argument
from . import PLANNED_AXES
from .pipeline import SCHEDULES
from .run import PlanReport, apply_options, plan_step
from .search import HARDWARE
from .step import PUBLISHED, RECOMPUTE, REPLICATE_AXIS, check_hsdp, data_parallel, hsdp_mesh, load_config
from .world import DEVICES

CP_ALGORITHMS = ("all_gather_kv", "ulysses", "ring")

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
    setting = f"device {r.device}, recompute {r.recompute}" + (f", cp {r.cp_algorithm}" if r.cp_algorithm else "")
    lines = [
        f"{r.model}: {r.total_parameters / 1e9:.2f} B parameters on mesh {mesh}; rank {r.rank} ({coords}); {setting}",
        f"  {'parameters':<22}{_size(r.parameters):>12}",
        f"  {'gradients':<22}{_size(r.gradients):>12}",
        f"  {'optimizer state':<22}{_size(r.optimizer):>12}",
        f"  {'activations (peak)':<22}{_size(r.activations):>12}",
        f"  {'peak of the step':<22}{_size(r.peak):>12}",
    ]
    if r.kernels:
        lines.append("  kernels: " + ", ".join(f"{k} x{n}" for k, n in sorted(r.kernels.items())))
    if r.cp_calls:
        lines.append("  cp attention calls run by: " + ", ".join(f"{k} x{n}" for k, n in sorted(r.cp_calls.items())))
    if r.flops:
        lines.append(
            f"  {'TFLOP (this rank)':<22}{r.flops / 1e12:>12.1f}   ("
            + ", ".join(f"{p} {n / 1e12:.1f}" for p, n in r.phase_flops.items() if n)
            + ")"
        )
    lines.append("  bytes sent per step, by mesh axis:")
    for axis, b in sorted(r.axis_bytes.items()):
        phases = ", ".join(
            f"{p} {_size(n)}" for key, n in r.phase_bytes.items() for p, a in [key.split(" ", 1)] if a == axis and n
        )
        lines.append(f"    {axis:<8}{_size(b):>12}" + (f"   ({phases})" if phases else ""))
    lines.append("  collectives issued (count, bytes sent):")
    for key, n in r.collectives.items():
        lines.append(f"    {key:<26}{n:>6}  {_size(r.collective_bytes.get(key, 0)):>12}")
    if r.issuers:
        lines.append("  where the bytes come from (the line whose op issued them):")
        for axis, kind, where, n in r.issuers[:12]:
            lines.append(f"    {axis:<5}{kind:<15}{_size(n):>12}  {where}")
    if r.uncounted:
        lines.append(f"  ({r.uncounted} collectives hypershard did not count: costed by ring formulas)")
    if r.offload:
        lines.append(
            f"  optimizer state on the host: device peak {_size(r.peak)}, host-device traffic "
            f"{_size(r.offload)} per step (gradients down, parameters up)"
        )
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
    parser.add_argument(
        "--mesh", default=None, help=f"axis=size,... with axes among {', '.join(PLANNED_AXES)} (e.g. dp=32,ep=8)"
    )
    parser.add_argument("--fully-shard", action="store_true", help="hs.fully_shard every decoder layer over dp")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--batch", type=int, default=0, help="sequences per step in all (default: dp x dp_replicate)")
    parser.add_argument(
        "--rank",
        type=int,
        default=None,
        help="the rank simulated (default 0; with pp: a rank of the stage of largest peak)",
    )
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="of the parameters")
    parser.add_argument(
        "--compute-dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="compute dtype from the --dtype master weights (fully_shard's gathers, else hs.mixed_precision)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cuda",
        help="whose kernels the step takes (default cuda: torch's SDPA backend choice on an H100/H200; npu: "
        "torch_npu's npu_fusion_attention, modelled on meta; cpu: a CPU run's)",
    )
    parser.add_argument("--recompute", choices=RECOMPUTE, default="none", help="activation recomputation per layer")
    parser.add_argument("--cp-algorithm", choices=CP_ALGORITHMS, default="all_gather_kv", help="attention on a cp axis")
    parser.add_argument(
        "--hsdp",
        type=int,
        default=0,
        help=f"with --fully-shard: dp=D becomes {REPLICATE_AXIS}=R (across nodes) x dp=D/R (HSDP, hs.fully_shard's "
        "replicate_axis)",
    )
    parser.add_argument(
        "--offload-optimizer", action="store_true", help="AdamW state on the host (the step on CPU), docs"
    )
    parser.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the config's)")
    parser.add_argument(
        "--scale-depth",
        action="store_true",
        help="plan two cut depths and scale per layer to the full depth (quicker; docs/planner.md, Search)",
    )
    parser.add_argument("--memory-per-rank", type=float, default=0.0, help="GB per rank: say whether the step fits")
    parser.add_argument(
        "--trace", action="store_true", help="attribute each collective's bytes to the source line that issued it"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    pipeline = parser.add_argument_group("a pp axis: pipeline stages (docs/planner.md, Pipeline parallelism)")
    pipeline.add_argument(
        "--microbatches", type=int, default=0, help="per step, each dp rank's batch split in M (default 4 x pp)"
    )
    pipeline.add_argument("--pp-schedule", choices=SCHEDULES, default="1f1b", help="torch.distributed.pipelining's")
    pipeline.add_argument("--pp-virtual", type=int, default=2, help="stages per rank of interleaved_1f1b (default 2)")
    search = parser.add_argument_group("--search: rank the meshes of --world ranks (docs/planner.md, Search)")
    search.add_argument("--search", action="store_true", help="sweep dp x cp x ep x tp, fully_shard / HSDP, recompute")
    search.add_argument("--world", type=int, default=0, help="ranks to search over")
    search.add_argument(
        "--hardware",
        choices=sorted(HARDWARE),
        default=None,
        help="published figures (default: 910b with --device npu, else h100)",
    )
    search.add_argument("--tflops", type=float, default=0.0, help="peak TFLOP/s per rank (default: --hardware's)")
    search.add_argument("--efficiency", type=float, default=0.4, help="fraction of --tflops achieved (default 0.4)")
    search.add_argument("--intra-gbs", type=float, default=0.0, help="GB/s per rank inside a node (default: hardware)")
    search.add_argument("--inter-gbs", type=float, default=0.0, help="GB/s per rank across nodes (default: hardware)")
    search.add_argument("--node-size", type=int, default=0, help="ranks per node (default: --hardware's)")
    search.add_argument("--verify", type=int, default=3, help="top configurations checked at a third depth")
    search.add_argument(
        "--search-pp",
        default="1",
        help="pp sizes searched, e.g. 1,8,16 (default 1: no pp); with --microbatches (default 4 x pp), --pp-schedule",
    )
    args = parser.parse_args(argv)
    compute_dtype = _DTYPES[args.compute_dtype] if args.compute_dtype else None
    if args.search:
        return _search(args, compute_dtype)
    if not args.mesh:
        parser.error("--mesh is required (or --search with --world)")
    shape, names = mesh_argument("plan", PLANNED_AXES)(args.mesh)
    mesh = dict(zip(names, shape))
    if "pp" in mesh:
        return _pipeline(args, mesh, compute_dtype)
    try:
        mesh = hsdp_mesh(mesh, args.hsdp, args.fully_shard) if args.hsdp else mesh
        check_hsdp(mesh, args.fully_shard)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    config = load_config(args.model, **overrides)
    batch = args.batch or data_parallel(mesh)
    started = time.perf_counter()

    def plan(cut):
        return plan_step(
            cut,
            mesh,
            name=args.model,
            rank=args.rank or 0,
            fully_shard=args.fully_shard,
            batch=batch,
            seq=args.seq,
            dtype=_DTYPES[args.dtype],
            compute_dtype=compute_dtype,
            trace=args.trace,
            device=args.device,
            recompute=args.recompute,
            cp_algorithm=args.cp_algorithm,
        )

    if args.scale_depth:
        from .search import cut_depths, scale_report

        if args.offload_optimizer:
            raise SystemExit(
                "hypershard: plan: --offload-optimizer with --scale-depth: the peak without the optimizer "
                "state is not linear in depth (planner/search.py, CHECKED_FIGURES); allowed: a full-depth plan"
            )

        d1, d2 = cut_depths(config)
        r1, r2 = (plan(load_config(args.model, **{**overrides, "num_hidden_layers": d})) for d in (d1, d2))
        layers = (
            config.get_text_config().num_hidden_layers
            if hasattr(config, "get_text_config")
            else config.num_hidden_layers
        )
        report = scale_report(r1, r2, d1, d2, layers)
        report.seconds = {f"depth {d1}": r1.seconds.get("step", 0), f"depth {d2}": r2.seconds.get("step", 0)}
        report.model += f" (planned at {d1} and {d2} layers, scaled to {layers})"
    else:
        report = plan(config)
    apply_options(report, offload=args.offload_optimizer)
    report.seconds["total"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(format_report(report, args.memory_per_rank * 1e9))
        if not args.offload_optimizer:
            print(estimate_line(report, _hardware(args), args.efficiency))
    return 1 if args.memory_per_rank and report.over(args.memory_per_rank * 1e9) else 0


def _hardware(args):
    import dataclasses

    hardware = HARDWARE[args.hardware or ("910b" if args.device == "npu" else "h100")]
    return dataclasses.replace(
        hardware,
        tflops=args.tflops or hardware.tflops,
        intra_gbs=args.intra_gbs or hardware.intra_gbs,
        inter_gbs=args.inter_gbs or hardware.inter_gbs,
        node_size=args.node_size or hardware.node_size,
    )


def estimate_line(report, hardware, efficiency: float) -> str:
    """The search's time model for one plan (docs/planner.md, Search 5; a pp plan's: Pipeline)."""
    from .search import estimate, pipeline_estimate

    if report.pp:
        sequences = report.pp["batch"]
        e = pipeline_estimate(report, hardware, efficiency, sequences * report.seq)
    else:
        sequences = data_parallel(report.mesh)
        e = estimate(report, hardware, efficiency, sequences * report.seq)
    comm = ", ".join(f"{a} {s:.2f} s ({e['links'][a]})" for a, s in sorted(e["comm_s"].items()))
    bubble = f", bubble {e['bubble_s']:.2f} s" if "bubble_s" in e else ""
    return (
        f"  estimated step ({hardware.name}, {hardware.tflops:g} TFLOP/s x {efficiency:g}, no overlap): "
        f"{e['step_s']:.2f} s = compute {e['compute_s']:.2f} s{bubble}, {comm}; "
        f"{sequences} sequences, {e['tokens_per_s']:.0f} tokens/s"
    )


def _pipeline(args, mesh, compute_dtype) -> int:
    from .pipeline import describe, plan_pipeline

    for flag, value in (
        (f"--hsdp (a {REPLICATE_AXIS} axis)", args.hsdp or REPLICATE_AXIS in mesh),
        ("--offload-optimizer", args.offload_optimizer),
        ("--scale-depth", args.scale_depth),
    ):
        if value:
            raise SystemExit(
                f"hypershard: plan: {flag} with a pp axis: not modelled (a pp plan plans each stage at its "
                "own depth); allowed: pp without it"
            )
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    config = load_config(args.model, **overrides)
    started = time.perf_counter()
    try:
        report = plan_pipeline(
            config,
            mesh,
            microbatches=args.microbatches or 4 * mesh["pp"],
            schedule=args.pp_schedule,
            virtual=args.pp_virtual,
            rank=args.rank,
            batch=args.batch,
            seq=args.seq,
            fully_shard=args.fully_shard,
            dtype=_DTYPES[args.dtype],
            compute_dtype=compute_dtype,
            device=args.device,
            recompute=args.recompute,
            cp_algorithm=args.cp_algorithm,
            trace=args.trace,
        )
    except ValueError as exc:
        if str(exc).startswith("hypershard: plan:"):
            raise SystemExit(str(exc)) from None
        raise
    report.model = args.model
    report.seconds["total"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        text = format_report(report, args.memory_per_rank * 1e9).split("\n")
        print("\n".join(text[:1] + describe(report) + text[1:]))
        print(estimate_line(report, _hardware(args), args.efficiency))
    return 1 if args.memory_per_rank and report.over(args.memory_per_rank * 1e9) else 0


def _search(args, compute_dtype) -> int:

    from .search import format_table, search

    if not args.world:
        raise SystemExit("hypershard: plan: --search needs --world N")
    hardware = _hardware(args)
    config = load_config(args.model)
    budget = args.memory_per_rank * 1e9

    def plan(mesh, fully_shard, recompute, layers):
        cut = load_config(args.model, num_hidden_layers=layers)
        t0 = time.perf_counter()
        r = plan_step(
            cut,
            mesh,
            name=args.model,
            fully_shard=fully_shard,
            batch=data_parallel(mesh),
            seq=args.seq,
            dtype=_DTYPES[args.dtype],
            compute_dtype=compute_dtype,
            device=args.device,
            recompute=recompute,
            cp_algorithm=args.cp_algorithm,
        )
        r.seconds["total"] = time.perf_counter() - t0
        return r

    def plan_pp(mesh, fully_shard, recompute):
        from .pipeline import plan_pipeline

        t0 = time.perf_counter()
        r = plan_pipeline(
            config,
            mesh,
            microbatches=args.microbatches or 4 * mesh["pp"],
            schedule=args.pp_schedule,
            virtual=args.pp_virtual,
            rank=None,
            seq=args.seq,
            fully_shard=fully_shard,
            dtype=_DTYPES[args.dtype],
            compute_dtype=compute_dtype,
            device=args.device,
            recompute=recompute,
            cp_algorithm=args.cp_algorithm,
        )
        r.seconds["total"] = time.perf_counter() - t0
        return r

    try:
        pps = sorted({int(x) for x in args.search_pp.split(",") if x.strip()})
    except ValueError:
        pps = []
    if not pps or min(pps) < 1:
        raise SystemExit(f"hypershard: plan: --search-pp {args.search_pp!r}; allowed: sizes >= 1, e.g. 1,8,16")
    started = time.perf_counter()
    ranked = search(
        config,
        args.world,
        budget,
        args.seq,
        plan,
        hardware,
        args.efficiency,
        verify=args.verify,
        log=lambda line: print(line, flush=True),
        pps=pps,
        plan_pp=plan_pp,
    )
    print(
        f"{args.model} on {args.world} ranks, seq {args.seq}, one sequence per dp rank"
        + (" (with pp: per microbatch, m of them)" if max(pps) > 1 else "")
        + f", device {args.device}, "
        f"compute {args.compute_dtype or args.dtype}, cp {args.cp_algorithm}"
        + (f", budget {args.memory_per_rank:g} GB per rank" if budget else "")
        + f"; searched in {time.perf_counter() - started:.0f} s"
    )
    print(format_table(ranked, budget, hardware, args.efficiency))
    return 0 if any(c.report is not None and (not budget or c.report.peak <= budget) for c in ranked) else 1


if __name__ == "__main__":
    sys.exit(main())
