"""Section "fully_shard": hypershard's fully sharded data parallelism (`hs.fully_shard` on every
decoder layer and the root) against hypershard's plain data parallelism (`parallelize` on dp:
every rank a whole copy, gradients all-reduced in buckets) and PyTorch's FSDP2
(`torch.distributed.fsdp.fully_shard` on torch DTensors, same model, mesh and wrapping), on a
4-rank CPU mesh dp=4, a Qwen3 of FSDP_CONFIG's size, AdamW with clip_grad_norm_.

Per implementation and rank: the bytes of parameters + gradients + optimizer states held after a
step (against plain data parallelism's and the ideal 1/dp of it), the peak RSS growth over a step,
the step time (median of --timed steps, the implementations interleaved step by step), the bytes
sent per step (hypershard's traffic counters; torch's collectives counted at its dispatcher)
against the ideal 3 x params x (dp-1)/dp, and for hypershard the time its forward/backward spent
waiting for all-gathers and how many were prefetched (the overlap)."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

from .common import QWEN3_7M_CONFIG, QWEN3_7M_QUICK_CONFIG, error_text, ratio
from .memory import malloc_trim, reset_peak_rss, set_mmap_threshold, vm_kib
from .trainers import lr_at, state_bytes

# the same model as checkpoint.py (common.QWEN3_7M_CONFIG)
FSDP_CONFIG, FSDP_QUICK_CONFIG = QWEN3_7M_CONFIG, QWEN3_7M_QUICK_CONFIG
MESH = ((4,), ("dp",))
IMPLS = ("hypershard_fully_shard", "hypershard_dp", "torch_fsdp2")
BATCH, SEQ = 8, 64


def _build(impl: str, config):
    import torch

    from hypershard.testing.models import tiny_model

    model = tiny_model(config)
    if impl == "torch_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", MESH[0], mesh_dim_names=MESH[1])
        for layer in model.model.layers:
            torch_fully_shard(layer, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    else:
        import hypershard as hs
        from hypershard.parallel import parallelize

        mesh = hs.init_device_mesh("cpu", *MESH)
        model = parallelize(model, mesh, shard_inputs=impl != "torch_fsdp2")
        if impl == "hypershard_fully_shard":
            for layer in model.model.layers:
                hs.fully_shard(layer, mesh)
            hs.fully_shard(model, mesh)
    params = list(model.parameters())
    return model, params, torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _step(impl: str, model, params, optimizer, ids, labels, lr: float, rank: int) -> float:
    import torch

    if impl == "torch_fsdp2":  # torch's FSDP takes each rank's own batch rows
        rows = ids.shape[0] // 4
        ids, labels = ids[rank * rows : (rank + 1) * rows], labels[rank * rows : (rank + 1) * rows]
        # the loss over the GLOBAL token count, as the hypershard runs compute it
        local = (labels[:, 1:] != -100).sum()
        total = local.clone()
        torch.distributed.all_reduce(total)
        local_loss = model(input_ids=ids, labels=labels).loss
        loss = local_loss * (local * 4 / total)  # FSDP2 averages gradients over dp
        report = (local_loss.detach() * local / total).reshape(1)
        torch.distributed.all_reduce(report)  # the global loss, for the comparison column
    else:
        loss = model(input_ids=ids, labels=labels).loss
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return float(report.item()) if impl == "torch_fsdp2" else float(loss.detach().item())


def _worker(rank: int, world: int, settings: dict) -> dict:
    import torch.distributed as dist

    import hypershard as hs
    from hypershard.fsdp.fully_shard import _groups
    from hypershard.testing.models import make_batches, tiny_config

    from .collectives import CollectiveBytes

    set_mmap_threshold(64 * 1024)
    config = tiny_config("qwen3", **settings["config"])
    warmup, timed = settings["warmup"], settings["timed"]
    batches = make_batches(config.vocab_size, warmup + timed, batch=BATCH, seq=SEQ)
    built = {}
    out: dict = {}
    for impl in IMPLS:
        try:
            built[impl] = _build(impl, config)
        except Exception as exc:  # noqa: BLE001 -- reported, the others still run
            out[impl] = {"error": error_text(exc)}
    times = {impl: [] for impl in built}
    sent = {impl: [] for impl in built}
    peaks = {impl: [] for impl in built}
    losses = {impl: [] for impl in built}
    waits = {impl: 0.0 for impl in built}
    for step, (ids, labels) in enumerate(batches):
        for impl, (model, params, optimizer) in built.items():
            dist.barrier()
            gc.collect()
            malloc_trim()
            base = vm_kib("VmRSS")
            reset_peak_rss()
            before = hs._C.traffic()["bytes_sent"]
            groups = _groups(model, True) if impl == "hypershard_fully_shard" else []
            for g in groups:
                g.cgroup.reset_stats()
            counter = CollectiveBytes() if impl == "torch_fsdp2" else None
            start = time.perf_counter()
            if counter is not None:
                with counter:
                    loss = _step(impl, model, params, optimizer, ids, labels, lr_at(step, len(batches)), rank)
            else:
                loss = _step(impl, model, params, optimizer, ids, labels, lr_at(step, len(batches)), rank)
            elapsed = time.perf_counter() - start
            losses[impl].append(loss)
            if step < warmup:
                continue
            times[impl].append(elapsed)
            peaks[impl].append((vm_kib("VmHWM") - base) * 1024)
            sent[impl].append(counter.bytes_sent if counter is not None else hs._C.traffic()["bytes_sent"] - before)
            if groups:
                stats = [g.cgroup.stats() for g in groups]
                waits[impl] += sum(s["wait_seconds"] for s in stats)
                out.setdefault("prefetched", sum(s["prefetched"] for s in stats))
                out.setdefault("gathers", sum(s["gathers"] for s in stats))
    # the model's size: a DTensor parameter's numel is its GLOBAL one in every implementation
    model_params = next(iter(built.values()))[1] if built else []
    for impl, (model, params, optimizer) in built.items():
        out[impl] = {
            "step_s": statistics.median(times[impl]),
            "state": state_bytes(params, [optimizer]),
            "peak_rss_mb": statistics.median(peaks[impl]) / 2**20,
            "bytes_per_step": statistics.median(sent[impl]),
            "losses": losses[impl],
            "wait_s_per_step": waits[impl] / max(1, len(times[impl])),
        }
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in model_params)
    out["params"] = sum(p.numel() for p in model_params)
    return out


def run_fully_shard(args, log: Callable) -> dict:
    from hypershard.launch import spawn_local_ranks

    config = FSDP_QUICK_CONFIG if args.quick else FSDP_CONFIG
    log("fully_shard: 4-rank mesh dp=4 ...")
    try:
        ranks = spawn_local_ranks(
            _worker, 4, {"config": config, "warmup": args.warmup, "timed": args.timed}, timeout=args.timeout
        )
    except Exception as exc:  # noqa: BLE001
        log(f"  failed: {error_text(exc)}")
        return {"error": error_text(exc)}
    r = ranks[0]
    dp = 4
    out = {"config": config, "mesh": "dp=4", "batch": [BATCH, SEQ], "params": r["params"], "impls": {}}
    ideal_bytes = 3 * r["param_bytes"] * (dp - 1) / dp
    ddp_state = r.get("hypershard_dp", {}).get("state", {}).get("total_mb")
    for impl in IMPLS:
        e = r.get(impl, {})
        if "error" in e or not e:
            out["impls"][impl] = e
            continue
        total = e["state"]["total_mb"]
        out["impls"][impl] = {
            **e,
            "state_vs_ideal": ratio(total, ddp_state / dp) if ddp_state else None,
            "bytes_vs_ideal": ratio(e["bytes_per_step"], ideal_bytes),
            "max_loss_diff_vs_hypershard_dp": max(
                (abs(a - b) / abs(b) for a, b in zip(e["losses"], r["hypershard_dp"]["losses"])), default=None
            )
            if "hypershard_dp" in r and "losses" in r["hypershard_dp"]
            else None,
        }
    fs, torch_fs = out["impls"].get("hypershard_fully_shard", {}), out["impls"].get("torch_fsdp2", {})
    out["step_time_vs_torch_fsdp2"] = ratio(fs.get("step_s"), torch_fs.get("step_s"))
    out["ideal_bytes_per_step"] = ideal_bytes
    out["prefetched"], out["gathers"] = r.get("prefetched"), r.get("gathers")
    return out


def fully_shard_lines(r) -> list:
    if not r:
        return []
    if "error" in r:
        return ["## Fully sharded data parallelism", "", f"failed: {r['error']}", ""]
    names = {
        "hypershard_fully_shard": "hypershard fully_shard",
        "hypershard_dp": "hypershard data parallel",
        "torch_fsdp2": "torch FSDP2",
    }
    lines = [
        f"## Fully sharded data parallelism (Qwen3, {r['params'] / 1e6:.1f} M parameters, {r['mesh']}, "
        f"batch {r['batch'][0]} x {r['batch'][1]})",
        "",
        "State = parameters + gradients + AdamW states held per rank after a step (rank 0); ideal = "
        "data parallel's / dp. Bytes = sent per rank per step; ideal = 3 x parameter bytes x (dp-1)/dp. "
        "Wait = time forward/backward spent waiting for all-gathers.",
        "",
        "| implementation | step s | state MB | state / ideal | peak RSS growth MB | MB sent / step "
        "| bytes / ideal | gather wait s / step | loss vs data parallel |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for impl, e in r["impls"].items():
        if "error" in e or not e:
            lines.append(f"| {names[impl]} | failed: {e.get('error', 'not run')[:120]} |||||||")
            continue
        diff = e.get("max_loss_diff_vs_hypershard_dp")
        lines.append(
            f"| {names[impl]} | {e['step_s']:.3f} | {e['state']['total_mb']:.1f} "
            f"| {e['state_vs_ideal']:.2f}x | {e['peak_rss_mb']:.1f} | {e['bytes_per_step'] / 2**20:.2f} "
            f"| {e['bytes_vs_ideal']:.2f}x | {e['wait_s_per_step']:.3f} "
            f"| {'—' if diff is None else f'{diff:.1e}'} |"
        )
    lines += [
        "",
        f"hypershard fully_shard / torch FSDP2 step time: {r['step_time_vs_torch_fsdp2']:.2f}x"
        if r.get("step_time_vs_torch_fsdp2")
        else "",
        f"All-gathers issued ahead (prefetched) in a timed step: {r.get('prefetched')} of {r.get('gathers')}.",
        "",
    ]
    return lines
