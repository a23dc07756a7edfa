"""Section "compile": hypershard.compile (the local program and its functional collectives in one
graph, docs/compile.md) against eager hypershard, on the demo's model and mesh.

`make demo`'s tiny HF Qwen3 on 4 gloo ranks (dp2 x tp2, `parallelize`), strict mode. Per setting,
in the same processes, interleaved step by step so that both see the same machine load:

- eager: hypershard's per-op C++ dispatch;
- compiled: `hs.compile(model, backend="inductor", fullgraph=True)` on a second copy of the same
  model (same seed); its first call traces and compiles (reported as compile seconds);
- compiled, waits moved: the same with inductor's compute/communication reordering (WAITS_MOVED:
  its scheduler issues each functional collective early and moves its wait to the first use of
  the result, so gloo's thread communicates while the compute between them runs);
- fully_shard, eager and compiled: the same model with each decoder layer and then the root
  `fully_shard`ed over dp (on top of tp); compiled, each layer's forward is one program and the
  groups' gathers and reduce-scatters stay eager hooks around it.

Timed per step, median over the timed steps on rank 0: forward + backward (`model(...).loss`,
`loss.backward()`, gradient sums included), then the AdamW step (eager in both). The losses of
the two copies are compared at every step (they train the same batches).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from .common import launch_section

WORLD = 4
MESH = ((2, 2), ("dp", "tp"))
BATCH, SEQ = 4, 32
# inductor's options that move waits: its reordering switched on with the passes torch's config
# recommends (the switch alone runs no pass): each collective issued as early as peak memory allows,
# each wait sunk to the first use of its result
WAITS_MOVED = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [
        "reorder_communication_preserving_peak_memory",
        "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory",
    ],
}


def _worker(rank: int, world: int, settings: dict) -> dict:
    import torch

    import hypershard as hs
    from hypershard.parallel import parallelize
    from hypershard.testing.models import make_batches, tiny_config, tiny_model

    mesh = hs.init_device_mesh("cpu", *MESH)
    hs.set_strict(True)
    config = tiny_config("qwen3")
    steps = settings["warmup"] + settings["timed"]
    batches = make_batches(config.vocab_size, steps, batch=BATCH, seq=SEQ)

    def build(compiled: bool, options=None, sharded=False):
        torch.manual_seed(0)
        model = parallelize(tiny_model(config), mesh)
        if sharded:
            for layer in model.model.layers:
                hs.fully_shard(layer, mesh)
            hs.fully_shard(model, mesh)
        if compiled:
            hs.compile(model, backend="inductor", fullgraph=True, options=options)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    runs = {
        "eager": build(False),
        "compiled": build(True),
        "reordered": build(True, WAITS_MOVED),
        "fsdp_eager": build(False, sharded=True),
        "fsdp_compiled": build(True, sharded=True),
    }
    times = {name: [] for name in runs}
    losses = {name: [] for name in runs}
    compile_s = {}
    for step, (ids, labels) in enumerate(batches):
        for name, (model, optimizer) in runs.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            elapsed = time.perf_counter() - start
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(loss.full_tensor().item())
            if step == 0:
                compile_s[name] = elapsed
            if step >= settings["warmup"]:
                times[name].append(elapsed)
    return {
        "fwd_bwd_s": {name: statistics.median(t) for name, t in times.items()},
        "fwd_bwd_min_s": {name: min(t) for name, t in times.items()},
        "compile_s": compile_s,
        "max_loss_diff": max(
            abs(a - b) for name in runs if name != "eager" for a, b in zip(losses["eager"], losses[name])
        ),
        "steps": steps,
    }


def run_compiled(args, log: Callable) -> dict:
    settings = {"warmup": 2, "timed": 5 if args.quick else 20}
    log(f"compile: tiny Qwen3 on dp2 x tp2, {BATCH} x {SEQ} tokens, eager vs hs.compile (inductor) ...")
    return launch_section(log, _worker, WORLD, settings, args.timeout)


def compiled_lines(result) -> list:
    if not result:
        return []
    lines = ["", "## hypershard.compile vs eager hypershard (demo model, dp2 x tp2)", ""]
    if "error" in result:
        return lines + [f"failed: {result['error']}"]
    eager, compiled = result["fwd_bwd_s"]["eager"], result["fwd_bwd_s"]["compiled"]
    lines += [
        f"Tiny Qwen3, {BATCH} x {SEQ} tokens per step, strict mode, {result['steps']} steps each, interleaved; "
        "forward + backward (gradient sums included), median on rank 0. The compiled copy is "
        '`hs.compile(model, backend="inductor", fullgraph=True)`.',
        "",
        "| | fwd+bwd s (median) | min s | vs eager |",
        "|---|---:|---:|---:|",
        f"| eager hypershard | {eager:.4f} | {result['fwd_bwd_min_s']['eager']:.4f} | 1.00 |",
        f"| hs.compile (inductor) | {compiled:.4f} | {result['fwd_bwd_min_s']['compiled']:.4f} | {compiled / eager:.2f} |",
    ]
    if "reordered" in result["fwd_bwd_s"]:
        reordered = result["fwd_bwd_s"]["reordered"]
        lines.append(
            f"| hs.compile, waits moved (inductor's comm reordering) | {reordered:.4f} | "
            f"{result['fwd_bwd_min_s']['reordered']:.4f} | {reordered / eager:.2f} |"
        )
    if "fsdp_eager" in result["fwd_bwd_s"]:
        fsdp_eager, fsdp_compiled = result["fwd_bwd_s"]["fsdp_eager"], result["fwd_bwd_s"]["fsdp_compiled"]
        lines += [
            f"| fully_shard (layers + root over dp), eager | {fsdp_eager:.4f} | "
            f"{result['fwd_bwd_min_s']['fsdp_eager']:.4f} | {fsdp_eager / eager:.2f} |",
            f"| fully_shard, hs.compile (each layer's forward; gathers eager) | {fsdp_compiled:.4f} | "
            f"{result['fwd_bwd_min_s']['fsdp_compiled']:.4f} | {fsdp_compiled / eager:.2f} "
            f"({fsdp_compiled / fsdp_eager:.2f} of fully_shard eager) |",
        ]
    compile_s = result["compile_s"]
    firsts = ", ".join(f"{name} {compile_s[name]:.1f} s" for name in ("compiled", "fsdp_compiled") if name in compile_s)
    lines += [
        "",
        f"First call (trace + compile): {firsts}. "
        f"Largest loss difference over the steps: {result['max_loss_diff']:.2e}.",
    ]
    return lines + [""]
