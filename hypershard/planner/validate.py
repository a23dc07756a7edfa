"""The planner against reality: the same step planned (meta, simulated mesh) and run (4 real gloo
ranks on this machine), figure by figure.

    python -m hypershard.planner.validate --mesh dp=2,tp=2 [--fully-shard] [--recompute full]
    python -m hypershard.planner.validate --mesh dp=2,cp=2 --cp-algorithm ring

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
    args = parser.parse_args(argv)
    shape, names = mesh_argument("plan.validate", PLANNED_AXES)(args.mesh)
    result = validate(
        dict(zip(names, shape)), args.fully_shard, recompute=args.recompute, cp_algorithm=args.cp_algorithm
    )
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
