"""Section "dispatch": the framework's cost per op call on tiny tensors, per op class, plain eager
vs hypershard (and hypershard with its typed fast path off) vs torch.distributed.tensor DTensor,
on 1-, 2- and 4-rank meshes with Replicate and Shard placements."""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable

from .collectives import CollectiveBytes
from .common import (
    error_text,
    full_value,
    geomean,
    global_args,
    placed_args,
    rank0_per_world,
    ratio,
    same_values,
    summary,
)
from .timing import time_all_reduce, time_interleaved


# Each op class: (arguments as in common.global_args, op). Global tensors are tiny (8 rows, so a
# 4-rank Shard(0) keeps 2 rows per rank) so the framework, not the arithmetic, is measured.
def op_classes():
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
        "cross_entropy_sum": (
            [("tensor", (8, 16), 0), ("target", (8,), 16, 0)],
            lambda x, t: F.cross_entropy(x, t, reduction="sum"),
        ),
        # a sample of the rule families beyond the op classes above (FAMILY_SAMPLE_ROWS). Indices
        # stay below 2 so the plain eager call on a 4-rank shard of 2 rows is valid too.
        "tril": ([("tensor", (8, 8), 0)], lambda a: torch.tril(a)),
        "gather": ([("tensor", (8, 8), 0), ("index", (8, 4), 2, 0)], lambda a, i: torch.gather(a, 1, i)),
        "index_select_owned": (
            [("tensor", (8, 8), 0), ("index", (4,), 2, None)],
            lambda a, i: torch.index_select(a, 0, i),
        ),
        "cumsum": ([("tensor", (8, 8), 0)], lambda a: torch.cumsum(a, dim=1)),
        "rfft": ([("tensor", (8, 8), 0)], lambda a: torch.fft.rfft(a, dim=1)),
        "avg_pool2d": ([("tensor", (8, 2, 4, 4), 0)], lambda x: F.avg_pool2d(x, 2)),
        "grouped_mm_colwise": (
            [("tensor", (8, 8), None), ("tensor", (4, 8, 16), 2), ("offs", (2, 4, 6, 8), None)],
            lambda x, w, offs: torch._grouped_mm(x, w, offs=offs),
        ),
        # exchanges instead of gathers along the SHARDED dim (plain: the op on the local shard)
        "cumsum_sharded": ([("tensor", (8, 8), 0)], lambda a: torch.cumsum(a, dim=0)),
        "roll_sharded": ([("tensor", (8, 8), 0)], lambda a: torch.roll(a, 1, 0)),
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
    "tril": "torch.tril(a), [8, 8]; Shard: Shard(0) (the matrix dims sharded, rows)",
    "gather": "torch.gather(a, 1, index), a [8, 8], index [8, 4]; Shard: both Shard(0) (gathered along the "
    "unsharded dim)",
    "index_select_owned": "torch.index_select(a, 0, index), a [8, 8], index [4]; Shard: a Shard(0), index "
    "Replicate (by ownership along the sharded dim: a Partial(sum) result)",
    "cumsum": "torch.cumsum(a, dim=1), [8, 8]; Shard: Shard(0) (along the unsharded dim)",
    "rfft": "torch.fft.rfft(a, dim=1), [8, 8]; Shard: Shard(0) (along the unsharded dim)",
    "avg_pool2d": "F.avg_pool2d(x, 2), [8, 2, 4, 4]; Shard: Shard(0) (batch)",
    "grouped_mm_colwise": "torch._grouped_mm(x, w, offs), x [8, 8] Replicate, w [4, 8, 16] (4 experts), offs "
    "[2, 4, 6, 8]; Shard: w Shard(2) (colwise)",
    "cumsum_sharded": "torch.cumsum(a, dim=0), [8, 8]; Shard: Shard(0) (along the sharded dim: one all-gather of "
    "each rank's last row)",
    "roll_sharded": "torch.roll(a, 1, 0), [8, 8]; Shard: Shard(0) (along the sharded dim: one all-to-all of the "
    "row crossing each boundary)",
}


# A sample of the rule families beyond the basic op classes (indexing by ownership, triangular,
# scans, Fourier, pooling, grouped products): torch DTensor redistributes some of them (tril and
# index_select on a Shard(0) input) through a path CollectiveBytes does not count, so its calls
# there are timed on every rank (a rank-0-alone sample would wait forever on the other ranks' part
# of the collective).
FAMILY_SAMPLE_ROWS = ("tril", "gather", "index_select_owned", "cumsum", "rfft", "avg_pool2d", "grouped_mm_colwise")
# The exchange rules along a sharded dim (a scan's all-gather of last rows, roll's all-to-all):
# torch DTensor gathers the dim, and its calls are timed on every rank as for FAMILY_SAMPLE_ROWS.
EXCHANGE_ROWS = ("cumsum_sharded", "roll_sharded")


IMPL_NAMES = {
    "plain": "plain",
    "hypershard": "hypershard",
    "hypershard_boxed": "hypershard (fast path off)",
    "torch_dtensor": "torch DTensor",
}


def dispatch_worker(rank: int, world: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor as tdistribute

    import hypershard as hs

    mesh = hs.init_device_mesh("cpu", (world,), ("x",))
    tmesh = torch_mesh("cpu", (world,), mesh_dim_names=("x",))
    mesh_group = tmesh.get_group()
    classes = op_classes()
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

    results: dict = {}
    hs._C.reset_dispatch_stats()
    for variant in ("replicate", "shard"):
        out: dict = {}
        for index, (name, (spec, op)) in enumerate(classes.items()):
            values = global_args(spec, seed=index)
            entry: dict = {}
            case_start = time.perf_counter()
            # correctness on fresh inputs: the global result of each implementation vs plain
            # eager on one device; the same call counts the collectives the op runs
            expected = op(*placed_args(spec, values, False, lambda t, d: t.clone()))
            check, collectives = {}, {"plain": 0}
            for impl in impls[1:]:
                try:
                    a = placed_args(spec, values, variant == "shard", maker(impl))
                    hs._C.reset_traffic()
                    with path_of(impl), CollectiveBytes() as counter:
                        result = op(*a)
                    collectives[impl] = (
                        hs._C.traffic()["collectives"] if impl.startswith("hypershard") else counter.collectives
                    )
                    check[impl] = bool(same_values(full_value(result), expected))
                except Exception as exc:  # noqa: BLE001 (recorded; the op is not timed for this impl)
                    check[impl] = error_text(exc)
            entry["matches_one_device"] = check
            fns = {}
            for impl in impls:
                if impl != "plain" and isinstance(check[impl], str):
                    continue  # it raised: nothing to time
                a = placed_args(spec, values, variant == "shard", maker(impl))
                fns[impl] = lambda a=a: op(*a)
            agreed = torch.tensor([collectives.get(i, 0) for i in impls], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            collectives = {i: int(n) for i, n in zip(impls, agreed.tolist()) if i in fns}
            # What hypershard's collectives alone cost: the same number of bare gloo all-reduces of
            # 2 floats (the size a loss's (sum, count) takes), timed in the same rotation.
            if collectives.get("hypershard"):
                floor_buf = torch.zeros(2)
                fns["collectives_alone"] = lambda n=collectives["hypershard"]: [
                    dist.all_reduce(floor_buf, group=mesh_group) for _ in range(n)
                ]
                collectives["collectives_alone"] = collectives["hypershard"]
            # An op without collectives is timed on rank 0 alone while the other ranks wait in a
            # barrier (ranks sharing few cores would otherwise preempt each other mid-sample); an
            # op with collectives runs on every rank, the same number of calls everywhere.
            solo = {
                impl: collectives[impl] == 0
                and not (impl == "torch_dtensor" and world > 1 and name in FAMILY_SAMPLE_ROWS + EXCHANGE_ROWS)
                for impl in fns
            }
            counts, samples = time_interleaved(fns, solo, rank, args["sample_s"], args["repeats"], setting=path_of)
            if rank != 0:
                continue  # rank 0 reports
            stats = {impl: summary(s) for impl, s in samples.items()}
            plain = stats["plain"]["median"]
            ours = stats.get("hypershard", {}).get("median")
            theirs = stats.get("torch_dtensor", {}).get("median")
            boxed = stats.get("hypershard_boxed", {}).get("median")
            floor = stats.get("collectives_alone", {}).get("median")
            entry.update(
                {
                    "plain_us": plain,
                    "hypershard_us": ours,
                    "torch_dtensor_us": theirs,
                    "hypershard_boxed_us": boxed,
                    "fast_path_speedup": ratio(boxed, ours),
                    "ratio_vs_plain": ratio(ours, plain),
                    # against plain eager plus the bare collectives the op needs (None: it needs none)
                    "collectives_alone_us": floor,
                    "ratio_vs_plain_plus_collectives": None if floor is None else ratio(ours, plain + floor),
                    "speedup_vs_torch_dtensor": ratio(theirs, ours),
                    "overhead_ratio_vs_torch_dtensor": (
                        ratio(theirs - plain, ours - plain) if ours is not None and theirs is not None else None
                    ),
                    # the same from each implementation's fastest sample (least disturbed by other load)
                    "ratio_vs_plain_best": ratio(stats.get("hypershard", {}).get("min"), stats["plain"]["min"]),
                    "speedup_vs_torch_dtensor_best": ratio(
                        stats.get("torch_dtensor", {}).get("min"), stats.get("hypershard", {}).get("min")
                    ),
                    "hypershard_overhead_us": None if ours is None else ours - plain,
                    "torch_dtensor_overhead_us": None if theirs is None else theirs - plain,
                    "samples_us": {impl: {"min": s["min"], "max": s["max"], "n": s["n"]} for impl, s in stats.items()},
                    "calls_per_sample": counts,
                    "collectives_per_call": collectives,
                    "timed_on": {impl: "rank 0 alone" if solo[impl] else "every rank" for impl in fns},
                    "seconds": time.perf_counter() - case_start,
                    "op": OP_NOTES[name],
                }
            )
            out[name] = entry
        results[variant] = out
    # reference: one bare gloo all_reduce of 2 floats over the mesh (what a collective costs here)
    results["gloo_all_reduce_us"] = time_all_reduce(2, args["repeats"])
    stats = hs._C.dispatch_stats()
    results["hypershard_dispatch_stats"] = stats
    results["hypershard_hit_rate"] = ratio(stats["cache_hits"], stats["calls"])
    return results


def run_dispatch(args: argparse.Namespace, log: Callable) -> dict:
    variants: dict = {}
    extra: dict = {}
    for world, r0 in rank0_per_world("dispatch", dispatch_worker, (1, 2, 4), args, log, extra).items():
        variants[f"{world}rank_replicate"] = r0["replicate"]
        variants[f"{world}rank_shard"] = r0["shard"]
        extra[f"{world}rank_hypershard_dispatch_stats"] = r0["hypershard_dispatch_stats"]
        extra[f"{world}rank_hypershard_hit_rate"] = r0["hypershard_hit_rate"]
        extra[f"{world}rank_gloo_all_reduce_us"] = r0["gloo_all_reduce_us"]
    out: dict = dict(variants.get("1rank_replicate", {}))
    out["variants"] = variants
    out["info"] = extra
    out["summary"] = {
        v: {
            "geomean_ratio_vs_plain": geomean([r["ratio_vs_plain"] for r in ops.values()]),
            "geomean_speedup_vs_torch_dtensor": geomean([r["speedup_vs_torch_dtensor"] for r in ops.values()]),
            "geomean_overhead_ratio": geomean([r["overhead_ratio_vs_torch_dtensor"] for r in ops.values()]),
            "geomean_ratio_vs_plain_best": geomean([r["ratio_vs_plain_best"] for r in ops.values()]),
            # the same over the family sample alone
            "geomean_ratio_vs_plain_family_sample": geomean(
                [r["ratio_vs_plain"] for n, r in ops.items() if n in FAMILY_SAMPLE_ROWS]
            ),
            # and over the exchange rules along the sharded dim
            "geomean_ratio_vs_plain_exchange": geomean(
                [r["ratio_vs_plain"] for n, r in ops.items() if n in EXCHANGE_ROWS]
            ),
            "geomean_speedup_vs_torch_dtensor_best": geomean(
                [r["speedup_vs_torch_dtensor_best"] for r in ops.values()]
            ),
        }
        for v, ops in variants.items()
    }
    return out
