"""bench/results.png: a 2 x 3 chart (dispatch speedups and ratios, step times, bytes, memory,
rule cache), 2 x 4 when the rotary section ran (its time and peak-memory ratios in the last column)."""

from __future__ import annotations

import math
from pathlib import Path

from .training import STEP_MESHES


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rotary = (results.get("rotary") or {}).get("variants")
    fig, axes = plt.subplots(2, 4 if rotary else 3, figsize=(23 if rotary else 17, 9), dpi=100)
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
        bars(
            ax,
            "speedup_vs_torch_dtensor",
            "torch DTensor µs / hypershard µs (log)",
            "dispatch: speedup vs torch DTensor",
        )
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * 6)  # room for the legend
        ax.legend(fontsize=7, loc="upper center", ncol=4)
        bars(axes[0][1], "ratio_vs_plain", "hypershard µs / plain µs (log)", "dispatch: hypershard vs plain eager")
        axes[0][1].legend(fontsize=7)
    s = results.get("step", {})
    ax = axes[0][2]
    impls = [
        ("hypershard", "hypershard"),
        ("hypershard_per_param", "hypershard per-param grads"),
        ("torch_dtensor", "torch DTensor"),
        ("torch_dtensor_bucketed", "torch DTensor bucketed"),
        ("single_device", "one device"),
    ]
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
    bars = [
        ("hypershard_peak_mb", "hypershard peak"),
        ("torch_dtensor_peak_mb", "torch DTensor peak"),
        ("single_device_peak_mb", "one device peak"),
        ("hypershard_state_mb", "hypershard state"),
        ("single_device_state_mb", "one device state"),
    ]
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
    if rotary:
        _rotary_panels(axes[0][3], axes[1][3], rotary)
    fig.suptitle(f"hypershard benchmarks (torch {results['meta']['torch']}, {results['meta']['cpus']} CPU cores)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _rotary_panels(top, bottom, variants: dict) -> None:
    """Fused / composed per configuration and variant: time (top) and peak extra memory (bottom)."""
    keys = [k for k in next(iter(variants.values())).keys()]
    labels = [
        k.replace("mode", "m")
        .replace("float32", "f32")
        .replace("bfloat16", "bf16")
        .replace("_forward_backward", " f+b")
        .replace("_forward", " fwd")
        .replace("_", " ")
        for k in keys
    ]
    width = 0.8 / max(len(variants), 1)
    for ax, key, ylabel, title in (
        (top, "fused_vs_composed", "fused ms / composed ms (log)", "rotary: fused op vs composed form, time"),
        (
            bottom,
            "peak_fused_vs_composed",
            "fused MB / composed MB (log)",
            "rotary: fused vs composed, peak extra memory",
        ),
    ):
        for i, (vkey, entries) in enumerate(variants.items()):
            vals = [(entries.get(k) or {}).get(key) or math.nan for k in keys]
            ax.bar(
                [x + i * width for x in range(len(keys))],
                vals,
                width,
                label=vkey.replace("1device", "1 device").replace("2rank_", "2 ranks, "),
            )
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))])
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.axhline(1, color="k", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
