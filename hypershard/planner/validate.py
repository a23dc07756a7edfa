"""The planner against reality: the same step planned (meta, simulated mesh) and run (4 real gloo
ranks on this machine), figure by figure.

    python -m hypershard.planner.validate --mesh dp=2,tp=2 [--fully-shard] [--recompute full]
    python -m hypershard.planner.validate --mesh dp=2,cp=2 --cp-algorithm ring
    python -m hypershard.planner.validate --mesh dp=4 --fully-shard --hsdp 2
    python -m hypershard.planner.validate --rank-check [--world 4] [--top 3] [--steps 5]

Compared for rank 0 (planned | measured):
- parameters, gradients, optimizer state: storage bytes counted on the real tensors;
- gradients again as resident-set growth from before forward to after backward (activations are
  freed by then, the gradients stay);
- the forward+backward peak: VmHWM (reset at forward) minus the resident set at forward, against
  the planner's peak of the live storages over the same span;
- the optimizer's growth: resident-set growth over clip + AdamW's first step (its state);
- hypershard's traffic counter over the step.
The ranks run with MALLOC_MMAP_THRESHOLD_=65536: glibc then maps every tensor above 64 KiB on its
own and unmaps it when freed, so the resident set follows live tensor bytes (with the default,
freed blocks stay in the heap and the resident set only grows). One thread per rank.

`--rank-check` (`rank_check`) checks the search's ranking instead: it measures this machine's
matmul throughput per rank and gloo bandwidth on the real ranks (all busy at once, as in a step),
runs the planner's `--search` for the same small Qwen3 on `--device cpu` with those figures as its
time model (one node holding every rank, efficiency 1), then times each of the top configurations
for a few real steps on the ranks (one sequence per dp rank, as the search assumes) and prints the
predicted and the measured order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# A small Qwen3 whose step holds tens of MB per rank: far above the resident-set noise (Python
# objects, plan caches), small enough for 4 ranks on 2 cores.
MODEL = dict(
    name="qwen3",
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=32,
    tie_word_embeddings=False,
)
BATCH, SEQ = 8, 256
FIGURES = (
    "parameters",
    "gradients",
    "optimizer",
    "gradients_rss",
    "forward_backward_peak",
    "optimizer_growth",
    "traffic_bytes",
)


def validate(
    shape: dict,
    fully_shard: bool = False,
    model: dict = MODEL,
    batch: int = BATCH,
    seq: int = SEQ,
    recompute: str = "none",
    cp_algorithm: str = "all_gather_kv",
) -> dict:
    """{figure: (planned, measured, relative difference)} for rank 0 (see the module docstring). The
    plan takes the CPU's kernels (device "cpu"): the real ranks run on this machine's CPU."""
    from ..launch.ranks import spawn_local_ranks
    from .run import measure_rank, plan_step
    from .step import load_config

    world = 1
    for n in shape.values():
        world *= n
    started = time.perf_counter()
    measured = spawn_local_ranks(
        measure_rank,
        world,
        dict(model),
        dict(shape),
        fully_shard,
        batch,
        seq,
        recompute,
        cp_algorithm,
        env={"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"},
    )[0]
    measured_s = time.perf_counter() - started
    values = dict(model)
    config = load_config(values.pop("name"), **values)
    started = time.perf_counter()
    planned = plan_step(
        config,
        shape,
        batch=batch,
        seq=seq,
        fully_shard=fully_shard,
        device="cpu",
        recompute=recompute,
        cp_algorithm=cp_algorithm,
    ).to_dict()
    planned_s = time.perf_counter() - started
    planned["gradients_rss"] = planned["gradients"]
    out = {}
    for figure in FIGURES:
        p, m = planned[figure], measured[figure]
        out[figure] = (p, m, abs(p - m) / max(abs(m), 1))
    out["seconds"] = (planned_s, measured_s, 0.0)
    return out


def measure_speed(rank: int, world: int, size: int = 384, seconds: float = 2.0, mbytes: int = 16) -> dict:
    """On each real rank at once (the contention a step sees): fp32 matmul FLOP/s of one thread
    (size x size products for `seconds`) and the gloo all-reduce bandwidth, as bytes this rank sends
    (ring: 2 (k - 1) / k of the buffer, hypershard's count) per second."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    dist.barrier()
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        n += 1
    flops = 2 * size**3 * n / (time.perf_counter() - started)
    buf = torch.zeros(mbytes * 2**20 // 4)
    dist.all_reduce(buf)
    dist.barrier()
    runs, started = 5, time.perf_counter()
    for _ in range(runs):
        dist.all_reduce(buf)
    elapsed = time.perf_counter() - started
    sent = 2 * (world - 1) * buf.numel() * 4 / world * runs
    return {"flops_per_s": flops, "bytes_per_s": sent / elapsed}


def time_rank(
    rank: int,
    world: int,
    config_values: dict,
    shape: dict,
    fully_shard: bool,
    batch: int,
    seq: int,
    recompute: str,
    cp_algorithm: str,
    steps: int,
) -> list:
    """Seconds of `steps` real training steps (after one warm-up step), each between barriers."""
    import torch.distributed as dist

    import hypershard as hs

    from .step import build_model, load_config, make_batch, shard_model, train_step

    config = load_config(config_values.pop("name"), **config_values)
    mesh = hs.init_device_mesh("cpu", list(shape.values()), list(shape))
    ids = make_batch(config, batch, seq, "cpu")
    model = shard_model(build_model(config, "cpu"), mesh, fully_shard, None, cp_algorithm, recompute)
    train_step(model, ids)
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        started = time.perf_counter()
        train_step(model, ids)
        dist.barrier()
        out.append(time.perf_counter() - started)
    return out


def rank_check(world: int = 4, top: int = 3, steps: int = 5, model: dict = MODEL, seq: int = SEQ, log=print) -> dict:
    """The search's predicted order of its `top` configurations against their measured order (the
    module docstring). Returns the measured throughput and bandwidth and one row per configuration."""
    import statistics

    from ..launch.ranks import spawn_local_ranks
    from .run import plan_step
    from .search import Hardware, search
    from .step import data_parallel, load_config

    env = {"OMP_NUM_THREADS": "1"}
    speeds = spawn_local_ranks(measure_speed, world, env=env)
    flops = statistics.mean(s["flops_per_s"] for s in speeds)
    gbs = statistics.mean(s["bytes_per_s"] for s in speeds) / 1e9
    log(
        f"measured on {world} ranks at once: {flops / 1e9:.2f} GFLOP/s per rank (fp32 matmul), gloo {gbs:.3f} GB/s sent"
    )
    hardware = Hardware("this machine (measured)", flops / 1e12, gbs, gbs, world, gbs, 0.0)
    values = dict(model)
    name = values.pop("name")
    config = load_config(name, **values)

    def plan(mesh, fully_shard, recompute, layers):
        return plan_step(
            load_config(name, **dict(values, num_hidden_layers=layers)),
            mesh,
            name=name,
            fully_shard=fully_shard,
            batch=mesh.get("dp", 1),
            seq=seq,
            device="cpu",
            recompute=recompute,
        )

    started = time.perf_counter()
    ranked = search(config, world, 0.0, seq, plan, hardware, 1.0, verify=0)
    searched = time.perf_counter() - started
    fit = [c for c in ranked if c.report is not None][:top]
    rows = []
    for i, c in enumerate(fit, 1):
        dp = data_parallel(c.mesh)
        times = spawn_local_ranks(
            time_rank,
            world,
            dict(model),
            dict(c.mesh),
            c.fully_shard,
            dp,
            seq,
            c.recompute,
            "all_gather_kv",
            steps,
            env=env,
        )[0]
        measured = statistics.median(times)
        row = {
            "mesh": c.name,
            "predicted_rank": i,
            "predicted_step_s": c.estimate["step_s"],
            "predicted_compute_s": c.estimate["compute_s"],
            "predicted_comm_s": sum(c.estimate["comm_s"].values()),
            "predicted_tokens_per_s": c.estimate["tokens_per_s"],
            "measured_step_s": measured,
            "measured_steps_s": times,
            "measured_tokens_per_s": dp * seq / measured,
        }
        rows.append(row)
        log(
            f"{i} {c.name:<12} predicted {row['predicted_step_s']:.3f} s ({row['predicted_tokens_per_s']:.0f} tok/s), "
            f"measured {measured:.3f} s ({row['measured_tokens_per_s']:.0f} tok/s)"
        )
    order = sorted(range(len(rows)), key=lambda j: -rows[j]["measured_tokens_per_s"])
    for rank, j in enumerate(order, 1):
        rows[j]["measured_rank"] = rank
    same = [r["measured_rank"] for r in rows] == list(range(1, len(rows) + 1))
    log(f"measured order {'matches' if same else 'DIFFERS FROM'} the predicted order")
    return {
        "gflops_per_rank": flops / 1e9,
        "gloo_gbs": gbs,
        "search_s": searched,
        "rows": rows,
        "order_matches": same,
    }


def main(argv=None) -> int:
    from ..launch.ranks import mesh_argument
    from . import PLANNED_AXES

    parser = argparse.ArgumentParser(
        prog="python -m hypershard.planner.validate",
        description="One training step of a small Qwen3 planned (meta tensors, simulated mesh) and run on "
        "real gloo ranks of this machine; prints rank 0's figures as JSON: [planned, measured, relative error].",
    )
    parser.add_argument(
        "--mesh",
        default="dp=2,tp=2",
        help=f"mesh axes and sizes, e.g. dp=2,tp=2; the real run starts one process per rank "
        f"(axes: {', '.join(PLANNED_AXES)}; default %(default)s)",
    )
    parser.add_argument(
        "--fully-shard", action="store_true", help="hs.fully_shard every decoder layer and the root over dp"
    )
    parser.add_argument(
        "--hsdp",
        type=int,
        default=0,
        help="with --fully-shard: dp=D becomes dp_replicate=R x dp=D/R (HSDP; default: none)",
    )
    parser.add_argument(
        "--recompute",
        choices=("none", "selective", "full"),
        default="none",
        help="hs.recompute of every decoder layer (default %(default)s)",
    )
    parser.add_argument(
        "--cp-algorithm",
        choices=("all_gather_kv", "ulysses", "ring"),
        default="all_gather_kv",
        help="attention on a sequence split over a cp axis (default %(default)s)",
    )
    parser.add_argument(
        "--rank-check",
        action="store_true",
        help="time the search's top configurations on real ranks against its predicted order (not --mesh)",
    )
    parser.add_argument("--world", type=int, default=4, help="ranks of --rank-check (default %(default)s)")
    parser.add_argument("--top", type=int, default=3, help="configurations --rank-check times (default %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (default %(default)s)")
    args = parser.parse_args(argv)
    if args.rank_check:
        print(json.dumps(rank_check(args.world, args.top, args.steps), indent=1))
        return 0
    from .step import check_hsdp, hsdp_mesh

    shape, names = mesh_argument("plan.validate", PLANNED_AXES)(args.mesh)
    mesh = dict(zip(names, shape))
    try:  # one line before any rank starts
        mesh = hsdp_mesh(mesh, args.hsdp, args.fully_shard) if args.hsdp else mesh
        check_hsdp(mesh, args.fully_shard)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    result = validate(mesh, args.fully_shard, recompute=args.recompute, cp_algorithm=args.cp_algorithm)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
