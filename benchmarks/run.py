"""make bench: hypershard's benchmark suite. Every figure is a ratio measured side by side in ONE
run (the machine is shared and noisy): the competing implementations run interleaved in the same
processes, each timing is the median of repeated samples, and min/max are kept.

Sections (see benchmarks/README.md for what each measures and how):

  dispatch    per-op overhead on tiny tensors, per op class: plain eager vs hypershard (and
              hypershard with its fast path off) vs torch.distributed.tensor DTensor; 1-, 2- and
              4-rank meshes, Replicate and Shard
  step        training step of a tiny HF Qwen3 on 4 CPU ranks (dp2 x tp2, tp4): hypershard
              parallelize() vs torch DTensor tensor parallelism vs one device, each also with the
              other way of summing data-parallel gradients (per parameter / bucketed); a dp2 x tp2
              run at a size where compute dominates (17 M parameters); the bytes each rank sends
              per step and hypershard's rule-cache statistics over 20 steps
  memory      peak RSS growth and parameter + gradient + optimizer-state bytes per rank of a
              larger Qwen3 config: hypershard vs torch DTensor vs one device (measured at the end
              of the step launches)

Writes bench/results.json, bench/RESULTS.md and bench/results.png and prints the tables.

    .venv/bin/python benchmarks/run.py [--quick] [--sections dispatch,step,memory] [--out bench]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("dispatch", "step", "memory")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from hypershard.launch import spawn_local_ranks  # noqa: E402
STEP_MESHES = {"dp2xtp2": ((2, 2), ("dp", "tp")), "tp4": ((4,), ("tp",))}
# A size where compute, not collective latency, dominates a step (one more dp2 x tp2 run, with
# hypershard and torch DTensor only): about 17 M parameters, global batch 8 x 128 tokens.
COMPUTE_CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=256)
COMPUTE_BATCH = (8, 128)
# The step's implementations; the two variants show what data-parallel gradient buckets change:
# hypershard with every gradient reduced in its own hook (bucket cap 0), and the torch baseline
# with its dp (and q/k-norm tp) gradient sums flattened into one all-reduce per group and dtype.
STEP_IMPLS = ("hypershard", "hypershard_per_param", "torch_dtensor", "torch_dtensor_bucketed")
MEMORY_CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=8, head_dim=32)


# ============================================================================= small helpers

def summary(samples: list) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 800 else text[:150] + " ... " + text[-650:]  # a traceback ends with the cause


def vm_kib(field: str) -> int:
    """A /proc/self/status value in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ============================================================================= 1. dispatch

# Each op class: (arguments, op). An argument is ("tensor", shape, placement under the Shard
# variant) or ("list", count, shape, placement) or ("target", shape, classes, placement).
# The Replicate variant makes every argument Replicate. Global tensors are tiny (8 rows, so a
# 4-rank Shard(0) keeps 2 rows per rank) so the framework, not the arithmetic, is measured.
def _op_classes():
    import torch
    import torch.nn.functional as F

    def foreach_add_(xs, ys):
        torch._foreach_add_(xs, ys)
        return xs

    return {
        "pointwise": ([("tensor", (8, 8), 0), ("tensor", (8, 8), 0)], lambda a, b: torch.add(a, b)),
        "inplace": ([("tensor", (8, 8), 0), ("tensor", (8, 8), 0)], lambda a, b: a.add_(b)),
        "view": ([("tensor", (8, 8), 0)], lambda a: a.view(-1)),
        "transpose": ([("tensor", (8, 8), 0)], lambda a: a.transpose(0, 1)),
        "matmul": ([("tensor", (8, 8), 0), ("tensor", (8, 8), None)], lambda a, b: torch.mm(a, b)),
        "linear": ([("tensor", (8, 8), None), ("tensor", (16, 8), 0)], lambda x, w: F.linear(x, w)),
        "reduction": ([("tensor", (8, 8), 0)], lambda a: a.sum(dim=1)),
        "foreach": ([("list", 8, (8, 8), 0), ("list", 8, (8, 8), 0)], foreach_add_),
        "cross_entropy": ([("tensor", (8, 16), 0), ("target", (8,), 16, 0)], lambda x, t: F.cross_entropy(x, t)),
        "cross_entropy_sum": ([("tensor", (8, 16), 0), ("target", (8,), 16, 0)],
                              lambda x, t: F.cross_entropy(x, t, reduction="sum")),
    }


OP_NOTES = {
    "pointwise": "torch.add(a, b), [8, 8]; Shard: both Shard(0)",
    "inplace": "a.add_(b), [8, 8]; Shard: both Shard(0)",
    "view": "a.view(-1), [8, 8]; Shard: Shard(0)",
    "transpose": "a.transpose(0, 1), [8, 8]; Shard: Shard(0) -> Shard(1)",
    "matmul": "torch.mm(a, b), [8, 8] @ [8, 8]; Shard: a Shard(0), b Replicate",
    "linear": "F.linear(x, w), x [8, 8], w [16, 8]; Shard: w Shard(0) (colwise), x Replicate",
    "reduction": "a.sum(dim=1), [8, 8]; Shard: Shard(0)",
    "foreach": "torch._foreach_add_(xs, ys), 8 + 8 tensors [8, 8]; Shard: all Shard(0)",
    "cross_entropy": "F.cross_entropy(logits [8, 16], target [8] with ignored -100 entries), mean; "
                     "Shard: both Shard(0) (batch)",
    "cross_entropy_sum": "the same with reduction='sum'",
}


IMPL_NAMES = {"plain": "plain", "hypershard": "hypershard", "hypershard_boxed": "hypershard (fast path off)",
              "torch_dtensor": "torch DTensor"}


def _geomean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _global_args(spec: list, seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for item in spec:
        if item[0] == "tensor":
            out.append(torch.randn(*item[1], generator=g))
        elif item[0] == "list":
            out.append([torch.randn(*item[2], generator=g) for _ in range(item[1])])
        else:  # class targets, about a quarter of them ignored (-100), as in HF labels
            target = torch.randint(0, item[2], item[1], generator=g)
            target[torch.rand(item[1], generator=g) < 0.25] = -100
            out.append(target)
    return out


def _placed_args(spec: list, values: list, shard: bool, make: Callable) -> list:
    """make(tensor, dim or None) -> the implementation's tensor for one argument."""
    out = []
    for item, value in zip(spec, values):
        dim = item[-1] if shard else None
        if item[0] == "list":
            out.append([make(v, dim) for v in value])
        else:
            out.append(make(value, dim))
    return out


def _calibrate(fn: Callable, target_s: float, slowest: Callable) -> int:
    """Calls per sample so that one sample lasts about target_s. Every rank makes the same calls
    (an op may run collectives): slowest(elapsed) is the maximum over the ranks."""
    for _ in range(20):
        fn()
    n = 8
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = slowest(time.perf_counter() - start)
        if elapsed >= 0.004 or n >= 1 << 20:
            return max(10, int(target_s / (elapsed / n)))
        n *= 4


def _time_all_reduce(numel: int, repeats: int, calls: int = 50) -> dict:
    """Median µs of one torch.distributed.all_reduce of `numel` floats over the world (gloo)."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(numel)
    for _ in range(5):
        dist.all_reduce(t)
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return summary(samples)


def _dispatch_worker(rank: int, world: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import DTensor as TorchDTensor, Replicate as TReplicate, Shard as TShard
    from torch.distributed.tensor import distribute_tensor as tdistribute

    import hypershard as hs

    mesh = hs.init_device_mesh("cpu", (world,), ("x",))
    tmesh = torch_mesh("cpu", (world,), mesh_dim_names=("x",))
    mesh_group = tmesh.get_group()
    classes = _op_classes()
    # hypershard_boxed: hypershard with its typed fast path off (every op through the boxed
    # fallback), to show what the fast path saves
    impls = ("plain", "hypershard", "hypershard_boxed", "torch_dtensor")

    def maker(impl: str):
        def make(t, dim):
            t = t.clone()  # distribute_tensor may alias its input; in-place ops must not reach `values`
            if impl == "plain":
                return t if dim is None else t.chunk(world, dim)[rank].clone()
            if impl in ("hypershard", "hypershard_boxed"):
                return hs.distribute_tensor(t, mesh, [hs.Replicate() if dim is None else hs.Shard(dim)])
            return tdistribute(t, tmesh, [TReplicate() if dim is None else TShard(dim)])
        return make

    @contextlib.contextmanager
    def path_of(impl: str):
        """hypershard_boxed runs with the typed fast path off; everything else with it on."""
        hs._C.set_fast_path(impl != "hypershard_boxed")
        try:
            yield
        finally:
            hs._C.set_fast_path(True)

    def full(x):
        if isinstance(x, list):
            return [full(v) for v in x]
        if isinstance(x, (hs.DTensor, TorchDTensor)):  # (hypershard gives every Tensor a raising full_tensor)
            return x.full_tensor()
        return x

    def same(a, b) -> bool:
        if isinstance(a, list):
            return all(same(x, y) for x, y in zip(a, b))
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    results: dict = {}
    hs._C.reset_dispatch_stats()
    for variant in ("replicate", "shard"):
        out: dict = {}
        for index, (name, (spec, op)) in enumerate(classes.items()):
            values = _global_args(spec, seed=index)
            entry: dict = {}
            case_start = time.perf_counter()
            # correctness on fresh inputs: the global result of each implementation vs plain
            # eager on one device; the same call counts the collectives the op runs
            expected = op(*_placed_args(spec, values, False, lambda t, d: t.clone()))
            check, collectives = {}, {"plain": 0}
            for impl in impls[1:]:
                try:
                    a = _placed_args(spec, values, variant == "shard", maker(impl))
                    hs._C.reset_traffic()
                    with path_of(impl), _CollectiveBytes() as counter:
                        result = op(*a)
                    collectives[impl] = (hs._C.traffic()["collectives"] if impl.startswith("hypershard")
                                         else counter.collectives)
                    check[impl] = bool(same(full(result), expected))
                except Exception as exc:  # noqa: BLE001 (recorded; the op is not timed for this impl)
                    check[impl] = error_text(exc)
            entry["matches_one_device"] = check
            fns = {}
            for impl in impls:
                if impl != "plain" and isinstance(check[impl], str):
                    continue  # it raised: nothing to time
                a = _placed_args(spec, values, variant == "shard", maker(impl))
                fns[impl] = (lambda a=a: op(*a))
            agreed = torch.tensor([collectives.get(i, 0) for i in impls], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            collectives = {i: int(n) for i, n in zip(impls, agreed.tolist()) if i in fns}
            # What hypershard's collectives alone cost: the same number of bare gloo all-reduces of
            # 2 floats (the size a loss's (sum, count) takes), timed in the same rotation.
            if collectives.get("hypershard"):
                floor_buf = torch.zeros(2)
                fns["collectives_alone"] = (lambda n=collectives["hypershard"]: [dist.all_reduce(floor_buf, group=mesh_group)
                                                                             for _ in range(n)])
                collectives["collectives_alone"] = collectives["hypershard"]
            # An op without collectives is timed on rank 0 alone while the other ranks wait in a
            # barrier (ranks sharing few cores would otherwise preempt each other mid-sample); an
            # op with collectives runs on every rank, the same number of calls everywhere.
            solo = {impl: collectives[impl] == 0 for impl in fns}

            def slowest(elapsed: float) -> float:
                t = torch.tensor([elapsed], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                return float(t)

            counts = {}
            for impl, fn in fns.items():
                with path_of(impl):
                    if not solo[impl]:
                        counts[impl] = _calibrate(fn, args["sample_s"], slowest)
                    elif rank == 0:
                        counts[impl] = _calibrate(fn, args["sample_s"], lambda e: e)
            gc.collect()
            samples: dict = {impl: [] for impl in fns}
            order = list(fns)
            for rep in range(args["repeats"]):
                for impl in order[rep % len(order):] + order[:rep % len(order)]:  # rotate the order
                    gc.collect(0)
                    dist.barrier()
                    if solo[impl] and rank != 0:
                        continue
                    fn, n = fns[impl], counts[impl]
                    with path_of(impl):
                        gc.disable()
                        start = time.perf_counter()
                        for _ in range(n):
                            fn()
                        elapsed = time.perf_counter() - start
                        gc.enable()
                    samples[impl].append(elapsed / n * 1e6)
            if rank != 0:
                continue  # rank 0 reports
            stats = {impl: summary(s) for impl, s in samples.items()}
            plain = stats["plain"]["median"]
            ours = stats.get("hypershard", {}).get("median")
            theirs = stats.get("torch_dtensor", {}).get("median")
            boxed = stats.get("hypershard_boxed", {}).get("median")
            floor = stats.get("collectives_alone", {}).get("median")
            entry.update({
                "plain_us": plain, "hypershard_us": ours, "torch_dtensor_us": theirs,
                "hypershard_boxed_us": boxed, "fast_path_speedup": ratio(boxed, ours),
                "ratio_vs_plain": ratio(ours, plain),
                # against plain eager plus the bare collectives the op needs (None: it needs none)
                "collectives_alone_us": floor,
                "ratio_vs_plain_plus_collectives": None if floor is None else ratio(ours, plain + floor),
                "speedup_vs_torch_dtensor": ratio(theirs, ours),
                "overhead_ratio_vs_torch_dtensor": (ratio(theirs - plain, ours - plain)
                                                     if ours is not None and theirs is not None else None),
                # the same from each implementation's fastest sample (least disturbed by other load)
                "ratio_vs_plain_best": ratio(stats.get("hypershard", {}).get("min"), stats["plain"]["min"]),
                "speedup_vs_torch_dtensor_best": ratio(stats.get("torch_dtensor", {}).get("min"),
                                                       stats.get("hypershard", {}).get("min")),
                "hypershard_overhead_us": None if ours is None else ours - plain,
                "torch_dtensor_overhead_us": None if theirs is None else theirs - plain,
                "samples_us": {impl: {"min": s["min"], "max": s["max"], "n": s["n"]} for impl, s in stats.items()},
                "calls_per_sample": counts,
                "collectives_per_call": collectives,
                "timed_on": {impl: "rank 0 alone" if solo[impl] else "every rank" for impl in fns},
                "seconds": time.perf_counter() - case_start,
                "op": OP_NOTES[name],
            })
            out[name] = entry
        results[variant] = out
    # reference: one bare gloo all_reduce of 2 floats over the mesh (what a collective costs here)
    results["gloo_all_reduce_us"] = _time_all_reduce(2, args["repeats"])
    stats = hs._C.dispatch_stats()
    results["hypershard_dispatch_stats"] = stats
    results["hypershard_hit_rate"] = ratio(stats["cache_hits"], stats["calls"])
    return results


def run_dispatch(args: argparse.Namespace, log: Callable) -> dict:
    variants: dict = {}
    extra: dict = {}
    for world in (1, 2, 4):
        log(f"dispatch: {world}-rank mesh ...")
        start = time.perf_counter()
        try:
            ranks = spawn_local_ranks(_dispatch_worker, world, {"sample_s": args.sample_s, "repeats": args.repeats},
                                      timeout=args.timeout)
        except Exception as exc:  # noqa: BLE001
            extra[f"{world}rank_error"] = error_text(exc)
            log(f"  failed: {error_text(exc)}")
            continue
        r0 = ranks[0]
        variants[f"{world}rank_replicate"] = r0["replicate"]
        variants[f"{world}rank_shard"] = r0["shard"]
        extra[f"{world}rank_hypershard_dispatch_stats"] = r0["hypershard_dispatch_stats"]
        extra[f"{world}rank_hypershard_hit_rate"] = r0["hypershard_hit_rate"]
        extra[f"{world}rank_gloo_all_reduce_us"] = r0["gloo_all_reduce_us"]
        extra[f"{world}rank_seconds"] = time.perf_counter() - start
    out: dict = dict(variants.get("1rank_replicate", {}))
    out["variants"] = variants
    out["info"] = extra
    out["summary"] = {v: {"geomean_ratio_vs_plain": _geomean([r["ratio_vs_plain"] for r in ops.values()]),
                          "geomean_speedup_vs_torch_dtensor": _geomean([r["speedup_vs_torch_dtensor"]
                                                                        for r in ops.values()]),
                          "geomean_overhead_ratio": _geomean([r["overhead_ratio_vs_torch_dtensor"]
                                                              for r in ops.values()]),
                          "geomean_ratio_vs_plain_best": _geomean([r["ratio_vs_plain_best"] for r in ops.values()]),
                          "geomean_speedup_vs_torch_dtensor_best": _geomean([r["speedup_vs_torch_dtensor_best"]
                                                                             for r in ops.values()])}
                      for v, ops in variants.items()}
    return out


# ============================================================================= 2. steps, bytes, cache

def _lr(step: int, total: int, base: float = 1e-3) -> float:
    """A learning rate that changes every step (a plan key must not depend on it)."""
    return base * (1.0 - 0.5 * step / max(total, 1))


class _CollectiveBytes:
    """Counts collectives and the bytes this rank sends, at torch's dispatcher, for the torch
    DTensor baseline: functional collectives (what DTensor redistributions issue) and c10d ops
    (dist.all_reduce etc.). Bytes follow hypershard's cost model (docs/layout.md): all_reduce =
    reduce_scatter + all_gather of torch.chunk pieces, all_gather sends (k-1) x input,
    reduce_scatter / all_to_all send all but the kept piece."""

    def __init__(self):
        self.collectives = 0
        self.bytes_sent = 0
        self.by_op: dict = {}
        self.unaccounted = 0  # collectives whose bytes could not be read from their arguments
        self.mode = None

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        funcol = torch.ops._c10d_functional
        c10d = torch.ops.c10d

        def group_of(name_or_pg):
            from torch.distributed.distributed_c10d import ProcessGroup, _resolve_process_group

            if isinstance(name_or_pg, str):  # functional collectives name their group
                return _resolve_process_group(name_or_pg)
            if isinstance(name_or_pg, torch.ScriptObject):  # c10d ops pass it boxed
                return ProcessGroup.unbox(name_or_pg)
            return name_or_pg

        def chunk_len(n: int, k: int, i: int) -> int:
            size = -(-n // k) if n else 0
            return max(0, min(size, n - size * i)) if size else 0

        def sent_all_reduce(n, pg):
            k, i = pg.size(), pg.rank()
            own = chunk_len(n, k, i)
            return (n - own) + (k - 1) * own

        def account(func, args):
            packet = func.overloadpacket
            t = args[0]
            if packet is funcol.all_reduce or packet is funcol.all_reduce_:
                pg = group_of(args[2])
                return sent_all_reduce(t.numel(), pg) * t.element_size()
            if packet is funcol.all_reduce_coalesced or packet is funcol.all_reduce_coalesced_:
                pg = group_of(args[2])
                return sum(sent_all_reduce(x.numel(), pg) * x.element_size() for x in t)
            if packet is funcol.all_gather_into_tensor or packet is funcol.all_gather_into_tensor_out:
                return (int(args[1]) - 1) * t.numel() * t.element_size()
            if packet is funcol.reduce_scatter_tensor:
                k = int(args[2])
                return (t.numel() - t.numel() // k) * t.element_size()
            if packet is funcol.all_to_all_single:
                pg = group_of(args[3])
                splits = args[2]
                n = t.numel()
                keep = n // pg.size() if not splits else n // t.size(0) * splits[pg.rank()]
                return (n - keep) * t.element_size()
            if packet is funcol.broadcast or packet is funcol.broadcast_:
                pg = group_of(args[2])
                return (pg.size() - 1) * t.numel() * t.element_size() if int(args[1]) == pg.rank() else 0
            if packet is c10d.allreduce_:
                pg = group_of(args[1])
                return sum(sent_all_reduce(x.numel(), pg) * x.element_size() for x in t)
            if packet is c10d._allgather_base_:
                pg = group_of(args[2])
                x = args[1]
                return (pg.size() - 1) * x.numel() * x.element_size()
            if packet is c10d.allgather_:
                inputs = args[1]
                pg = group_of(args[2])
                return sum((pg.size() - 1) * x.numel() * x.element_size() for x in inputs)
            if packet is c10d._reduce_scatter_base_:
                out_t, in_t, pg = args[0], args[1], args[2]
                return (in_t.numel() - out_t.numel()) * in_t.element_size()
            if packet is c10d.alltoall_base_:
                out_t, in_t, pg = args[0], args[1], group_of(args[2])
                return (in_t.numel() - in_t.numel() // pg.size()) * in_t.element_size()
            if packet is c10d.broadcast_:
                pg = group_of(args[1])
                root = int(args[3])
                return (pg.size() - 1) * sum(x.numel() * x.element_size() for x in t) if root == pg.rank() else 0
            return None

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                sent = None
                try:
                    sent = account(func, args)
                except Exception:  # noqa: BLE001 (an unexpected signature: counted, bytes unknown)
                    if "c10d" in str(func.namespace):
                        sent = 0
                        counter.unaccounted += 1
                if sent is not None:
                    name = str(func.overloadpacket).split(".")[-1]
                    counter.collectives += 1
                    counter.bytes_sent += int(sent)
                    slot = counter.by_op.setdefault(name, [0, 0])
                    slot[0] += 1
                    slot[1] += int(sent)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        return False


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor as TorchDTensor

    import hypershard as hs

    if t is None:
        return 0
    if isinstance(t, hs.DTensor):
        t = hs._C.local_of(t)
    elif isinstance(t, TorchDTensor):
        t = t._local_tensor
    return t.numel() * t.element_size()


def _state_bytes(params: list, optimizers: list) -> dict:
    import torch

    p = sum(_local_bytes(x.detach()) for x in params)
    g = sum(_local_bytes(x.grad) for x in params)
    o = 0
    for opt in optimizers:
        for state in opt.state.values():
            o += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params_mb": p / 2**20, "grads_mb": g / 2**20, "optimizer_mb": o / 2**20, "total_mb": (p + g + o) / 2**20}


class _HypershardTrainer:
    def __init__(self, config, mesh_spec):
        import torch

        import hypershard as hs
        from hypershard.models import tiny_model
        from hypershard.parallel import parallelize

        self.mesh = hs.init_device_mesh("cpu", *mesh_spec)
        self.model = parallelize(tiny_model(config), self.mesh)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=0.01)
        self.optimizers = [self.optimizer]

    def step(self, ids, labels, lr: float) -> float:
        import torch

        loss = self.model(input_ids=ids, labels=labels).loss
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return float(loss.detach().item())


class _HypershardPerParamTrainer(_HypershardTrainer):
    """hypershard with each data-parallel gradient reduced in its own hook (bucket cap 0)."""

    def step(self, ids, labels, lr: float) -> float:
        import hypershard as hs

        saved = hs._C.grad_bucket_bytes()
        hs._C.set_grad_bucket_bytes(0)
        try:
            return super().step(ids, labels, lr)
        finally:
            hs._C.set_grad_bucket_bytes(saved)


class _SingleTrainer:
    def __init__(self, config):
        import torch

        from hypershard.models import tiny_model

        self.model = tiny_model(config)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=0.01)
        self.optimizers = [self.optimizer]

    step = _HypershardTrainer.step


class _TorchTPTrainer:
    """The same training step with torch.distributed.tensor: parallelize_module with the
    equivalent of the model's HF plan on the tp sub-mesh (q/k/v/gate/up ColwiseParallel, o/down
    RowwiseParallel, lm_head ColwiseParallel gathering its output; embedding and norms plain and
    replicated), q_norm/k_norm gradients summed over tp (HF's replicated_with_grad_allreduce), the
    batch split over dp with every gradient summed over dp (the loss is divided by the GLOBAL
    number of label tokens, so the result equals one device), clip by the global norm, AdamW.
    Gradient sums run one all-reduce per parameter, or with `bucketed` one per dtype over the
    flattened gradients (what DDP's buckets do)."""

    def __init__(self, config, mesh_spec, bucketed: bool = False):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from hypershard.models import tiny_model

        shape, names = mesh_spec
        self.mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        self.bucketed = bucketed
        tp_mesh = self.mesh["tp"]
        self.tp_group = tp_mesh.get_group()
        self.dp = shape[names.index("dp")] if "dp" in names else 1
        self.dp_group = self.mesh["dp"].get_group() if self.dp > 1 else None
        self.dp_rank = dist.get_rank(self.dp_group) if self.dp > 1 else 0
        model = tiny_model(config)
        plan: dict = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}."
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[prefix + name] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[prefix + name] = RowwiseParallel()
        self.model = parallelize_module(model, tp_mesh, plan)
        self.params = list(self.model.parameters())
        self.dtensor_params = [p for p in self.params if isinstance(p, DTensor)]
        self.plain_params = [p for p in self.params if not isinstance(p, DTensor)]
        self.tp_reduced = [p for n, p in self.model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
        # torch's foreach kernels refuse lists mixing DTensors and plain tensors: one AdamW each
        self.optimizers = [torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)
                           for ps in (self.dtensor_params, self.plain_params) if ps]

    def step(self, ids, labels, lr: float) -> float:
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor as TorchDTensor

        local_ids = ids.chunk(self.dp)[self.dp_rank]
        local_labels = labels.chunk(self.dp)[self.dp_rank]
        items = int((labels[:, 1:] != -100).sum())  # HF shifts labels by one
        loss = self.model(input_ids=local_ids, labels=local_labels, num_items_in_batch=items).loss
        for opt in self.optimizers:
            opt.zero_grad()
        loss.backward()
        self._sum_grads([p.grad for p in self.tp_reduced], self.tp_group)
        if self.dp > 1:
            self._sum_grads([p.grad._local_tensor if isinstance(p.grad, TorchDTensor) else p.grad
                             for p in self.params], self.dp_group)
        # clip_grad_norm_(max_norm=1.0) over both lists with one global norm
        norms = []
        for grads in ([p.grad for p in self.dtensor_params], [p.grad for p in self.plain_params]):
            if grads:
                n = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
                norms.append(n.full_tensor() if isinstance(n, TorchDTensor) else n)
        total = torch.linalg.vector_norm(torch.stack(norms))
        coef = float(torch.clamp(1.0 / (total + 1e-6), max=1.0))
        for grads in ([p.grad for p in self.dtensor_params], [p.grad for p in self.plain_params]):
            if grads:
                torch._foreach_mul_(grads, coef)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        value = loss.detach().clone()
        if self.dp > 1:
            dist.all_reduce(value, group=self.dp_group)
        return float(value.item())

    def _sum_grads(self, grads: list, group) -> None:
        import torch
        import torch.distributed as dist

        if not self.bucketed:
            for g in grads:
                dist.all_reduce(g, group=group)
            return
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in same:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _step_worker(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist

    import hypershard as hs
    from hypershard.models import make_batches, tiny_config

    mesh_spec = (tuple(args["mesh"][0]), tuple(args["mesh"][1]))
    config = tiny_config("qwen3", **args["config"])
    total = args["warmup"] + args["timed"]
    cache_steps = max(args["cache_steps"], total)
    detailed = args["cache_steps"] > 0  # rule-cache steps and torch's bytes too (not the compute-size run)
    batches = make_batches(config.vocab_size, 4, batch=args["batch"], seq=args["seq"])
    out: dict = {"errors": {}}

    makers = {"hypershard": lambda: _HypershardTrainer(config, mesh_spec),
              "hypershard_per_param": lambda: _HypershardPerParamTrainer(config, mesh_spec),
              "torch_dtensor": lambda: _TorchTPTrainer(config, mesh_spec),
              "torch_dtensor_bucketed": lambda: _TorchTPTrainer(config, mesh_spec, bucketed=True)}
    impls = args["impls"]
    trainers: dict = {}
    for name in impls:
        try:
            trainers[name] = makers[name]()
        except Exception as exc:  # noqa: BLE001
            out["errors"][name] = error_text(exc)
    single = _SingleTrainer(config) if rank == 0 else None

    times: dict = {k: [] for k in (*impls, "single_device")}
    losses: dict = {k: [] for k in times}
    traffic: list = []
    cache: list = []
    calls: list = []
    entries: list = []
    for step in range(total):
        ids, labels = batches[step % len(batches)]
        lr = _lr(step, cache_steps)
        for name in impls[step % len(impls):] + impls[:step % len(impls)]:  # rotate who goes first
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
            h.step(ids, labels, _lr(step, cache_steps))
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
        h.step(*batches[0], _lr(cache_steps, cache_steps))
        out["cache"]["op_counts_extra_step"] = {n: c for n, c, _ in hs._C.op_counts()}
        out["cache"]["extra_step"] = hs._C.dispatch_stats()

    # torch DTensor bytes: one more step under the counting dispatch mode
    t = trainers.get("torch_dtensor")
    if t is not None and detailed:
        try:
            with _CollectiveBytes() as counter:
                t.step(*batches[0], _lr(0, cache_steps))
            out["torch_traffic"] = {"collectives": counter.collectives, "bytes_sent": counter.bytes_sent,
                                    "by_op": counter.by_op, "unaccounted": counter.unaccounted}
        except Exception as exc:  # noqa: BLE001
            out["errors"]["torch_dtensor_bytes"] = error_text(exc)
    out.update(times=times, losses=losses, hypershard_traffic=traffic, hypershard_calls=calls)
    # reference: a bare gloo all_reduce of 16 KiB over the world (a row-parallel output here)
    out["gloo_all_reduce_16KiB_us"] = _time_all_reduce(4096, 5, calls=20)
    out["config"] = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                     "num_hidden_layers")}
    out["parameters"] = sum(p.numel() for p in single.params) if single is not None else None
    if args["memory"]:
        trainers.clear()
        del single, h, t
        out["memory"] = _measure_memory(rank, mesh_spec, args["memory_steps"])
    return out


def _mesh_text(spec) -> str:
    return " x ".join(f"{n}={s}" for s, n in zip(*spec))


def run_steps(args: argparse.Namespace, log: Callable, with_memory: bool) -> tuple:
    """The step, bytes and rule-cache sections (and memory when asked) for every mesh: one launch
    of 4 ranks per mesh."""
    step_out, bytes_out, cache_out = {}, {}, {}
    memory_out: dict = {}
    runs = {key: (spec, {}, (4, 32), STEP_IMPLS, args.warmup, args.timed, args.cache_steps, with_memory)
            for key, spec in STEP_MESHES.items()}
    runs["dp2xtp2_compute"] = (STEP_MESHES["dp2xtp2"], COMPUTE_CONFIG, COMPUTE_BATCH, ("hypershard", "torch_dtensor"),
                               1, max(2, args.timed // 3), 0, False)
    for key, (spec, config, (batch, seq), impls, warmup, timed, cache_steps, memory) in runs.items():
        log(f"step: Qwen3 {'compute-bound size' if config else 'tiny'} on {_mesh_text(spec)} ...")
        start = time.perf_counter()
        try:
            ranks = spawn_local_ranks(_step_worker, 4, {"mesh": spec, "config": config, "impls": impls,
                                                        "warmup": warmup, "timed": timed, "cache_steps": cache_steps,
                                                        "batch": batch, "seq": seq, "memory": memory,
                                                        "memory_steps": args.memory_steps},
                                      timeout=args.timeout)
        except Exception as exc:  # noqa: BLE001
            step_out[key] = {"error": error_text(exc)}
            log(f"  failed: {error_text(exc)}")
            continue
        r0 = ranks[0]
        entry: dict = {"mesh": _mesh_text(spec), "errors": r0["errors"], "config": r0["config"],
                       "parameters": r0["parameters"], "global_batch": [batch, seq]}
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
                entry[f"{name}_loss_max_rel_diff_vs_single"] = max(abs(a - b) / max(abs(b), 1e-12)
                                                                   for a, b in zip(got, single))
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
            row = {"hypershard": traffic[-1]["bytes_sent"] if traffic else None,
                   "hypershard_collectives": traffic[-1]["collectives"] if traffic else None,
                   "hypershard_constant_over_steps": len({t["bytes_sent"] for t in traffic[1:]}) <= 1,
                   "torch_dtensor": r.get("torch_traffic", {}).get("bytes_sent"),
                   "torch_dtensor_collectives": r.get("torch_traffic", {}).get("collectives")}
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
                "largest_plan_counts": sorted(c["cached_op_plans_after_last_step"].items(),
                                              key=lambda kv: -kv[1])[:8],
                "aten_ops_per_step": c["op_counts_extra_step"],
            }
            # bounded: no new plans over the second half of the steps (the learning rate kept changing)
            half = c["entries_per_step"][len(c["entries_per_step"]) // 2]
            cache_out[key]["bounded"] = cache_out[key]["entries_after_steps"] == half
        if with_memory:
            memory_out[key] = memory_summary(ranks, spec)
        log(f"  done in {entry['seconds']:.0f} s")
    return step_out, bytes_out, cache_out, memory_out


# ============================================================================= 4. memory

def _set_mmap_threshold(size: int) -> None:
    """A fixed glibc mmap threshold: big blocks are mmapped and go back to the OS when freed, so
    RSS follows what is live (the default threshold adapts upward after frees)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, size)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _measure_memory(rank: int, mesh_spec, steps: int) -> dict:
    """Peak RSS growth and state bytes per rank over `steps` training steps of the larger
    MEMORY_CONFIG model, for each implementation in turn in this process (one device on rank 0
    while the other ranks wait). The baseline is taken after the model is built and parallelized,
    with garbage collected and free heap memory returned to the OS."""
    import torch.distributed as dist

    from hypershard.models import make_batches, tiny_config

    _set_mmap_threshold(65536)
    config = tiny_config("qwen3", **MEMORY_CONFIG)
    batches = make_batches(config.vocab_size, 2, batch=4, seq=32)
    out: dict = {}
    for impl in ("hypershard", "torch_dtensor", "single_device"):
        gc.collect()
        malloc_trim()
        dist.barrier()
        if impl == "single_device" and rank != 0:
            continue
        trainer = None
        try:
            if impl == "hypershard":
                trainer = _HypershardTrainer(config, mesh_spec)
            elif impl == "torch_dtensor":
                trainer = _TorchTPTrainer(config, mesh_spec)
            else:
                trainer = _SingleTrainer(config)
            gc.collect()
            malloc_trim()
            baseline = vm_kib("VmRSS")
            exact = reset_peak_rss()
            for step in range(steps):
                trainer.step(*batches[step % len(batches)], _lr(step, steps))
            peak = vm_kib("VmHWM")
            out[impl] = {"rss_after_build_mb": baseline / 1024, "peak_rss_mb": peak / 1024,
                         "peak_growth_mb": (peak - baseline) / 1024 if exact else None,
                         "state": _state_bytes(trainer.params, trainer.optimizers)}
        except Exception as exc:  # noqa: BLE001 (every rank raises alike)
            out[impl] = {"error": error_text(exc)}
        finally:
            del trainer
    dist.barrier()
    return out


def memory_summary(ranks: list, mesh_spec) -> dict:
    entry: dict = {"mesh": _mesh_text(mesh_spec)}
    single = ranks[0]["memory"].get("single_device", {})
    for impl in ("hypershard", "torch_dtensor"):
        rows = [r["memory"].get(impl, {}) for r in ranks]
        errors = [row["error"] for row in rows if "error" in row]
        if errors:
            entry[f"{impl}_error"] = errors[0]
            continue
        growth = [row["peak_growth_mb"] for row in rows if row.get("peak_growth_mb") is not None]
        entry[f"{impl}_peak_mb"] = max(growth) if growth else None
        entry[f"{impl}_peak_mb_per_rank"] = [row.get("peak_growth_mb") for row in rows]
        entry[f"{impl}_state_mb"] = max(row["state"]["total_mb"] for row in rows)
        entry[f"{impl}_state_rank0"] = rows[0]["state"]
        entry[f"{impl}_rss_after_build_mb_rank0"] = rows[0]["rss_after_build_mb"]
    if "error" in single:
        entry["single_device_error"] = single["error"]
    entry["single_device_peak_mb"] = single.get("peak_growth_mb")
    entry["single_device_state_mb"] = single.get("state", {}).get("total_mb")
    entry["single_device_state"] = single.get("state")
    for impl in ("hypershard", "torch_dtensor"):
        entry[f"{impl}_peak_vs_single"] = ratio(entry.get(f"{impl}_peak_mb"), entry["single_device_peak_mb"])
        entry[f"{impl}_state_vs_single"] = ratio(entry.get(f"{impl}_state_mb"), entry["single_device_state_mb"])
    return entry


# ============================================================================= report

def _f(x, fmt="{:.2f}", none="—") -> str:
    if x is None:
        return none
    if isinstance(x, str):
        return x
    return fmt.format(x)


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = ["# hypershard benchmark results", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['cpus']} CPU cores, "
             f"{'--quick, ' if meta['quick'] else ''}run took {meta['seconds']:.0f} s on {meta['date']}. "
             "Every ratio compares implementations measured side by side in this run (medians of "
             "repeated samples; min–max in results.json).", ""]
    d = results.get("dispatch")
    if d:
        lines += ["## Per-op dispatch overhead (µs per call, tiny tensors)", "",
                  "ratio = hypershard / plain; speedup = torch DTensor / hypershard; "
                  "overhead ratio = (torch DTensor − plain) / (hypershard − plain). "
                  "Plain eager runs the op on the same local tensors each rank computes on. "
                  "Boxed = hypershard with its typed fast path off (every op through the boxed fallback).", "",
                  "| mesh | placements | op class | plain | hypershard | boxed | torch DTensor | ratio vs plain "
                  "| speedup vs torch DTensor | overhead ratio |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for vkey, ops in d.get("variants", {}).items():
            world, place = vkey.split("rank_")
            for name, r in ops.items():
                bad = [f"{IMPL_NAMES[i]} {'≠ one device' if c is False else 'raised: ' + str(c)[:80]}"
                       for i, c in r["matches_one_device"].items() if c is not True]
                coll = [f"{IMPL_NAMES[i]} runs {n} collective{'s' if n > 1 else ''}"
                        for i, n in r.get("collectives_per_call", {}).items() if n and i in IMPL_NAMES]
                note = "".join(f" ⚠ {x}" for x in bad) + "".join(f" ({x})" for x in coll)
                plus = (f" ({r['ratio_vs_plain_plus_collectives']:.2f}x vs plain + its bare collectives)"
                        if r.get("ratio_vs_plain_plus_collectives") else "")
                lines.append(f"| {world} rank{'s' if world != '1' else ''} | {place} | {name}{note} "
                             f"| {_f(r['plain_us'])} | {_f(r['hypershard_us'])} | {_f(r.get('hypershard_boxed_us'))} "
                             f"| {_f(r['torch_dtensor_us'])} "
                             f"| {_f(r['ratio_vs_plain'], '{:.2f}x')}{plus} | {_f(r['speedup_vs_torch_dtensor'], '{:.1f}x')} "
                             f"| {_f(r['overhead_ratio_vs_torch_dtensor'], '{:.1f}x')} |")
        lines += ["", "Geometric means over the op classes (medians; and from each implementation's fastest "
                      "sample, the least disturbed by other load on the machine):", "",
                  "| mesh, placements | ratio vs plain | speedup vs torch DTensor | overhead ratio "
                  "| ratio vs plain (fastest) | speedup vs torch DTensor (fastest) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for vkey, g in d.get("summary", {}).items():
            lines.append(f"| {vkey.replace('rank_', ' rank, ')} | {_f(g['geomean_ratio_vs_plain'], '{:.2f}x')} "
                         f"| {_f(g['geomean_speedup_vs_torch_dtensor'], '{:.2f}x')} "
                         f"| {_f(g['geomean_overhead_ratio'], '{:.1f}x')} "
                         f"| {_f(g['geomean_ratio_vs_plain_best'], '{:.2f}x')} "
                         f"| {_f(g['geomean_speedup_vs_torch_dtensor_best'], '{:.2f}x')} |")
        ref = d.get("info", {}).get("4rank_gloo_all_reduce_us")
        if ref:
            lines += ["", f"For scale: one bare gloo `all_reduce` of 2 floats over the 4 ranks takes "
                          f"{ref['median']:.0f} µs here (min {ref['min']:.0f}, max {ref['max']:.0f})."]
        lines.append("")
    s = results.get("step")
    if s:
        lines += ["## Training step, Qwen3 on 4 CPU ranks (s per step)", "",
                  "AdamW + clip_grad_norm_; tiny model, global batch 4 × 32 tokens, unless the row says otherwise; "
                  "the 4 ranks share the machine's cores, one device runs alone. Loss diff = max relative "
                  "difference of every step's loss vs one device. hypershard reduces data-parallel gradients "
                  "in buckets at the end of backward; *per-param* is hypershard with that off (each gradient "
                  "reduced in its own hook). The torch DTensor baseline sums gradients with one all-reduce per "
                  "parameter, *bucketed* with one per dtype over the flattened gradients. "
                  "For scale: one bare gloo `all_reduce` of 16 KiB over the 4 ranks takes "
                  + ", ".join(f"{r.get('gloo_all_reduce_16KiB_us', 0):.0f} µs ({k})" for k, r in s.items()
                              if "error" not in r) + ".", "",
                  "| run | hypershard | hypershard per-param | torch DTensor | torch DTensor bucketed | one device "
                  "| speedup vs torch DTensor (bucketed) | buckets' gain | hypershard / one device "
                  "| loss diff hypershard | loss diff torch DTensor |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for key, r in s.items():
            if "error" in r:
                lines.append(f"| {key} | failed: {r['error'][:100]} | | | | | | | | | |")
                continue
            err = "; ".join(f"{k}: {v}" for k, v in r["errors"].items())
            what = r["mesh"]
            if key not in STEP_MESHES:  # the compute-size run
                batch = r.get("global_batch") or ["?", "?"]
                what += f", {(r.get('parameters') or 0) / 1e6:.1f} M params, batch {batch[0]} × {batch[1]}"
            lines.append(f"| {what}{' ⚠ ' + err[:160] if err else ''} | {_f(r['hypershard_s'], '{:.4f}')} "
                         f"| {_f(r.get('hypershard_per_param_s'), '{:.4f}')} "
                         f"| {_f(r['torch_dtensor_s'], '{:.4f}')} | {_f(r.get('torch_dtensor_bucketed_s'), '{:.4f}')} "
                         f"| {_f(r['single_device_s'], '{:.4f}')} "
                         f"| {_f(r['speedup_vs_torch_dtensor'], '{:.2f}x')} "
                         f"({_f(r.get('speedup_vs_torch_dtensor_bucketed'), '{:.2f}x')}) "
                         f"| {_f(r.get('bucket_speedup'), '{:.2f}x')} "
                         f"| {_f(r['hypershard_vs_single_device'], '{:.1f}x')} "
                         f"| {_f(r.get('hypershard_loss_max_rel_diff_vs_single'), '{:.1e}')} "
                         f"| {_f(r.get('torch_dtensor_loss_max_rel_diff_vs_single'), '{:.1e}')} |")
        lines.append("")
    b = results.get("bytes")
    if b:
        lines += ["## Bytes sent per rank per training step (rank 0; max over ranks)", "",
                  "| mesh | hypershard | collectives | torch DTensor | collectives | torch DTensor / hypershard |",
                  "|---|---:|---:|---:|---:|---:|"]
        for key, r in b.items():
            lines.append(f"| {key} | {_f(r['hypershard'], '{:,}')} ({_f(r['hypershard_max_over_ranks'], '{:,}')}) "
                         f"| {_f(r['hypershard_collectives'], '{}')} "
                         f"| {_f(r['torch_dtensor'], '{:,}')} ({_f(r['torch_dtensor_max_over_ranks'], '{:,}')}) "
                         f"| {_f(r['torch_dtensor_collectives'], '{}')} "
                         f"| {_f(r['torch_dtensor_to_hypershard'], '{:.2f}x')} |")
        lines.append("")
    m = results.get("memory")
    if m:
        cfg = results["meta"]["memory_config"]
        lines += [f"## Memory per rank (Qwen3 hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}, "
                  f"vocab {cfg['vocab_size']}, {cfg['num_hidden_layers']} layers; MB, max over ranks)", "",
                  f"peak = growth of peak RSS over {results['meta']['settings']['memory_steps']} training steps "
                  "after the model is built; "
                  "state = parameters + gradients + AdamW states held by the rank.", "",
                  "| mesh | hypershard peak | torch DTensor peak | one device peak | hypershard state "
                  "| torch DTensor state | one device state | hypershard / one device (peak, state) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for key in STEP_MESHES:
            r = m.get(key)
            if not r:
                continue
            errs = "; ".join(f"{k}: {v}" for k, v in r.items() if k.endswith("_error"))
            lines.append(f"| {r['mesh']}{' ⚠ ' + errs[:160] if errs else ''} | {_f(r.get('hypershard_peak_mb'), '{:.1f}')} "
                         f"| {_f(r.get('torch_dtensor_peak_mb'), '{:.1f}')} | {_f(r.get('single_device_peak_mb'), '{:.1f}')} "
                         f"| {_f(r.get('hypershard_state_mb'), '{:.1f}')} | {_f(r.get('torch_dtensor_state_mb'), '{:.1f}')} "
                         f"| {_f(r.get('single_device_state_mb'), '{:.1f}')} "
                         f"| {_f(r.get('hypershard_peak_vs_single'), '{:.2f}x')}, "
                         f"{_f(r.get('hypershard_state_vs_single'), '{:.2f}x')} |")
        lines.append("")
    c = results.get("rule_cache")
    if c:
        lines += ["## hypershard rule cache over training steps (rank 0)", "",
                  "| mesh | ops per step | hit rate, first step | hit rate, warm step | plans after 1 step "
                  "| plans after N steps | N | bounded | interned layouts (1 → N) |",
                  "|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for key, r in c.items():
            lines.append(f"| {key} | {r['calls_per_step']} | {_f(r['hit_rate_first_step'], '{:.1%}')} "
                         f"| {_f(r['hit_rate_warm_step'], '{:.2%}')} | {r['entries_after_1_step']} "
                         f"| {r['entries_after_steps']} | {r['steps']} | {'yes' if r['bounded'] else 'NO'} "
                         f"| {r['interned_layouts_after_1_step']} → {r['interned_layouts_after_steps']} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(17, 9), dpi=100)
    d = results.get("dispatch", {}).get("variants", {})
    if d:
        names = list(next(iter(d.values())).keys())
        width = 0.8 / max(len(d), 1)

        def bars(ax, key, ylabel, title):
            """One bar per variant and op class, log scale, a line at 1."""
            for i, (vkey, ops) in enumerate(d.items()):
                vals = [ops[n][key] or math.nan for n in names]
                ax.bar([x + i * width for x in range(len(names))], vals, width, label=vkey.replace("_", " "))
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))])
            ax.set_xticklabels(names, rotation=35, ha="right")
            ax.axhline(1, color="k", linewidth=0.8)
            ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            ax.set_title(title)

        ax = axes[0][0]
        bars(ax, "speedup_vs_torch_dtensor", "torch DTensor µs / hypershard µs (log)",
             "dispatch: speedup vs torch DTensor")
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * 6)  # room for the legend
        ax.legend(fontsize=7, loc="upper center", ncol=4)
        bars(axes[0][1], "ratio_vs_plain", "hypershard µs / plain µs (log)", "dispatch: hypershard vs plain eager")
        axes[0][1].legend(fontsize=7)
    s = results.get("step", {})
    ax = axes[0][2]
    impls = [("hypershard", "hypershard"), ("hypershard_per_param", "hypershard per-param grads"),
             ("torch_dtensor", "torch DTensor"), ("torch_dtensor_bucketed", "torch DTensor bucketed"),
             ("single_device", "one device")]
    width = 0.8 / len(impls)
    for i, (k, label) in enumerate(impls):
        vals, errs = [], [[], []]
        for r in s.values():
            v = r.get(f"{k}_s")
            mm = r.get(f"{k}_minmax_s") or [v, v]
            vals.append((v or math.nan) * 1e3)
            errs[0].append(((v or 0) - (mm[0] or 0)) * 1e3)
            errs[1].append(((mm[1] or 0) - (v or 0)) * 1e3)
        ax.bar([x + i * width for x in range(len(s))], vals, width, yerr=errs, capsize=2, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(s))])
    ax.set_xticklabels([k.replace("_", "\n") for k in s])
    ax.set_yscale("log")
    ax.set_ylabel("ms per step (median, min–max; log)")
    ax.set_title("Qwen3 training step, 4 CPU ranks")
    ax.legend(fontsize=8)
    b = results.get("bytes", {})
    ax = axes[1][0]
    for i, (k, label) in enumerate([("hypershard", "hypershard"), ("torch_dtensor", "torch DTensor")]):
        ax.bar([x + i * 0.4 for x in range(len(b))], [(r.get(k) or 0) / 1024 for r in b.values()], 0.4, label=label)
    ax.set_xticks([x + 0.2 for x in range(len(b))])
    ax.set_xticklabels(list(b))
    ax.set_ylabel("KiB sent by rank 0 per step")
    ax.set_title("communication per training step")
    ax.legend(fontsize=8)
    m = results.get("memory", {})
    ax = axes[1][1]
    keys = [k for k in STEP_MESHES if k in m]
    bars = [("hypershard_peak_mb", "hypershard peak"), ("torch_dtensor_peak_mb", "torch DTensor peak"),
            ("single_device_peak_mb", "one device peak"), ("hypershard_state_mb", "hypershard state"),
            ("single_device_state_mb", "one device state")]
    for i, (k, label) in enumerate(bars):
        ax.bar([x + i * 0.16 for x in range(len(keys))], [m[key].get(k) or 0 for key in keys], 0.16, label=label)
    ax.set_xticks([x + 0.32 for x in range(len(keys))])
    ax.set_xticklabels(keys)
    ax.set_ylabel("MB per rank (max over ranks)")
    ax.set_title("memory per rank (larger Qwen3 config)")
    ax.legend(fontsize=7)
    c = results.get("rule_cache", {})
    ax = axes[1][2]
    for key, r in c.items():
        ax.plot(range(1, len(r["entries_per_step"]) + 1), r["entries_per_step"], "o-", label=key, markersize=3)
    ax.set_xlabel("training step")
    ax.set_ylabel("cached op plans")
    top = max((max(r["entries_per_step"]) for r in c.values() if r["entries_per_step"]), default=1)
    ax.set_ylim(0, top * 1.25)
    ax.set_title("hypershard rule cache: op plans after each step")
    ax.legend(fontsize=8)
    fig.suptitle(f"hypershard benchmarks (torch {results['meta']['torch']}, {results['meta']['cpus']} CPU cores)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ============================================================================= main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/run.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: few samples and steps (about two minutes on 2 busy cores); rough numbers")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default all)")
    parser.add_argument("--out", default=str(ROOT / "bench"), help="output folder (default bench/)")
    parser.add_argument("--repeats", type=int, help="timing samples per dispatch figure (default 21; quick 3)")
    parser.add_argument("--sample-ms", type=float, help="length of one dispatch sample in ms (default 5; quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed training steps (default 3; quick 1)")
    parser.add_argument("--timed", type=int, help="timed training steps per implementation (default 10; quick 3)")
    parser.add_argument("--cache-steps", type=int, help="hypershard steps for the rule-cache figures (default 20; quick 6)")
    parser.add_argument("--memory-steps", type=int, help="training steps in the memory runs (default 2; quick 1)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a launch is abandoned (default 600)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = dict(repeats=(3, 21), sample_ms=(3.0, 5.0), warmup=(1, 3), timed=(3, 10), cache_steps=(6, 20),
                    memory_steps=(1, 2))
    for k, (q, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, q if quick else full)
    args.sample_s = args.sample_ms / 1000
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; allowed: {','.join(SECTIONS)}")

    import torch
    import transformers

    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {msg}", flush=True)

    results: dict = {}
    if "dispatch" in sections:
        results["dispatch"] = run_dispatch(args, log)
    if "step" in sections or "memory" in sections:
        step, traffic, cache, memory = run_steps(args, log, with_memory="memory" in sections)
        if "step" in sections:
            results.update(step=step, bytes=traffic, rule_cache=cache)
        if memory:
            results["memory"] = memory
    results["meta"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                       "cpus": os.cpu_count(), "quick": quick, "seconds": time.perf_counter() - started,
                       "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "load_average": os.getloadavg(), "memory_config": MEMORY_CONFIG,
                       "settings": {k: getattr(args, k) for k in ("repeats", "sample_ms", "warmup", "timed",
                                                                  "cache_steps", "memory_steps")}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    text = markdown(results)
    (out / "RESULTS.md").write_text(text + "\n")
    try:
        plot(results, out / "results.png")
    except Exception as exc:  # noqa: BLE001 (the numbers matter more than the chart)
        print(f"chart not written: {error_text(exc)}")
    print()
    print(text)
    print(f"wrote {out / 'results.json'}, {out / 'RESULTS.md'}, {out / 'results.png'} "
          f"in {results['meta']['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
