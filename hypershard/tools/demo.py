"""make demo: a real HuggingFace Qwen3 model (tiny config, random weights) trains on a 4-rank
CPU mesh (dp=2 x tp=2 by default) through hypershard, fitting one batch, then the same steps run
on one device and the two are compared step by step. Writes demo_out/loss_curve.png and demo_out/losses.json.

    python -m hypershard.demo [--mesh dp=2,tp=2] [--steps 8] [--out demo_out]

Each rank builds the same model (same seed); parallelize() shards it with the model's own
tensor-parallel plan on tp and the batch on dp; AdamW and clip_grad_norm_ run unchanged.
(The layout-core walkthrough is `python -m hypershard.tools.layout_demo`.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..launch.ranks import mesh_argument, mesh_size, spawn_local_ranks

# The demo's model is dense (no experts): it gives a meaning to data, tensor and context parallelism.
DEMO_AXES = ("dp", "tp", "cp")


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    import hypershard as hs
    from hypershard.parallel import parallelize
    from hypershard.testing.models import make_batches, tiny_config, tiny_model, train

    mesh = hs.init_device_mesh("cpu", *args.mesh)
    config = tiny_config("qwen3")
    batches = make_batches(config.vocab_size, 1, batch=args.batch, seq=args.seq) * args.steps  # fit one batch
    model = parallelize(tiny_model(config), mesh)
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc=f"hypershard, {world} ranks", unit="step", leave=True)

    def on_step(step: int, loss: float) -> None:
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}")
            bar.update(1)

    start = time.perf_counter()
    losses = train(model, batches, lr=args.lr, on_step=on_step)
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    sharded = {name: [repr(p) for p in param.placements] for name, param in model.named_parameters()}
    stats = hs._C.dispatch_stats()
    traffic = hs._C.traffic()
    grads = hs._C.grad_sync_stats()
    return {
        "losses": losses,
        "seconds": elapsed,
        "placements": sharded,
        "stats": stats,
        "traffic": traffic,
        "grads": grads,
    }


def _single_device(args: argparse.Namespace) -> tuple[list, float]:
    import torch
    from tqdm import tqdm

    from hypershard.testing.models import make_batches, tiny_config, tiny_model, train

    torch.set_num_threads(1)
    config = tiny_config("qwen3")
    batches = make_batches(config.vocab_size, 1, batch=args.batch, seq=args.seq) * args.steps  # fit one batch
    bar = tqdm(total=args.steps, desc="one device", unit="step", leave=True)

    def on_step(step: int, loss: float) -> None:
        bar.set_postfix(loss=f"{loss:.4f}")
        bar.update(1)

    start = time.perf_counter()
    losses = train(tiny_model(config), batches, lr=args.lr, on_step=on_step)
    bar.close()
    return losses, time.perf_counter() - start


def _plot(path: Path, distributed: list, single: list, mesh_text: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(single) + 1))
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot(steps, single, "o-", label="one device", linewidth=2)
    ax.plot(steps, distributed, "x--", label=f"hypershard ({mesh_text})", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Qwen3 (tiny) training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hypershard.demo",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--mesh",
        type=mesh_argument("demo", DEMO_AXES),
        default=mesh_argument("demo", DEMO_AXES)("dp=2,tp=2"),
        help="mesh axes and sizes (default dp=2,tp=2); tp uses the model's TP plan",
    )
    parser.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    parser.add_argument("--batch", type=int, default=4, help="global batch size (default 4)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 1e-2)")
    parser.add_argument("--out", default="demo_out", help="output folder (default demo_out)")
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds before stuck ranks are reported and killed (default 600)"
    )
    args = parser.parse_args(argv)

    world = mesh_size(args.mesh[0])
    mesh_text = " x ".join(f"{n}={s}" for s, n in zip(*args.mesh))
    print(f"hypershard demo: Qwen3ForCausalLM (tiny, random init) on a {world}-rank CPU mesh ({mesh_text})")
    result = spawn_local_ranks(_rank, world, args, timeout=args.timeout)[0]
    single, single_seconds = _single_device(args)
    distributed = result["losses"]

    print(f"\n{'step':>4}  {'hypershard':>12}  {'one device':>12}  {'rel. diff':>10}")
    worst = 0.0
    for step, (d, s) in enumerate(zip(distributed, single), 1):
        diff = abs(d - s) / max(abs(s), 1e-12)
        worst = max(worst, diff)
        print(f"{step:>4}  {d:12.6f}  {s:12.6f}  {diff:10.2e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _plot(out / "loss_curve.png", distributed, single, mesh_text)
    (out / "losses.json").write_text(
        json.dumps({"mesh": mesh_text, "hypershard": distributed, "one_device": single}, indent=2)
    )
    sharded = sum(1 for p in result["placements"].values() if any(x.startswith("Shard") for x in p))
    print(
        f"\nparameters: {len(result['placements'])} DTensors, {sharded} of them sharded; "
        f"ops through hypershard: {result['stats']['calls']} ({result['stats']['cache_hits']} plan-cache hits, "
        f"{result['stats']['fast_calls']} on the typed fast path); "
        f"rank 0 sent {result['traffic']['bytes_sent']} bytes in {result['traffic']['collectives']} collectives "
        f"({result['grads']['bucketed']} gradients summed in {result['grads']['buckets']} buckets)"
    )
    print(
        f"time: {result['seconds']:.2f} s on the mesh, {single_seconds:.2f} s on one device "
        f"(tiny model: the framework, not compute, dominates)"
    )
    ok = worst <= 1e-5
    print(f"max relative loss difference {worst:.2e}: {'MATCHES one device (rtol 1e-5)' if ok else 'MISMATCH'}")
    print(f"wrote {out / 'loss_curve.png'} and {out / 'losses.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
