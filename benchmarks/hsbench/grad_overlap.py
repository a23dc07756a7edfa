"""Section "grad_overlap": how much of the data-parallel gradient sum the backward pass hides.

A small HF Qwen3 on 4 gloo ranks (dp=4, `parallelize`): its parameters are Replicate on dp, so
their gradients arrive Partial(sum) and are reduced in buckets (csrc/runtime/grad_sync.cpp). With
overlap (`hypershard._C.set_grad_overlap(True)`, the default) a full bucket starts its all-reduce
while backward goes on and the pass's end waits for it; without, every bucket is reduced when the
pass ends. Per setting, median over the timed steps on rank 0:

- backward: `loss.backward()`, gradient sums included (what a training step waits for);
- exposed sum: backward minus the same backward with no gradient sum at all (a dp=1 mesh of one
  rank per process running the same local batch: the compute alone), i.e. the communication the
  step still waits for;
- buckets started during the pass (`grad_sync_stats()["overlapped"]`) of all buckets.

The bucket cap is lowered to GRAD_OVERLAP_CAP so that the model's 10 MB of gradients fill
several buckets (with the default 25 MiB there would be one, which can only start at the end).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from .common import launch_section

GRAD_OVERLAP_CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    tie_word_embeddings=False,
)
GRAD_OVERLAP_CAP = 1 << 20  # 1 MiB buckets
WORLD = 4
BATCH_PER_RANK, SEQ = 2, 256


def _steps(model, batches, overlap: bool, timed: int) -> dict:
    import torch

    import hypershard as hs

    hs._C.set_grad_overlap(overlap)
    times, started, buckets = [], [], []
    for step, (ids, labels) in enumerate(batches):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        hs._C.reset_grad_sync_stats()
        start = time.perf_counter()
        loss.backward()
        elapsed = time.perf_counter() - start
        stats = hs._C.grad_sync_stats()
        if step >= len(batches) - timed:
            times.append(elapsed)
            started.append(stats["overlapped"])
            buckets.append(stats["buckets"])
    return {"backward_s": statistics.median(times), "overlapped": max(started), "buckets": max(buckets)}


def _worker(rank: int, world: int, settings: dict) -> dict:
    import hypershard as hs
    from hypershard.parallel import parallelize
    from hypershard.testing.models import make_batches, tiny_config, tiny_model

    config = tiny_config("qwen3", **GRAD_OVERLAP_CONFIG)
    steps = settings["warmup"] + settings["timed"]
    batches = make_batches(config.vocab_size, steps, batch=BATCH_PER_RANK * world, seq=SEQ)
    saved_cap, saved_overlap = hs._C.grad_bucket_bytes(), hs._C.grad_overlap()
    hs._C.set_grad_bucket_bytes(GRAD_OVERLAP_CAP)
    try:
        mesh = hs.init_device_mesh("cpu", (world,), ("dp",))
        model = parallelize(tiny_model(config), mesh)
        out = {
            name: _steps(model, batches, overlap, settings["timed"]) for name, overlap in (("on", True), ("off", False))
        }
        # The compute alone: this rank's share of the batch on a plain model, no gradient sum.
        local = tiny_model(config)
        mine = [(ids[rank::world], labels[rank::world]) for ids, labels in batches]
        out["compute"] = _steps(local, mine, True, settings["timed"])
    finally:
        hs._C.set_grad_bucket_bytes(saved_cap)
        hs._C.set_grad_overlap(saved_overlap)
    out["parameters"] = sum(p.numel() for p in local.parameters())
    return out


def run_grad_overlap(args, log: Callable) -> dict:
    settings = {"warmup": 1, "timed": 3 if args.quick else 5}
    log(f"grad_overlap: dp={WORLD}, {BATCH_PER_RANK} x {SEQ} tokens per rank ...")
    r0 = launch_section(log, _worker, WORLD, settings, args.timeout)
    if "error" in r0:
        return r0
    compute = r0["compute"]["backward_s"]
    for name in ("on", "off"):
        r0[name]["exposed_s"] = r0[name]["backward_s"] - compute
    r0["cap_bytes"] = GRAD_OVERLAP_CAP
    r0["config"] = GRAD_OVERLAP_CONFIG
    return r0


def grad_overlap_lines(result) -> list:
    if not result:
        return []
    lines = ["", "## Gradient sum overlap (dp=4, buckets started during backward)", ""]
    if "error" in result:
        return lines + [f"failed: {result['error']}"]
    lines += [
        f"Qwen3 of {result['parameters'] / 1e6:.1f} M parameters, {BATCH_PER_RANK} x {SEQ} tokens per rank, "
        f"{result['cap_bytes'] >> 20} MiB buckets; backward = loss.backward() with the gradient sums, median, rank 0; "
        "exposed = backward minus the compute alone (the same local batch on a plain model).",
        "",
        "| overlap | backward s | exposed sum s | buckets started during backward |",
        "|---|---:|---:|---:|",
    ]
    for name in ("on", "off"):
        r = result[name]
        lines.append(f"| {name} | {r['backward_s']:.3f} | {r['exposed_s']:.3f} | {r['overlapped']} of {r['buckets']} |")
    lines.append(f"| compute alone | {result['compute']['backward_s']:.3f} | — | — |")
    return lines + [""]
