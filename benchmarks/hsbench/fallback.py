"""Section "fallback": what an op pays when hypershard runs it through the fallback (every DTensor
input gathered to Replicate, the op computed on the global values, outputs Replicate) instead of
its distributed rule (the op computed on the local shards). The ops here all have rules;
hypershard._C.set_rule_enabled(op, False) makes hypershard ignore one, as if the op had none.
Timed side by side with the rule and with plain eager on the local shard, on the dispatch
section's tiny sharded inputs, then on realistic sizes: reads and writes by ownership, triangular
and expert-sharded grouped products, and the rules that exchange slices along a sharded dim
(scans, roll, flip, slice, a causal conv1d's halo) instead of gathering it."""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable

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
from .timing import calibrate, calibrate_one_call, time_interleaved

# 1 rank: the fallback's own cost with nothing to gather; 2 and 4 ranks: with its all-gathers
FALLBACK_WORLDS = (1, 2, 4)
FALLBACK_IMPLS = ("plain", "rule", "fallback")


# the indexing/triangular/grouped rows: a [rows, hidden] table sharded on rows (indices below a
# 4-rank shard's row count, so the plain eager call on any rank's shard is valid too)
ROWS, HIDDEN, PICKS, OWNED = 2048, 256, 512, 512
EXPERTS, TOKENS, EXPERT_DIM = 8, 512, 256
# the exchange rows: a shift and a slice that cross shard boundaries on 2 and 4 ranks, and
# Qwen3.5's causal depthwise conv1d (kernel 4) on a [batch, channels, sequence] activation
# sharded on the sequence
SHIFT, SLICE = 100, (100, 1700)
BATCH, CHANNELS, SEQ, KERNEL = 4, 64, 4096, 4


def causal_conv1d(x, w):
    """Qwen3.5's causal depthwise conv1d: padded by kernel - 1 on both sides, the first L
    positions kept (on a sequence-sharded DTensor: a halo exchange, then an exchanged slice)."""
    import torch.nn.functional as F

    return F.conv1d(x, w, padding=w.shape[-1] - 1, groups=x.shape[1])[..., : x.shape[-1]]


def causal_conv1d_fwd_bwd(x, w, grad):
    """causal_conv1d forward and backward: [output, grad of x, grad of w] for the output's
    gradient `grad` (the same leaves every call: torch.autograd.grad accumulates nothing)."""
    import torch

    x.requires_grad_()
    w.requires_grad_()
    y = causal_conv1d(x, w)
    gx, gw = torch.autograd.grad(y, (x, w), grad)
    return [y.detach(), gx, gw]


def _expert_plain(world: int, rank: int):
    """Plain eager for the expert-sharded _grouped_mm: this rank's experts on their tokens' rows."""
    import torch

    per, ends = EXPERTS // world, [TOKENS * (e + 1) // EXPERTS for e in range(EXPERTS)]
    start = 0 if rank == 0 else ends[rank * per - 1]
    stop = ends[(rank + 1) * per - 1]
    offs = torch.tensor([e - start for e in ends[rank * per : (rank + 1) * per]], dtype=torch.int32)
    return lambda x, w, _offs: torch._grouped_mm(x[start:stop], w, offs=offs)


# The absolute tolerance of a row's check where the default 1e-5 is too tight: the weight gradient
# of the conv sums n = BATCH * SEQ products of two unit normals (variance 1 each), in another order
# when the sequence is sharded (each rank's part, then their sum). Summed one after another, the
# k-th addition rounds a partial sum of standard deviation sqrt(k) by at most u = 2^-24 of it, so
# one order's error has a standard deviation of about u * sqrt(sum_k k) = u * n / sqrt(2), and the
# difference of two independent orders about u * n; 4 of those (3.9e-3 here, four standard
# deviations of the slowest summation a kernel can use; blocked kernels do far better: ~2e-4 was
# seen) is far below what a wrong halo or a lost part changes (a whole product term, ~1).
CHECK_ATOL = {"causal_conv1d_seq_fwd_bwd": 4 * 2.0**-24 * BATCH * SEQ}


# the rows whose rule exchanges slices along the sharded dim (the rest run on the local shards)
EXCHANGE_ROWS = (
    "cumsum_rows",
    "sort_rows",
    "roll_rows",
    "flip_rows",
    "slice_rows",
    "causal_conv1d_seq",
    "causal_conv1d_seq_fwd_bwd",
)

# rows whose calls take tens of ms: calls per sample from one timed call (calibrate's 10 or more
# calls per sample would take about a minute per row and mesh)
ONE_CALL_ROWS = ("causal_conv1d_seq", "causal_conv1d_seq_fwd_bwd")


def fallback_ops():
    """name -> (arguments as in common.global_args with their Shard placements, op, the ATen ops
    whose rules are switched off for the fallback's timing[, plain(world, rank) -> the plain eager
    op on the local arguments where that is not op itself]). Every rule here runs on the local
    shards without a collective (a read by ownership leaves a Partial(sum) result unreduced),
    except those of EXCHANGE_ROWS, which move only the slices other ranks read instead of gathering."""
    import torch
    import torch.nn.functional as F

    return {
        "neg": ([("tensor", (8, 8), 0)], lambda a: torch.neg(a), ("aten::neg",)),
        "add": ([("tensor", (8, 8), 0), ("tensor", (8, 8), 0)], lambda a, b: torch.add(a, b), ("aten::add.Tensor",)),
        "sum": ([("tensor", (8, 8), 0)], lambda a: a.sum(dim=1), ("aten::sum.dim_IntList",)),
        "softmax": ([("tensor", (8, 8), 0)], lambda a: torch.softmax(a, dim=1), ("aten::_softmax",)),
        "mm": ([("tensor", (8, 8), 0), ("tensor", (8, 8), None)], lambda a, b: torch.mm(a, b), ("aten::mm",)),
        # F.linear with a bias reaches aten::addmm (after aten::t, a view that keeps its rule)
        "linear": (
            [("tensor", (8, 8), None), ("tensor", (16, 8), 0), ("tensor", (16,), 0)],
            lambda x, w, b: F.linear(x, w, b),
            ("aten::addmm",),
        ),
        # indexing by ownership along the sharded dim: nothing of the table gathered natively
        "index_select_owned": (
            [("tensor", (ROWS, HIDDEN), 0), ("index", (PICKS,), OWNED, None)],
            lambda t, i: torch.index_select(t, 0, i),
            ("aten::index_select",),
        ),
        "gather_owned": (
            [("tensor", (ROWS, HIDDEN), 0), ("index", (PICKS, HIDDEN), OWNED, None)],
            lambda t, i: torch.gather(t, 0, i),
            ("aten::gather",),
        ),
        "index_add_owned": (
            [("tensor", (ROWS, HIDDEN), 0), ("index", (PICKS,), OWNED, None), ("tensor", (PICKS, HIDDEN), None)],
            lambda t, i, src: t.index_add_(0, i, src),
            ("aten::index_add_",),
        ),
        "tril_rows": ([("tensor", (1024, 1024), 0)], lambda a: torch.tril(a), ("aten::tril",)),
        "triu_rows": ([("tensor", (1024, 1024), 0)], lambda a: torch.triu(a, 1), ("aten::triu",)),
        "grouped_mm_expert": (
            [
                ("tensor", (TOKENS, EXPERT_DIM), None),
                ("tensor", (EXPERTS, EXPERT_DIM, EXPERT_DIM), 0),
                ("offs", tuple(TOKENS * (e + 1) // EXPERTS for e in range(EXPERTS)), None),
            ],
            lambda x, w, offs: torch._grouped_mm(x, w, offs=offs),
            ("aten::_grouped_mm",),
            _expert_plain,
        ),
        # exchanges instead of gathers along the sharded dim (plain: the op on the local shard,
        # without the carry, the neighbours' rows or the halo)
        "cumsum_rows": ([("tensor", (ROWS, HIDDEN), 0)], lambda a: torch.cumsum(a, 0), ("aten::cumsum",)),
        # stable: a non-stable sort of values that repeat (likely among 2048 float32 normals) gathers
        "sort_rows": (
            [("tensor", (ROWS, HIDDEN), 0)],
            lambda a: list(torch.sort(a, dim=0, stable=True)),
            ("aten::sort.stable",),
        ),
        "roll_rows": ([("tensor", (ROWS, HIDDEN), 0)], lambda a: torch.roll(a, SHIFT, 0), ("aten::roll",)),
        "flip_rows": ([("tensor", (ROWS, HIDDEN), 0)], lambda a: torch.flip(a, [0]), ("aten::flip",)),
        "slice_rows": ([("tensor", (ROWS, HIDDEN), 0)], lambda a: a[SLICE[0] : SLICE[1]], ("aten::slice.Tensor",)),
        "causal_conv1d_seq": (
            [("tensor", (BATCH, CHANNELS, SEQ), 2), ("tensor", (CHANNELS, 1, KERNEL), None)],
            causal_conv1d,
            ("aten::convolution", "aten::slice.Tensor"),
        ),
        "causal_conv1d_seq_fwd_bwd": (
            [
                ("tensor", (BATCH, CHANNELS, SEQ), 2),
                ("tensor", (CHANNELS, 1, KERNEL), None),
                ("tensor", (BATCH, CHANNELS, SEQ), 2),
            ],
            causal_conv1d_fwd_bwd,
            ("aten::convolution", "aten::slice.Tensor", "aten::convolution_backward", "aten::slice_backward"),
        ),
    }


FALLBACK_NOTES = {
    "neg": "torch.neg(a), [8, 8] Shard(0)",
    "add": "torch.add(a, b), [8, 8], both Shard(0)",
    "sum": "a.sum(dim=1), [8, 8] Shard(0)",
    "softmax": "torch.softmax(a, dim=1), [8, 8] Shard(0)",
    "mm": "torch.mm(a, b), [8, 8] Shard(0) @ [8, 8] Replicate",
    "linear": "F.linear(x, w, b), x [8, 8] Replicate, w [16, 8] and b [16] Shard(0) (colwise)",
    "index_select_owned": f"torch.index_select(t, 0, index), t [{ROWS}, {HIDDEN}] Shard(0), index [{PICKS}] "
    "Replicate (by ownership: a Partial(sum) result)",
    "gather_owned": f"torch.gather(t, 0, index), t [{ROWS}, {HIDDEN}] Shard(0), index [{PICKS}, {HIDDEN}] "
    "Replicate (by ownership: a Partial(sum) result)",
    "index_add_owned": f"t.index_add_(0, index, src), t [{ROWS}, {HIDDEN}] Shard(0), index [{PICKS}] and src "
    f"[{PICKS}, {HIDDEN}] Replicate (each rank adds the rows it owns; t keeps Shard(0))",
    "tril_rows": "torch.tril(a), [1024, 1024] Shard(0)",
    "triu_rows": "torch.triu(a, 1), [1024, 1024] Shard(0)",
    "grouped_mm_expert": f"torch._grouped_mm(x, w, offs), x [{TOKENS}, {EXPERT_DIM}] Replicate, w [{EXPERTS}, "
    f"{EXPERT_DIM}, {EXPERT_DIM}] Shard(0) (expert parallel: a Partial(sum) result), offs "
    "Replicate",
    "cumsum_rows": f"torch.cumsum(t, 0), t [{ROWS}, {HIDDEN}] Shard(0) (along the sharded dim: one all-gather "
    "of each rank's last row)",
    "sort_rows": f"torch.sort(t, dim=0, stable=True), t [{ROWS}, {HIDDEN}] Shard(0) (along the sharded dim: "
    "a sample sort, two all-to-alls of (value, index) pairs; the results keep Shard(0))",
    "roll_rows": f"torch.roll(t, {SHIFT}, 0), t [{ROWS}, {HIDDEN}] Shard(0) (along the sharded dim: one "
    "all-to-all of the rows crossing a boundary)",
    "flip_rows": f"torch.flip(t, [0]), t [{ROWS}, {HIDDEN}] Shard(0) (along the sharded dim: one all-to-all of "
    "the mirrored blocks)",
    "slice_rows": f"t[{SLICE[0]}:{SLICE[1]}], t [{ROWS}, {HIDDEN}] Shard(0) (the result keeps Shard(0): one "
    "all-to-all of the rows each output block reads)",
    "causal_conv1d_seq": f"F.conv1d(x, w, padding={KERNEL - 1}, groups={CHANNELS})[..., :{SEQ}], x [{BATCH}, "
    f"{CHANNELS}, {SEQ}] Shard(2) (sequence), w [{CHANNELS}, 1, {KERNEL}] Replicate (a halo "
    "exchange, then an exchanged slice)",
    "causal_conv1d_seq_fwd_bwd": "the same, forward and torch.autograd.grad of x and w for a Shard(2) output gradient",
}


def fallback_worker(rank: int, world: int, args: dict) -> dict:
    import warnings

    import torch
    import torch.distributed as dist

    import hypershard as hs

    # the fallback warns once per op that it has no rule: expected here
    warnings.filterwarnings("ignore", message=r"hypershard: .* has no distributed rule")
    hs.set_strict(False)  # strict mode raises Missing operator instead of falling back
    mesh = hs.init_device_mesh("cpu", (world,), ("x",))

    def maker(impl: str):
        def make(t, dim):
            t = t.clone()  # distribute_tensor may alias its input
            if impl == "plain":
                return t if dim is None else t.chunk(world, dim)[rank].clone()
            return hs.distribute_tensor(t, mesh, [hs.Replicate() if dim is None else hs.Shard(dim)])

        return make

    def agreed(values: list, op) -> list:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=op)
        return t.tolist()

    out: dict = {}
    for index, (name, (spec, op, rule_ops, *plain_of)) in enumerate(fallback_ops().items()):
        plain_op = plain_of[0](world, rank) if plain_of else op
        values = global_args(spec, seed=index)
        entry: dict = {"op": FALLBACK_NOTES[name], "rules_switched_off": list(rule_ops)}
        case_start = time.perf_counter()

        @contextlib.contextmanager
        def rules_of(impl: str, rule_ops=rule_ops):
            """The fallback runs with the op's rules switched off; the rest with them on."""
            if impl != "fallback":
                yield
                return
            for o in rule_ops:
                hs._C.set_rule_enabled(o, False)
            try:
                yield
            finally:
                for o in rule_ops:
                    hs._C.set_rule_enabled(o, True)

        # one checked call per implementation: the global result vs plain eager on one device, the
        # collectives it runs, and which path served it (fallback_calls must grow for the fallback
        # only, or this section would be timing the rule twice)
        expected = op(*placed_args(spec, values, False, lambda t, d: t.clone()))
        check, collectives, fallback_calls, gathered, sent, placements = {}, {"plain": 0}, {}, {}, {}, {}
        for impl in FALLBACK_IMPLS[1:]:
            try:
                a = placed_args(spec, values, True, maker(impl))
                hs._C.reset_traffic()
                before = hs._C.dispatch_stats()
                with rules_of(impl):
                    result = op(*a)
                after = hs._C.dispatch_stats()
                collectives[impl] = hs._C.traffic()["collectives"]
                sent[impl] = hs._C.traffic()["bytes_sent"]
                placements[impl] = str(list(getattr(result, "placements", [])))
                fallback_calls[impl] = after["fallback_calls"] - before["fallback_calls"]
                gathered[impl] = after["fallback_bytes"] - before["fallback_bytes"]
                check[impl] = bool(same_values(full_value(result), expected, CHECK_ATOL.get(name, 1e-5)))
            except Exception as exc:  # noqa: BLE001 (recorded; the op is not timed)
                check[impl] = error_text(exc)
        entry["matches_one_device"] = check
        entry["fallback_calls_per_call"] = fallback_calls
        # bytes this rank sent in the op's own collectives (a Partial result's later reduction not
        # counted), and the result's placements
        entry["bytes_sent_per_call"] = sent
        entry["result_placements"] = placements
        path_ok = fallback_calls.get("fallback", 0) > 0 and fallback_calls.get("rule", 1) == 0
        raised = any(isinstance(c, str) for c in check.values())
        # every rank must take the same decision: the timing below runs collectives
        (ok,) = agreed([int(path_ok and not raised)], dist.ReduceOp.MIN)
        if not ok:
            if not raised:
                entry["error"] = (
                    "the fallback did not serve the op with its rule switched off "
                    f"(fallback calls per call: {fallback_calls})"
                )
            else:
                entry["error"] = next(c for c in check.values() if isinstance(c, str))
            out[name] = entry
            continue
        fns = {
            impl: (lambda a=placed_args(spec, values, True, maker(impl)), f=plain_op if impl == "plain" else op: f(*a))
            for impl in FALLBACK_IMPLS
        }
        collectives = dict(zip(FALLBACK_IMPLS, agreed([collectives[i] for i in FALLBACK_IMPLS], dist.ReduceOp.MAX)))
        solo = {impl: collectives[impl] == 0 for impl in fns}
        before = hs._C.dispatch_stats()
        counts, samples = time_interleaved(
            fns,
            solo,
            rank,
            args["sample_s"],
            args["repeats"],
            setting=rules_of,
            warm_first=True,
            calibration=calibrate_one_call if name in ONE_CALL_ROWS else calibrate,
        )
        after = hs._C.dispatch_stats()
        if rank != 0:
            continue  # rank 0 reports
        calls = after["fallback_calls"] - before["fallback_calls"]
        stats = {impl: summary(s) for impl, s in samples.items()}
        plain, rule, fallback = (stats[i]["median"] for i in FALLBACK_IMPLS)
        entry.update(
            {
                "plain_us": plain,
                "rule_us": rule,
                "fallback_us": fallback,
                "fallback_vs_rule": ratio(fallback, rule),
                "rule_vs_plain": ratio(rule, plain),  # the per-op overhead target: <= 1.2x
                "fallback_vs_plain": ratio(fallback, plain),
                # the same from each implementation's fastest sample (least disturbed by other load)
                "fallback_vs_rule_best": ratio(stats["fallback"]["min"], stats["rule"]["min"]),
                "rule_vs_plain_best": ratio(stats["rule"]["min"], stats["plain"]["min"]),
                # hypershard's count: global bytes of the non-Replicate inputs each fallback call gathered
                "fallback_bytes_per_call": ratio(after["fallback_bytes"] - before["fallback_bytes"], calls),
                "fallback_calls_while_timing": calls,
                # at least the timed calls went through the fallback (the rest: calibration, warm-up)
                "fallback_calls_timed": args["repeats"] * counts["fallback"],
                "samples_us": {impl: {"min": s["min"], "max": s["max"], "n": s["n"]} for impl, s in stats.items()},
                "calls_per_sample": counts,
                "collectives_per_call": collectives,
                "timed_on": {impl: "rank 0 alone" if solo[impl] else "every rank" for impl in fns},
                "seconds": time.perf_counter() - case_start,
            }
        )
        if calls < entry["fallback_calls_timed"]:
            entry["error"] = f"only {calls} fallback calls while timing {entry['fallback_calls_timed']} calls"
            entry["fallback_us"] = entry["fallback_vs_rule"] = entry["fallback_vs_rule_best"] = None
        out[name] = entry
    return out


def run_fallback(args: argparse.Namespace, log: Callable) -> dict:
    variants: dict = {}
    extra: dict = {}
    for world, r0 in rank0_per_world("fallback", fallback_worker, FALLBACK_WORLDS, args, log, extra).items():
        variants[f"{world}rank_shard"] = r0
    summaries = {}
    keys = ("fallback_vs_rule", "rule_vs_plain", "fallback_vs_rule_best", "rule_vs_plain_best")
    for v, ops in variants.items():
        # the exchange rows' rules run collectives that plain eager on the shard does not: they are
        # summarized apart, so the per-op overhead figure stays over rules that run on the shards
        rows = [r for n, r in ops.items() if "error" not in r and n not in EXCHANGE_ROWS]
        summaries[v] = {k: geomean([r[k] for r in rows]) for k in keys}
        rows = [r for n, r in ops.items() if "error" not in r and n in EXCHANGE_ROWS]
        summaries[v].update({f"exchange_{k}": geomean([r[k] for r in rows]) for k in keys})
        # bytes rank 0 sent per call, the rule's exchange / the fallback's gathers
        summaries[v]["exchange_sent_rule_vs_fallback"] = geomean(
            [ratio(r["bytes_sent_per_call"].get("rule"), r["bytes_sent_per_call"].get("fallback")) for r in rows]
        )
        summaries[v]["errors"] = {n: r["error"] for n, r in ops.items() if "error" in r}
    return {"variants": variants, "summary": summaries, "info": extra}
