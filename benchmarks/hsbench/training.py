"""Section "step" (and the "bytes" and "rule_cache" figures it yields): a tiny HF Qwen3 trains on
4 CPU ranks, one launch per mesh, hypershard vs torch DTensor vs one device interleaved step by
step; one more dp2 x tp2 launch at a size where compute dominates. The memory section is
measured at the end of the same launches (memory.py)."""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from typing import Callable

from hypershard.launch import spawn_local_ranks

from .collectives import CollectiveBytes
from .common import error_text, mesh_text, ratio, summary
from .memory import measure_memory, memory_summary
from .timing import time_all_reduce
from .trainers import HypershardPerParamTrainer, HypershardTrainer, SingleTrainer, TorchTPTrainer, lr_at

STEP_MESHES = {"dp2xtp2": ((2, 2), ("dp", "tp")), "tp4": ((4,), ("tp",))}
# A size where compute, not collective latency, dominates a step (one more dp2 x tp2 run, with
# hypershard and torch DTensor only): about 17 M parameters, global batch 8 x 128 tokens.
COMPUTE_CONFIG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=256,
)
COMPUTE_BATCH = (8, 128)
# The step's implementations; the two variants show what data-parallel gradient buckets change:
# hypershard with every gradient reduced in its own hook (bucket cap 0), and the torch baseline
# with its dp (and q/k-norm tp) gradient sums flattened into one all-reduce per group and dtype.
STEP_IMPLS = ("hypershard", "hypershard_per_param", "torch_dtensor", "torch_dtensor_bucketed")


def step_worker(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist

    import hypershard as hs
    from hypershard.testing.models import make_batches, tiny_config

    mesh_spec = (tuple(args["mesh"][0]), tuple(args["mesh"][1]))
    config = tiny_config("qwen3", **args["config"])
    total = args["warmup"] + args["timed"]
    cache_steps = max(args["cache_steps"], total)
    detailed = args["cache_steps"] > 0  # rule-cache steps and torch's bytes too (not the compute-size run)
    batches = make_batches(config.vocab_size, 4, batch=args["batch"], seq=args["seq"])
    out: dict = {"errors": {}}

    makers = {
        "hypershard": lambda: HypershardTrainer(config, mesh_spec),
        "hypershard_per_param": lambda: HypershardPerParamTrainer(config, mesh_spec),
        "torch_dtensor": lambda: TorchTPTrainer(config, mesh_spec),
        "torch_dtensor_bucketed": lambda: TorchTPTrainer(config, mesh_spec, bucketed=True),
    }
    impls = args["impls"]
    trainers: dict = {}
    for name in impls:
        try:
            trainers[name] = makers[name]()
        except Exception as exc:  # noqa: BLE001
            out["errors"][name] = error_text(exc)
    single = SingleTrainer(config) if rank == 0 else None

    times: dict = {k: [] for k in (*impls, "single_device")}
    losses: dict = {k: [] for k in times}
    traffic: list = []
    cache: list = []
    calls: list = []
    entries: list = []
    for step in range(total):
        ids, labels = batches[step % len(batches)]
        lr = lr_at(step, cache_steps)
        for name in impls[step % len(impls) :] + impls[: step % len(impls)]:  # rotate who goes first
            trainer = trainers.get(name)
            if trainer is None:
                continue
            if name == "hypershard":
                hs._C.reset_traffic()
                hs._C.reset_dispatch_stats()
                hs._C.reset_grad_sync_stats()
            dist.barrier()
            start = time.perf_counter()
            try:
                loss = trainer.step(ids, labels, lr)
            except Exception as exc:  # noqa: BLE001 (recorded; every rank raises alike)
                out["errors"][name] = error_text(exc)
                if rank == 0:
                    traceback.print_exc()
                trainers.pop(name)
                continue
            dist.barrier()
            elapsed = time.perf_counter() - start
            if name == "hypershard":
                traffic.append({**hs._C.traffic(), **hs._C.grad_sync_stats()})
                stats = hs._C.dispatch_stats()
                cache.append(stats)
                calls.append(stats["calls"])
                entries.append(stats["cache_entries"])
            if step >= args["warmup"]:
                times[name].append(elapsed)
            losses[name].append(loss)
        if single is not None:
            start = time.perf_counter()
            losses["single_device"].append(single.step(ids, labels, lr))
            elapsed = time.perf_counter() - start
            if step >= args["warmup"]:
                times["single_device"].append(elapsed)
        dist.barrier()

    # the rule cache over more hypershard steps (the learning rate keeps changing)
    h = trainers.get("hypershard")
    if h is not None and detailed:
        for step in range(total, cache_steps):
            ids, labels = batches[step % len(batches)]
            hs._C.reset_dispatch_stats()
            h.step(ids, labels, lr_at(step, cache_steps))
            stats = hs._C.dispatch_stats()
            cache.append(stats)
            entries.append(stats["cache_entries"])
        plans = dict(hs._C.cached_op_plans())
        out["cache"] = {
            "per_step": cache,
            "entries_per_step": entries,
            "cached_op_plans_after_last_step": plans,
        }
        hs._C.reset_op_counts()
        hs._C.reset_dispatch_stats()
        h.step(*batches[0], lr_at(cache_steps, cache_steps))
        out["cache"]["op_counts_extra_step"] = {n: c for n, c, _ in hs._C.op_counts()}
        out["cache"]["extra_step"] = hs._C.dispatch_stats()

    # torch DTensor bytes: one more step under the counting dispatch mode
    t = trainers.get("torch_dtensor")
    if t is not None and detailed:
        try:
            with CollectiveBytes() as counter:
                t.step(*batches[0], lr_at(0, cache_steps))
            out["torch_traffic"] = {
                "collectives": counter.collectives,
                "bytes_sent": counter.bytes_sent,
                "by_op": counter.by_op,
                "unaccounted": counter.unaccounted,
            }
        except Exception as exc:  # noqa: BLE001
            out["errors"]["torch_dtensor_bytes"] = error_text(exc)
    out.update(times=times, losses=losses, hypershard_traffic=traffic, hypershard_calls=calls)
    # reference: a bare gloo all_reduce of 16 KiB over the world (a row-parallel output here)
    out["gloo_all_reduce_16KiB_us"] = time_all_reduce(4096, 5, calls=20)
    out["config"] = {
        k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    }
    out["parameters"] = sum(p.numel() for p in single.params) if single is not None else None
    if args["memory"]:
        trainers.clear()
        del single, h, t
        out["memory"] = measure_memory(rank, mesh_spec, args["memory_steps"])
    return out


def run_steps(args: argparse.Namespace, log: Callable, with_memory: bool) -> tuple:
    """The step, bytes and rule-cache sections (and memory when asked) for every mesh: one launch
    of 4 ranks per mesh."""
    step_out, bytes_out, cache_out = {}, {}, {}
    memory_out: dict = {}
    runs = {
        key: (spec, {}, (4, 32), STEP_IMPLS, args.warmup, args.timed, args.cache_steps, with_memory)
        for key, spec in STEP_MESHES.items()
    }
    runs["dp2xtp2_compute"] = (
        STEP_MESHES["dp2xtp2"],
        COMPUTE_CONFIG,
        COMPUTE_BATCH,
        ("hypershard", "torch_dtensor"),
        1,
        max(2, args.timed // 3),
        0,
        False,
    )
    for key, (spec, config, (batch, seq), impls, warmup, timed, cache_steps, memory) in runs.items():
        log(f"step: Qwen3 {'compute-bound size' if config else 'tiny'} on {mesh_text(spec)} ...")
        start = time.perf_counter()
        try:
            ranks = spawn_local_ranks(
                step_worker,
                4,
                {
                    "mesh": spec,
                    "config": config,
                    "impls": impls,
                    "warmup": warmup,
                    "timed": timed,
                    "cache_steps": cache_steps,
                    "batch": batch,
                    "seq": seq,
                    "memory": memory,
                    "memory_steps": args.memory_steps,
                },
                timeout=args.timeout,
            )
        except Exception as exc:  # noqa: BLE001
            step_out[key] = {"error": error_text(exc)}
            log(f"  failed: {error_text(exc)}")
            continue
        r0 = ranks[0]
        entry: dict = {
            "mesh": mesh_text(spec),
            "errors": r0["errors"],
            "config": r0["config"],
            "parameters": r0["parameters"],
            "global_batch": [batch, seq],
        }
        med = {}
        for name in (*impls, "single_device"):
            samples = r0["times"][name]
            if samples:
                s = summary(samples)
                med[name] = s["median"]
                entry[f"{name}_s"] = s["median"]
                entry[f"{name}_minmax_s"] = [s["min"], s["max"]]
            else:
                entry[f"{name}_s"] = None
        entry["speedup_vs_torch_dtensor"] = ratio(med.get("torch_dtensor"), med.get("hypershard"))
        entry["speedup_vs_torch_dtensor_bucketed"] = ratio(med.get("torch_dtensor_bucketed"), med.get("hypershard"))
        entry["bucket_speedup"] = ratio(med.get("hypershard_per_param"), med.get("hypershard"))
        entry["hypershard_vs_single_device"] = ratio(med.get("hypershard"), med.get("single_device"))
        entry["torch_dtensor_vs_single_device"] = ratio(med.get("torch_dtensor"), med.get("single_device"))
        single = r0["losses"]["single_device"]
        for name in impls:
            got = r0["losses"][name]
            if got and single:
                entry[f"{name}_loss_max_rel_diff_vs_single"] = max(
                    abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, single)
                )
        entry["gloo_all_reduce_16KiB_us"] = r0["gloo_all_reduce_16KiB_us"]["median"]
        entry["losses"] = r0["losses"]
        entry["timed_steps"] = len(r0["times"]["hypershard"])
        entry["seconds"] = time.perf_counter() - start
        traffic0 = r0["hypershard_traffic"]
        if traffic0:
            entry["hypershard_collectives"] = traffic0[-1]["collectives"]
            entry["hypershard_grad_buckets"] = traffic0[-1]["buckets"]
            entry["hypershard_grads_bucketed"] = traffic0[-1]["bucketed"]
        step_out[key] = entry
        if not cache_steps:  # the compute-size run measures time only
            log(f"  done in {entry['seconds']:.0f} s")
            continue

        # bytes per rank per step (the last timed step for hypershard; all steps agree)
        b: dict = {"per_rank": []}
        for r in ranks:
            traffic = r["hypershard_traffic"]
            row = {
                "hypershard": traffic[-1]["bytes_sent"] if traffic else None,
                "hypershard_collectives": traffic[-1]["collectives"] if traffic else None,
                "hypershard_constant_over_steps": len({t["bytes_sent"] for t in traffic[1:]}) <= 1,
                "torch_dtensor": r.get("torch_traffic", {}).get("bytes_sent"),
                "torch_dtensor_collectives": r.get("torch_traffic", {}).get("collectives"),
            }
            b["per_rank"].append(row)
        for k in ("hypershard", "torch_dtensor", "hypershard_collectives", "torch_dtensor_collectives"):
            b[k] = b["per_rank"][0][k]
            vals = [row[k] for row in b["per_rank"] if row[k] is not None]
            b[k + "_max_over_ranks"] = max(vals) if vals else None
        b["torch_dtensor_to_hypershard"] = ratio(b["torch_dtensor"], b["hypershard"])
        b["torch_dtensor_by_op_rank0"] = r0.get("torch_traffic", {}).get("by_op")
        bytes_out[key] = b

        if "cache" in r0:
            c = r0["cache"]
            per_step = c["per_step"]
            warm_rates = [ratio(s["cache_hits"], s["calls"]) for s in per_step[1:]]
            cache_out[key] = {
                "calls_per_step": per_step[-1]["calls"],
                "hit_rate_first_step": ratio(per_step[0]["cache_hits"], per_step[0]["calls"]),
                "hit_rate_warm_step": statistics.median(warm_rates) if warm_rates else None,
                "hit_rate_warm_min": min(warm_rates) if warm_rates else None,
                "misses_warm_steps": [s["calls"] - s["cache_hits"] for s in per_step[1:]],
                "entries_after_1_step": c["entries_per_step"][0],
                "entries_after_steps": c["entries_per_step"][-1],
                "steps": len(c["entries_per_step"]),
                "entries_per_step": c["entries_per_step"],
                "interned_layouts_after_1_step": per_step[0]["interned_layouts"],
                "interned_layouts_after_steps": per_step[-1]["interned_layouts"],
                "redistribute_plans_after_1_step": per_step[0]["cached_plans"],
                "redistribute_plans_after_steps": per_step[-1]["cached_plans"],
                "ops_with_plans": len(c["cached_op_plans_after_last_step"]),
                "largest_plan_counts": sorted(c["cached_op_plans_after_last_step"].items(), key=lambda kv: -kv[1])[:8],
                "aten_ops_per_step": c["op_counts_extra_step"],
            }
            # bounded: no new plans over the second half of the steps (the learning rate kept changing)
            half = c["entries_per_step"][len(c["entries_per_step"]) // 2]
            cache_out[key]["bounded"] = cache_out[key]["entries_after_steps"] == half
        if with_memory:
            memory_out[key] = memory_summary(ranks, spec)
        log(f"  done in {entry['seconds']:.0f} s")
    return step_out, bytes_out, cache_out, memory_out
