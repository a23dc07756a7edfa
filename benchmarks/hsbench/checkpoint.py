"""Section "checkpoint": hypershard's sharded checkpoints (`hypershard.checkpoint`, torch DCP
underneath) against what a user without them does -- gather every tensor (`full_tensor()`) and
`torch.save` it on rank 0, then `torch.load` the whole file on every rank and cut the shards.

A Qwen3 (random init, CHECKPOINT_CONFIG) with its AdamW state after one step, on a 4-rank CPU
mesh dp=2 x tp=2 with the model's TP plan; every figure is the median of --repeats rounds (the two
ways alternated). Reported: save and load seconds, the bytes each rank writes (DCP: its own shard
files; gathered: rank 0 everything), rank 0's peak RSS growth over a save (DCP writes from its
shards; gathered holds the whole model + optimizer state), and a resharding load into tp=4."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from .common import QWEN3_7M_CONFIG, QWEN3_7M_QUICK_CONFIG, error_text, ratio
from .memory import malloc_trim, reset_peak_rss, set_mmap_threshold, vm_kib

# the same model as fully_shard.py (common.QWEN3_7M_CONFIG), so the two sections describe one state
CHECKPOINT_CONFIG, CHECKPOINT_QUICK_CONFIG = QWEN3_7M_CONFIG, QWEN3_7M_QUICK_CONFIG
MESH = ((2, 2), ("dp", "tp"))
RESHARD_MESH = ((4,), ("tp",))


def _model(config_values: dict, mesh_spec):
    import torch

    import hypershard as hs
    from hypershard.parallel import parallelize
    from hypershard.testing.models import make_batches, tiny_config, tiny_model

    model = parallelize(tiny_model(tiny_config("qwen3", **config_values)), hs.init_device_mesh("cpu", *mesh_spec))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = make_batches(config_values["vocab_size"], 1, batch=4, seq=16)[0]
    model(input_ids=ids, labels=labels).loss.backward()
    optimizer.step()
    return model, optimizer


def _gathered_state(model, optimizer) -> dict:
    from hypershard.checkpoint import optimizer_state_dict

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    state = {"model": {n: full(t) for n, t in model.state_dict().items()}}
    opt = optimizer_state_dict(model, optimizer)
    state["optimizer"] = {
        "state": {n: {k: full(v) for k, v in s.items()} for n, s in opt["state"].items()},
        "param_groups": opt["param_groups"],
    }
    return state


def _load_gathered(path: Path, model, optimizer) -> None:
    """Every rank reads the whole file and copies its shard out of each full tensor."""
    import torch

    import hypershard as hs
    from hypershard.checkpoint import optimizer_state_dict, set_optimizer_state_dict

    state = torch.load(path, weights_only=False)

    def shard_of(full, like):
        if not isinstance(like, hs.DTensor):
            return full
        return hs.distribute_tensor(full, like.device_mesh, like.placements)

    with torch.no_grad():
        for name, param in model.state_dict().items():
            param.copy_(shard_of(state["model"][name], param))
    current = optimizer_state_dict(model, optimizer)
    loaded = {
        "state": {
            n: {k: shard_of(v, current["state"][n][k]) for k, v in s.items()}
            for n, s in state["optimizer"]["state"].items()
        },
        "param_groups": state["optimizer"]["param_groups"],
    }
    set_optimizer_state_dict(model, optimizer, loaded)


def _worker(rank: int, world: int, settings: dict) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    from hypershard import checkpoint

    set_mmap_threshold(64 * 1024)  # RSS follows what is live (see the memory section)
    config_values = settings["config"]
    root = Path(settings["root"])
    model, optimizer = _model(config_values, MESH)
    state_bytes = sum(t.numel() * t.element_size() for t in _gathered_state(model, optimizer)["model"].values())
    times: dict = {k: [] for k in ("dcp_save", "gathered_save", "dcp_load", "gathered_load", "dcp_reshard_load")}
    peaks: dict = {"dcp_save": [], "gathered_save": []}

    def peak_start() -> int:
        gc.collect()
        malloc_trim()
        base = vm_kib("VmRSS")
        reset_peak_rss()
        return base

    for round_ in range(settings["repeats"]):
        dist.barrier()
        base = peak_start()
        start = time.perf_counter()
        path = checkpoint.save(root / "dcp", model, optimizer, step=round_)
        times["dcp_save"].append(time.perf_counter() - start)
        peaks["dcp_save"].append((vm_kib("VmHWM") - base) * 1024)

        dist.barrier()
        base = peak_start()
        start = time.perf_counter()
        gathered = _gathered_state(model, optimizer)
        if rank == 0:
            torch.save(gathered, root / "gathered.pt")
        del gathered
        dist.barrier()
        times["gathered_save"].append(time.perf_counter() - start)
        peaks["gathered_save"].append((vm_kib("VmHWM") - base) * 1024)

        dist.barrier()
        start = time.perf_counter()
        checkpoint.load(path, model, optimizer)
        times["dcp_load"].append(time.perf_counter() - start)

        dist.barrier()
        start = time.perf_counter()
        _load_gathered(root / "gathered.pt", model, optimizer)
        dist.barrier()
        times["gathered_load"].append(time.perf_counter() - start)
    other, other_optimizer = _model(config_values, RESHARD_MESH)
    for _ in range(settings["repeats"]):
        dist.barrier()
        start = time.perf_counter()
        checkpoint.load(path, other, other_optimizer)
        times["dcp_reshard_load"].append(time.perf_counter() - start)
    files = {p.name: p.stat().st_size for p in path.glob("*.distcp")}
    result = {k: statistics.median(v) for k, v in times.items()}
    result.update(
        model_bytes=state_bytes,
        dcp_bytes_per_rank=[files.get(f"__{r}_0.distcp", 0) for r in range(world)],
        gathered_file_bytes=(root / "gathered.pt").stat().st_size,
        params=sum(p.numel() for p in model.parameters()),
    )
    # Rank 0's peak RSS growth over a save: DCP writes from the shards it has; the gathered way
    # holds the whole model and optimizer state.
    result["dcp_rank0_peak_bytes"] = statistics.median(peaks["dcp_save"])
    result["gathered_rank0_peak_bytes"] = statistics.median(peaks["gathered_save"])
    return result


def run_checkpoint(args, log: Callable) -> dict:
    from hypershard.launch import spawn_local_ranks

    config_values = CHECKPOINT_QUICK_CONFIG if args.quick else CHECKPOINT_CONFIG
    root = Path(tempfile.mkdtemp(prefix="hs_bench_ckpt_"))
    out: dict = {"config": config_values, "mesh": "dp=2 x tp=2", "reshard_mesh": "tp=4"}
    log("checkpoint: 4-rank mesh ...")
    try:
        r = spawn_local_ranks(
            _worker,
            4,
            {"config": config_values, "root": str(root), "repeats": max(1, args.repeats // 7)},
            timeout=args.timeout,
        )[0]
        r["save_speedup"] = ratio(r["gathered_save"], r["dcp_save"])
        r["load_speedup"] = ratio(r["gathered_load"], r["dcp_load"])
        out.update(r)
    except Exception as exc:  # noqa: BLE001 -- reported, the other sections still run
        out["error"] = error_text(exc)
        log(f"  failed: {error_text(exc)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def checkpoint_lines(r) -> list:
    """The checkpoint section's table for RESULTS.md."""
    if not r:
        return []
    if "error" in r:
        return ["## Sharded checkpoints", "", f"failed: {r['error']}", ""]
    mb = 1024**2
    per_rank = ", ".join(f"{b / mb:.1f}" for b in r["dcp_bytes_per_rank"])
    return [
        f"## Sharded checkpoints (Qwen3, {r['params'] / 1e6:.1f} M parameters + AdamW state, {r['mesh']})",
        "",
        "DCP = `hypershard.checkpoint.save/load` (torch.distributed.checkpoint, each rank its shards); "
        "gathered = `full_tensor()` of every tensor and `torch.save` on rank 0, loaded by `torch.load` on "
        "every rank and cut into shards. Seconds, medians.",
        "",
        "| | DCP | gathered | gathered / DCP |",
        "|---|---:|---:|---:|",
        f"| save s | {r['dcp_save']:.3f} | {r['gathered_save']:.3f} | {r['save_speedup']:.2f}x |",
        f"| load s | {r['dcp_load']:.3f} | {r['gathered_load']:.3f} | {r['load_speedup']:.2f}x |",
        f"| load into {r['reshard_mesh']} (reshard) s | {r['dcp_reshard_load']:.3f} | — | — |",
        f"| MB written per rank | {per_rank} | {r['gathered_file_bytes'] / mb:.1f} on rank 0, 0 elsewhere | — |",
        f"| rank 0 peak RSS growth over a save, MB | {r['dcp_rank0_peak_bytes'] / mb:.1f} "
        f"| {r['gathered_rank0_peak_bytes'] / mb:.1f} | — |",
        "",
        f"Model parameters alone: {r['model_bytes'] / mb:.1f} MB (with AdamW's two states, 3x that).",
        "",
    ]
