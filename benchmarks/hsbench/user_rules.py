"""Section "user_rules": what a rule registered from Python (hs.register_rule) costs per call against
a native rule: aten::_int_mm (a C++ kernel hypershard has no rule for) given "mk,kn->mn" from
Python, and aten::mm with its native rule, [32, 8] Shard(0) @ [8, 8] Replicate on 1 and 2 ranks,
each timed on DTensors and as plain eager on the local shards (aten::mm also with the typed fast
path off). hypershard's overhead is DTensor time minus plain time, per op; a registered rule
should cost what a native one does (both plans live in the C++ plan cache; both ops take the
typed fast path). Every call runs in inference mode."""

from __future__ import annotations

import argparse
from typing import Callable

from .common import geomean, rank0_per_world, ratio, summary
from .timing import calibrate, time_interleaved

USER_RULE_WORLDS = (1, 2)
IMPLS = ("plain_native", "native", "native_boxed", "plain_user", "user")


def _user_mm():
    """aten::_int_mm (int8 x int8 -> int32, a C++ kernel that hypershard has no rule for), given the
    rule "mk,kn->mn" from Python: the op's own cost is a C++ kernel's, as aten::mm's is, so the two
    overheads compare hypershard's paths alone (a custom op's Python kernel would dominate both)."""
    import torch

    import hypershard as hs

    op = torch.ops.aten._int_mm.default
    if "aten::_int_mm" not in hs._C.rule_names():
        hs.register_rule(op, "mk,kn->mn", linear=True)
    return op


def user_rules_worker(rank: int, world: int, args: dict) -> dict:
    import torch

    import hypershard as hs

    user_mm = _user_mm()
    mesh = hs.init_device_mesh("cpu", (world,), ("x",))
    g = torch.Generator().manual_seed(0)
    a_full, b = torch.randn(32, 8, generator=g), torch.randn(8, 8, generator=g)
    ai_full, bi = (
        torch.randint(-8, 8, (32, 8), dtype=torch.int8, generator=g),
        torch.randint(-8, 8, (8, 8), dtype=torch.int8, generator=g),
    )
    a_local, ai_local = a_full.chunk(world, 0)[rank].clone(), ai_full.chunk(world, 0)[rank].clone()
    a, ai = (hs.distribute_tensor(t, mesh, [hs.Shard(0)]) for t in (a_full, ai_full))
    bd, bid = (hs.distribute_tensor(t, mesh, [hs.Replicate()]) for t in (b, bi))
    fns = {
        "plain_native": lambda: torch.mm(a_local, b),
        "native": lambda: torch.mm(a, bd),
        "native_boxed": lambda: torch.mm(a, bd),  # the typed fast path off (setting below)
        "plain_user": lambda: user_mm(ai_local, bi),
        "user": lambda: user_mm(ai, bid),
    }
    same = torch.equal(user_mm(ai, bid).full_tensor(), user_mm(ai_full, bi))
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
        "user_plans_before_after": [before.get("aten::_int_mm"), plans.get("aten::_int_mm")],
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
        "| mesh | plain mm | mm | mm, boxed | plain _int_mm | _int_mm | overhead mm | overhead mm boxed "
        "| overhead _int_mm | registered / native | registered / native boxed |",
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
