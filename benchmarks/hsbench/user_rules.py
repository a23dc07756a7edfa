"""Section "user_rules": what a rule registered from Python (hs.register_rule) costs per call against
a native rule. The same product, [8, 8] Shard(0) @ [8, 8] Replicate on 1 and 2 ranks: a custom op
`hsbench::mm` (torch.library.custom_op around torch.mm) with the factor rule "mk,kn->mn", and
aten::mm with its native rule, each timed on DTensors and as plain eager on the local shards.
hypershard's overhead is DTensor time over plain time, per op; a registered rule should cost what a
native one does, since both plans live in the C++ plan cache (the user op also goes through the
boxed path: the typed fast path is for ATen ops, so aten::mm is also timed with the fast path off). The custom op's own plain call is slower than
aten::mm's (its kernel is a Python function): the comparison is of the overheads, not the calls."""

from __future__ import annotations

import argparse
from typing import Callable

from .common import geomean, rank0_per_world, ratio, summary
from .timing import calibrate, time_interleaved

USER_RULE_WORLDS = (1, 2)
IMPLS = ("plain_native", "native", "native_boxed", "plain_user", "user")


def _user_mm():
    import torch

    import hypershard as hs

    # the schema spelled out: this module's annotations are strings (from __future__ import annotations)
    @torch.library.custom_op("hsbench::mm", mutates_args=(), schema="(Tensor a, Tensor b) -> Tensor")
    def mm(a, b):
        return torch.mm(a, b)

    @mm.register_fake
    def _(a, b):
        return a.new_empty(a.shape[0], b.shape[1])

    hs.register_rule(mm, "mk,kn->mn", linear=True)
    return mm


def user_rules_worker(rank: int, world: int, args: dict) -> dict:
    import torch

    import hypershard as hs

    user_mm = _user_mm()
    mesh = hs.init_device_mesh("cpu", (world,), ("x",))
    a_full, b = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), torch.randn(8, 8)
    a_local = a_full.chunk(world, 0)[rank].clone()
    a = hs.distribute_tensor(a_full, mesh, [hs.Shard(0)])
    bd = hs.distribute_tensor(b, mesh, [hs.Replicate()])
    fns = {
        "plain_native": lambda: torch.mm(a_local, b),
        "native": lambda: torch.mm(a, bd),
        "native_boxed": lambda: torch.mm(a, bd),  # the typed fast path off (setting below)
        "plain_user": lambda: user_mm(a_local, b),
        "user": lambda: user_mm(a, bd),
    }
    same = torch.equal(user_mm(a, bd).full_tensor(), torch.mm(a, bd).full_tensor())
    before = dict(hs._C.cached_op_plans())
    counts, samples = time_interleaved(
        fns, {i: True for i in fns}, rank, args["sample_s"], args["repeats"], calibration=calibrate
    )
    plans = dict(hs._C.cached_op_plans())
    if rank != 0:
        return {}
    stats = {impl: summary(s) for impl, s in samples.items()}
    med = {impl: stats[impl]["median"] for impl in IMPLS}
    return {
        "results_equal": bool(same),
        "us": med,
        "native_vs_plain": ratio(med["native"], med["plain_native"]),
        "user_vs_plain": ratio(med["user"], med["plain_user"]),
        # hypershard's own time per call on top of the plain call, user op over native op
        "overhead_us": {
            "native": med["native"] - med["plain_native"],
            "native_boxed": med["native_boxed"] - med["plain_native"],
            "user": med["user"] - med["plain_user"],
        },
        "user_overhead_vs_native": ratio(med["user"] - med["plain_user"], med["native"] - med["plain_native"]),
        # against the same boxed path: what the registered rule itself costs
        "user_overhead_vs_native_boxed": ratio(
            med["user"] - med["plain_user"], med["native_boxed"] - med["plain_native"]
        ),
        # the registered op's plan was made once, before timing, and every timed call hit it
        "user_plans_before_after": [before.get("hsbench::mm"), plans.get("hsbench::mm")],
        "calls_per_sample": counts,
    }


def run_user_rules(args: argparse.Namespace, log: Callable) -> dict:
    extra: dict = {}
    variants = {
        f"{world}rank": r0
        for world, r0 in rank0_per_world("user_rules", user_rules_worker, USER_RULE_WORLDS, args, log, extra).items()
    }
    summary_ = {
        k: geomean([v[k] for v in variants.values()])
        for k in ("user_overhead_vs_native", "user_overhead_vs_native_boxed")
    }
    return {"variants": variants, "summary": summary_, "info": extra}


def _num(value, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def user_rules_lines(section) -> list:
    """RESULTS.md's table for this section (empty when it did not run)."""
    if not section:
        return []
    lines = [
        "## A rule registered from Python vs a native rule (µs per call)",
        "",
        '[8, 8] Shard(0) @ [8, 8] Replicate: a custom op with `hs.register_rule(op, "mk,kn->mn")` and '
        "aten::mm, on DTensors and as plain eager on the local shard. Overhead = DTensor − plain.",
        "",
        "| mesh | plain mm | mm | mm, boxed | plain user op | user op | overhead mm | overhead mm boxed "
        "| overhead user op | user / native | user / native boxed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in section.get("variants", {}).items():
        us, over = v["us"], v["overhead_us"]
        cells = [us["plain_native"], us["native"], us["native_boxed"], us["plain_user"], us["user"]]
        cells += [over["native"], over["native_boxed"], over["user"]]
        ratios = [v["user_overhead_vs_native"], v["user_overhead_vs_native_boxed"]]
        lines.append(
            f"| {name} | "
            + " | ".join(_num(c, 1) for c in cells)
            + " | "
            + " | ".join(_num(r, 2) for r in ratios)
            + " |"
        )
    for name, error in section.get("info", {}).items():
        if name.endswith("_error"):
            lines.append(f"\n{name}: {error}")
    return lines + [""]
