"""make bench: hypershard's benchmarks, every figure a ratio measured side by side in ONE run.

Entry 1 — per-op dispatch overhead on tiny tensors (so the framework dominates): plain eager vs
hypershard vs torch.distributed.tensor DTensor, same mesh and placements, on 1-rank and 2-rank
CPU meshes (Replicate). Each timing is the median of repeated runs (min and max kept).

Writes bench/results.json and bench/RESULTS.md. `python benchmarks/run.py --help` for options.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
OPS = {
    "pointwise": lambda a, b: a + b,
    "inplace": lambda a, b: a.add_(b),
    "view": lambda a, b: a.view(16),
}


def timed(fn, iters: int, repeats: int) -> dict:
    for _ in range(min(iters, 500)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def worker(rank: int, world: int, port: int, iters: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import hypershard as hs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = hs.init_device_mesh("cpu", (world,), ("dp",))
    tmesh = init_device_mesh("cpu", (world,))
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    ha = hs.distribute_tensor(a, mesh, [hs.Replicate()])
    hb = hs.distribute_tensor(b, mesh, [hs.Replicate()])
    ta = distribute_tensor(a, tmesh, [Replicate()])
    tb = distribute_tensor(b, tmesh, [Replicate()])
    results = {}
    for name, op in OPS.items():
        plain = timed(lambda: op(a, b), iters, repeats)
        ours = timed(lambda: op(ha, hb), iters, repeats)
        theirs = timed(lambda: op(ta, tb), max(iters // 10, 100), repeats)
        results[name] = {
            "plain_us": plain["median"], "hypershard_us": ours["median"], "torch_dtensor_us": theirs["median"],
            "plain_minmax": [plain["min"], plain["max"]], "hypershard_minmax": [ours["min"], ours["max"]],
            "torch_dtensor_minmax": [theirs["min"], theirs["max"]],
            "ratio_vs_plain": ours["median"] / plain["median"],
            "speedup_vs_torch_dtensor": theirs["median"] / ours["median"],
            "overhead_ratio_vs_torch_dtensor": (theirs["median"] - plain["median"]) / max(ours["median"] - plain["median"], 1e-3),
        }
    stats = hs._C.dispatch_stats()
    if rank == 0:
        Path(out).write_text(json.dumps({"ops": results, "dispatch_stats": stats}))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mesh(world: int, iters: int, repeats: int, tmp: Path) -> dict:
    out = tmp / f"dispatch_{world}.json"
    mp.start_processes(worker, args=(world, free_port(), iters, repeats, str(out)), nprocs=world,
                       start_method="spawn")
    return json.loads(out.read_text())


def write_report(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    lines = ["# hypershard benchmark results", "",
             "Per-op dispatch overhead on 4x4 float32 tensors, Replicate (median of repeats, µs).", "",
             "| mesh | op class | plain | hypershard | torch DTensor | hypershard / plain | torch DTensor / hypershard | overhead ratio (torch / hypershard) |",
             "|---|---|---|---|---|---|---|---|"]
    for mesh, entry in results["dispatch_by_mesh"].items():
        for name, r in entry.items():
            lines.append(f"| {mesh} | {name} | {r['plain_us']:.2f} | {r['hypershard_us']:.2f} | {r['torch_dtensor_us']:.2f} "
                         f"| {r['ratio_vs_plain']:.2f}x | {r['speedup_vs_torch_dtensor']:.1f}x | {r['overhead_ratio_vs_torch_dtensor']:.1f}x |")
    (out_dir / "RESULTS.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="hypershard benchmarks (ratios measured side by side in one run)")
    parser.add_argument("--iters", type=int, default=20000, help="op calls per timing sample (default 20000)")
    parser.add_argument("--repeats", type=int, default=7, help="timing samples per figure; the median is reported")
    parser.add_argument("--out", default=str(ROOT / "bench"), help="output folder (default bench/)")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    by_mesh = {}
    for world in (1, 2):
        by_mesh[f"{world} rank{'s' if world > 1 else ''}"] = run_mesh(world, args.iters, args.repeats, out_dir)["ops"]
    results = {"dispatch_by_mesh": by_mesh, "dispatch": by_mesh["1 rank"], "torch": torch.__version__}
    write_report(results, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
