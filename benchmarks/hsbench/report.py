"""bench/RESULTS.md: the markdown tables of every section that ran (also printed at the end of the
run), after a short summary of the project's targets."""

from __future__ import annotations

from .checkpoint import checkpoint_lines
from .common import geomean
from .compiled import compiled_lines
from .context_parallel import context_parallel_lines
from .dispatch import IMPL_NAMES
from .fully_shard import fully_shard_lines
from .grad_overlap import grad_overlap_lines
from .llamafactory_true_size import llamafactory_true_size_lines
from .pipelining import pipelining_lines
from .rotary import rotary_lines
from .training import STEP_MESHES
from .true_size import true_size_lines
from .user_rules import user_rules_lines

# The project's target for the per-op overhead of ops with rules: hypershard / plain eager
OVERHEAD_TARGET = 1.2


def _f(x, fmt="{:.2f}", none="—") -> str:
    if x is None:
        return none
    if isinstance(x, str):
        return x
    return fmt.format(x)


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [
        "# hypershard benchmark results",
        "",
        f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['cpus']} CPU cores, "
        f"{'--quick, ' if meta['quick'] else ''}run took {meta['seconds']:.0f} s on {meta['date']}. "
        "Every ratio compares implementations measured side by side in this run (medians of "
        "repeated samples; min–max in results.json).",
        "",
    ]
    lines += _target_lines(results.get("targets") or targets(results))
    d = results.get("dispatch")
    if d:
        lines += [
            "## Per-op dispatch overhead (µs per call, tiny tensors)",
            "",
            "ratio = hypershard / plain; speedup = torch DTensor / hypershard; "
            "overhead ratio = (torch DTensor − plain) / (hypershard − plain). "
            "Plain eager runs the op on the same local tensors each rank computes on. "
            "Boxed = hypershard with its typed fast path off (every op through the boxed fallback).",
            "",
            "| mesh | placements | op class | plain | hypershard | boxed | torch DTensor | ratio vs plain "
            "| speedup vs torch DTensor | overhead ratio |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for vkey, ops in d.get("variants", {}).items():
            world, place = vkey.split("rank_")
            for name, r in ops.items():
                bad = [
                    f"{IMPL_NAMES[i]} {'≠ one device' if c is False else 'raised: ' + str(c)[:80]}"
                    for i, c in r["matches_one_device"].items()
                    if c is not True
                ]
                coll = [
                    f"{IMPL_NAMES[i]} runs {n} collective{'s' if n > 1 else ''}"
                    for i, n in r.get("collectives_per_call", {}).items()
                    if n and i in IMPL_NAMES
                ]
                note = "".join(f" ⚠ {x}" for x in bad) + "".join(f" ({x})" for x in coll)
                plus = (
                    f" ({r['ratio_vs_plain_plus_collectives']:.2f}x vs plain + its bare collectives)"
                    if r.get("ratio_vs_plain_plus_collectives")
                    else ""
                )
                lines.append(
                    f"| {world} rank{'s' if world != '1' else ''} | {place} | {name}{note} "
                    f"| {_f(r['plain_us'])} | {_f(r['hypershard_us'])} | {_f(r.get('hypershard_boxed_us'))} "
                    f"| {_f(r['torch_dtensor_us'])} "
                    f"| {_f(r['ratio_vs_plain'], '{:.2f}x')}{plus} | {_f(r['speedup_vs_torch_dtensor'], '{:.1f}x')} "
                    f"| {_f(r['overhead_ratio_vs_torch_dtensor'], '{:.1f}x')} |"
                )
        lines += [
            "",
            "Geometric means over the op classes (medians; and from each implementation's fastest "
            "sample, the least disturbed by other load on the machine):",
            "",
            "| mesh, placements | ratio vs plain | speedup vs torch DTensor | overhead ratio "
            "| ratio vs plain (fastest) | speedup vs torch DTensor (fastest) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for vkey, g in d.get("summary", {}).items():
            lines.append(
                f"| {vkey.replace('rank_', ' rank, ')} | {_f(g['geomean_ratio_vs_plain'], '{:.2f}x')} "
                f"| {_f(g['geomean_speedup_vs_torch_dtensor'], '{:.2f}x')} "
                f"| {_f(g['geomean_overhead_ratio'], '{:.1f}x')} "
                f"| {_f(g['geomean_ratio_vs_plain_best'], '{:.2f}x')} "
                f"| {_f(g['geomean_speedup_vs_torch_dtensor_best'], '{:.2f}x')} |"
            )
        fam = {v: g.get("geomean_ratio_vs_plain_family_sample") for v, g in d.get("summary", {}).items()}
        if any(fam.values()):
            lines += [
                "",
                "Over the family sample alone (tril, gather, index_select_owned, cumsum, rfft, "
                "avg_pool2d, grouped_mm_colwise), ratio vs plain: "
                + ", ".join(f"{v.replace('rank_', ' rank, ')} {_f(x, '{:.2f}x')}" for v, x in fam.items())
                + ".",
            ]
        ex = {v: g.get("geomean_ratio_vs_plain_exchange") for v, g in d.get("summary", {}).items()}
        if any(ex.values()):
            lines += [
                "",
                "Over the exchanges along the sharded dim alone (cumsum_sharded, roll_sharded: an "
                "all-gather or all-to-all under Shard), ratio vs plain: "
                + ", ".join(f"{v.replace('rank_', ' rank, ')} {_f(x, '{:.2f}x')}" for v, x in ex.items())
                + ".",
            ]
        ref = d.get("info", {}).get("4rank_gloo_all_reduce_us")
        if ref:
            lines += [
                "",
                f"For scale: one bare gloo `all_reduce` of 2 floats over the 4 ranks takes "
                f"{ref['median']:.0f} µs here (min {ref['min']:.0f}, max {ref['max']:.0f}).",
            ]
        lines.append("")
    lines += _fallback_lines(results.get("fallback"))
    lines += rotary_lines(results.get("rotary"))
    lines += checkpoint_lines(results.get("checkpoint"))
    lines += fully_shard_lines(results.get("fully_shard"))
    lines += grad_overlap_lines(results.get("grad_overlap"))
    lines += context_parallel_lines(results.get("context_parallel"))
    lines += compiled_lines(results.get("compile"))
    lines += user_rules_lines(results.get("user_rules"))
    lines += true_size_lines(results.get("true_size"))
    lines += pipelining_lines(results.get("pipelining"))
    lines += llamafactory_true_size_lines(results.get("llamafactory_true_size"))
    s = results.get("step")
    if s:
        lines += [
            "## Training step, Qwen3 on 4 CPU ranks (s per step)",
            "",
            "AdamW + clip_grad_norm_; tiny model, global batch 4 × 32 tokens, unless the row says otherwise; "
            "the 4 ranks share the machine's cores, one device runs alone. Loss diff = max relative "
            "difference of every step's loss vs one device. hypershard reduces data-parallel gradients "
            "in buckets at the end of backward; *per-param* is hypershard with that off (each gradient "
            "reduced in its own hook). The torch DTensor baseline sums gradients with one all-reduce per "
            "parameter, *bucketed* with one per dtype over the flattened gradients. "
            "For scale: one bare gloo `all_reduce` of 16 KiB over the 4 ranks takes "
            + ", ".join(
                f"{r.get('gloo_all_reduce_16KiB_us', 0):.0f} µs ({k})" for k, r in s.items() if "error" not in r
            )
            + ".",
            "",
            "| run | hypershard | hypershard per-param | torch DTensor | torch DTensor bucketed | one device "
            "| speedup vs torch DTensor (bucketed) | buckets' gain | hypershard / one device "
            "| loss diff hypershard | loss diff torch DTensor |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for key, r in s.items():
            if "error" in r:
                lines.append(f"| {key} | failed: {r['error'][:100]} | | | | | | | | | |")
                continue
            err = "; ".join(f"{k}: {v}" for k, v in r["errors"].items())
            what = r["mesh"]
            if key not in STEP_MESHES:  # the compute-size run
                batch = r.get("global_batch") or ["?", "?"]
                what += f", {(r.get('parameters') or 0) / 1e6:.1f} M params, batch {batch[0]} × {batch[1]}"
            lines.append(
                f"| {what}{' ⚠ ' + err[:160] if err else ''} | {_f(r['hypershard_s'], '{:.4f}')} "
                f"| {_f(r.get('hypershard_per_param_s'), '{:.4f}')} "
                f"| {_f(r['torch_dtensor_s'], '{:.4f}')} | {_f(r.get('torch_dtensor_bucketed_s'), '{:.4f}')} "
                f"| {_f(r['single_device_s'], '{:.4f}')} "
                f"| {_f(r['speedup_vs_torch_dtensor'], '{:.2f}x')} "
                f"({_f(r.get('speedup_vs_torch_dtensor_bucketed'), '{:.2f}x')}) "
                f"| {_f(r.get('bucket_speedup'), '{:.2f}x')} "
                f"| {_f(r['hypershard_vs_single_device'], '{:.1f}x')} "
                f"| {_f(r.get('hypershard_loss_max_rel_diff_vs_single'), '{:.1e}')} "
                f"| {_f(r.get('torch_dtensor_loss_max_rel_diff_vs_single'), '{:.1e}')} |"
            )
        lines.append("")
    b = results.get("bytes")
    if b:
        lines += [
            "## Bytes sent per rank per training step (rank 0; max over ranks)",
            "",
            "| mesh | hypershard | collectives | torch DTensor | collectives | torch DTensor / hypershard |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for key, r in b.items():
            lines.append(
                f"| {key} | {_f(r['hypershard'], '{:,}')} ({_f(r['hypershard_max_over_ranks'], '{:,}')}) "
                f"| {_f(r['hypershard_collectives'], '{}')} "
                f"| {_f(r['torch_dtensor'], '{:,}')} ({_f(r['torch_dtensor_max_over_ranks'], '{:,}')}) "
                f"| {_f(r['torch_dtensor_collectives'], '{}')} "
                f"| {_f(r['torch_dtensor_to_hypershard'], '{:.2f}x')} |"
            )
        lines.append("")
    m = results.get("memory")
    if m:
        cfg = results["meta"]["memory_config"]
        lines += [
            f"## Memory per rank (Qwen3 hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}, "
            f"vocab {cfg['vocab_size']}, {cfg['num_hidden_layers']} layers; MB, max over ranks)",
            "",
            f"peak = growth of peak RSS over {results['meta']['settings']['memory_steps']} training steps "
            "after the model is built; "
            "state = parameters + gradients + AdamW states held by the rank.",
            "",
            "| mesh | hypershard peak | torch DTensor peak | one device peak | hypershard state "
            "| torch DTensor state | one device state | hypershard / one device (peak, state) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for key in STEP_MESHES:
            r = m.get(key)
            if not r:
                continue
            errs = "; ".join(f"{k}: {v}" for k, v in r.items() if k.endswith("_error"))
            lines.append(
                f"| {r['mesh']}{' ⚠ ' + errs[:160] if errs else ''} | {_f(r.get('hypershard_peak_mb'), '{:.1f}')} "
                f"| {_f(r.get('torch_dtensor_peak_mb'), '{:.1f}')} | {_f(r.get('single_device_peak_mb'), '{:.1f}')} "
                f"| {_f(r.get('hypershard_state_mb'), '{:.1f}')} | {_f(r.get('torch_dtensor_state_mb'), '{:.1f}')} "
                f"| {_f(r.get('single_device_state_mb'), '{:.1f}')} "
                f"| {_f(r.get('hypershard_peak_vs_single'), '{:.2f}x')}, "
                f"{_f(r.get('hypershard_state_vs_single'), '{:.2f}x')} |"
            )
        lines.append("")
    c = results.get("rule_cache")
    if c:
        lines += [
            "## hypershard rule cache over training steps (rank 0)",
            "",
            "| mesh | ops per step | hit rate, first step | hit rate, warm step | plans after 1 step "
            "| plans after N steps | N | bounded | interned layouts (1 → N) |",
            "|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for key, r in c.items():
            lines.append(
                f"| {key} | {r['calls_per_step']} | {_f(r['hit_rate_first_step'], '{:.1%}')} "
                f"| {_f(r['hit_rate_warm_step'], '{:.2%}')} | {r['entries_after_1_step']} "
                f"| {r['entries_after_steps']} | {r['steps']} | {'yes' if r['bounded'] else 'NO'} "
                f"| {r['interned_layouts_after_1_step']} → {r['interned_layouts_after_steps']} |"
            )
        lines.append("")
    return "\n".join(lines)


def targets(results: dict) -> dict:
    """The two figures the project sets targets for, gathered from the sections that ran: the
    per-op overhead of ops with rules (hypershard / plain eager, <= OVERHEAD_TARGET) and the
    fallback's cost against a native rule (fallback / rule; no target, reported)."""
    out: dict = {"per_op_overhead_target": OVERHEAD_TARGET}
    d = results.get("dispatch")
    if d:
        out["dispatch_geomean_ratio_vs_plain"] = {v: g["geomean_ratio_vs_plain"] for v, g in d["summary"].items()}
        # an op class that needs collectives cannot come near plain eager, which needs none
        out["dispatch_geomean_ratio_vs_plain_without_collectives"] = {
            v: geomean(
                [r["ratio_vs_plain"] for r in ops.values() if not r.get("collectives_per_call", {}).get("hypershard")]
            )
            for v, ops in d.get("variants", {}).items()
        }
    f = results.get("fallback")
    if f:
        out["fallback_section_rule_vs_plain"] = {v: g["rule_vs_plain"] for v, g in f["summary"].items()}
        out["fallback_vs_rule"] = {v: g["fallback_vs_rule"] for v, g in f["summary"].items()}
    return out


def _times(x) -> str:
    """A ratio that may be anything from ~1 to thousands: one decimal below 10."""
    return _f(x, "{:.1f}x" if x is not None and x < 10 else "{:.0f}x")


def _variant_text(key: str) -> str:
    world, _, place = key.partition("rank")
    return f"{world} rank{'s' if world != '1' else ''}{',' + place.replace('_', ' ') if place else ''}"


def _target_lines(t: dict) -> list:
    def row(values: dict, fmt) -> str:  # fmt None: _times
        return "; ".join(f"{_variant_text(k)} {_f(v, fmt) if fmt else _times(v)}" for k, v in values.items()) or "—"

    lines = []
    if "dispatch_geomean_ratio_vs_plain" in t:
        lines.append(
            f"- per-op overhead, hypershard / plain eager (target ≤ {t['per_op_overhead_target']:.1f}×), "
            "geometric mean over the dispatch op classes: "
            f"{row(t['dispatch_geomean_ratio_vs_plain'], '{:.2f}x')}; over those that need no collective: "
            f"{row(t['dispatch_geomean_ratio_vs_plain_without_collectives'], '{:.2f}x')}"
        )
    if "fallback_vs_rule" in t:
        lines.append(
            f"- per-op overhead of the fallback section's ops on their rules, hypershard / plain eager "
            f"(target ≤ {t['per_op_overhead_target']:.1f}×), geometric mean (the exchange rows, whose "
            "rules run collectives, apart): "
            f"{row(t['fallback_section_rule_vs_plain'], '{:.2f}x')}"
        )
        lines.append(
            f"- the fallback's cost, fallback / rule (geometric mean over the same ops): "
            f"{row(t['fallback_vs_rule'], None)}"
        )
    return ["## Targets", "", *lines, ""] if lines else []


def _fallback_lines(f) -> list:
    if not f:
        return []
    lines = [
        "## Fallback vs native rule (µs per call; tiny sharded tensors, the indexing, triangular, grouped and "
        "exchange rows at realistic sizes)",
        "",
        "Ops that have a distributed rule, timed side by side: on their rule (local shards), through "
        "the fallback with the rule switched off (`_C.set_rule_enabled(op, False)`: inputs gathered to "
        "Replicate, the op computed on the global values, outputs Replicate) and plain eager on the "
        "local shard. Gathered = the global bytes of the sharded inputs one fallback call gathered "
        '(`dispatch_stats()["fallback_bytes"]`); collectives = those one fallback call issued; sent = the '
        "bytes rank 0 sent in one call's collectives (`_C.traffic()`), rule / fallback.",
        "",
        f"| mesh | op | plain | rule | fallback | rule / plain (≤ {OVERHEAD_TARGET:.1f}×) | fallback / rule "
        "| gathered bytes per call | collectives per call | sent bytes per call, rule / fallback |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for vkey, ops in f.get("variants", {}).items():
        for name, r in ops.items():
            bad = [
                f"{impl} {'≠ one device' if c is False else 'raised: ' + str(c)[:80]}"
                for impl, c in r.get("matches_one_device", {}).items()
                if c is not True
            ]
            if "error" in r:
                bad.append(r["error"][:120])
            note = "".join(f" ⚠ {x}" for x in bad)
            lines.append(
                f"| {_variant_text(vkey)} | {name} (`{', '.join(r.get('rules_switched_off', []))}`){note} "
                f"| {_f(r.get('plain_us'))} | {_f(r.get('rule_us'))} | {_f(r.get('fallback_us'))} "
                f"| {_f(r.get('rule_vs_plain'), '{:.2f}x')} | {_times(r.get('fallback_vs_rule'))} "
                f"| {_f(r.get('fallback_bytes_per_call'), '{:,.0f}')} "
                f"| {_f(r.get('collectives_per_call', {}).get('fallback'), '{}')} "
                f"| {_f(r.get('bytes_sent_per_call', {}).get('rule'), '{:,.0f}')} / "
                f"{_f(r.get('bytes_sent_per_call', {}).get('fallback'), '{:,.0f}')} |"
            )
    lines += [
        "",
        "Geometric means over the ops (medians; and from each implementation's fastest sample); "
        "*exchange* = over the rows whose rule exchanges slices along the sharded dim (cumsum, roll, "
        "flip, slice, the causal conv1d), the others = over the rest:",
        "",
        "| mesh | rows | rule / plain | fallback / rule | rule / plain (fastest) | fallback / rule (fastest) "
        "| sent bytes, rule / fallback |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for vkey, g in f.get("summary", {}).items():
        for rows, p in (("others", ""), ("exchange", "exchange_")):
            if rows == "exchange" and g.get("exchange_fallback_vs_rule") is None:
                continue  # a results.json without exchange rows stays readable
            lines.append(
                f"| {_variant_text(vkey)} | {rows} | {_f(g[p + 'rule_vs_plain'], '{:.2f}x')} "
                f"| {_times(g[p + 'fallback_vs_rule'])} | {_f(g[p + 'rule_vs_plain_best'], '{:.2f}x')} "
                f"| {_times(g[p + 'fallback_vs_rule_best'])} "
                f"| {_f(g.get('exchange_sent_rule_vs_fallback') if p else None, '{:.3f}x')} |"
            )
    for key, err in f.get("info", {}).items():
        if key.endswith("_error"):
            lines.append(f"\n⚠ {key}: {err[:300]}")
    lines.append("")
    return lines
