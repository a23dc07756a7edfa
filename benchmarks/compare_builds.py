"""Per-op dispatch overhead of two hypershard checkouts, side by side in one run.

A refactor must not make per-op dispatch slower. This runs `benchmarks/run.py --sections dispatch`
of each checkout with that checkout's own .venv, alternating before/after `--rounds` times (so that
the machine's load drifts over both alike), and prints, per mesh variant, the geometric mean of
hypershard's time over plain eager's (measured interleaved in the same processes, the dispatch
section's own ratio) over the ops both checkouts time, the median over rounds, and after/before.

    .venv/bin/python benchmarks/compare_builds.py --before ../old-checkout --after . [--rounds 2]

Each checkout needs `make setup` first. Results go to --out (default bench/compare_builds.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_dispatch(checkout: Path, out: Path, quick: bool, timeout: int) -> dict:
    cmd = [
        str(checkout / ".venv" / "bin" / "python"),
        str(checkout / "benchmarks" / "run.py"),
        "--sections",
        "dispatch",
        "--out",
        str(out),
    ] + (["--quick"] if quick else [])
    subprocess.run(cmd, cwd=checkout, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())["dispatch"]["variants"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="the checkout before the change")
    parser.add_argument("--after", default=ROOT, type=Path, help="the checkout after it (default: this one)")
    parser.add_argument("--rounds", type=int, default=2, help="before/after pairs, alternating (default 2)")
    parser.add_argument("--quick", action="store_true", help="the dispatch section's --quick sampling")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per dispatch run (default 900)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "compare_builds.json")
    args = parser.parse_args(argv)
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, checkout in checkouts.items():
        if not (checkout / ".venv" / "bin" / "python").exists():
            parser.error(f"--{name} {checkout}: no .venv (run make setup there first)")
    runs: dict = {"before": [], "after": []}
    for round_index in range(args.rounds):
        for name, checkout in checkouts.items():
            print(f"round {round_index + 1}/{args.rounds}: dispatch section of {name} ({checkout})", flush=True)
            out = args.out.parent / f"compare_builds_{name}_{round_index}"
            runs[name].append(run_dispatch(checkout, out, args.quick, args.timeout))
    metric = "ratio_vs_plain"
    table = {}
    for variant in runs["after"][0]:
        # the ops both checkouts time (a newer section may time more)
        ops = set.intersection(*(set(r.get(variant, {})) for r in runs["before"] + runs["after"]))
        if not ops:
            continue

        def geomean_ratio(run: dict) -> float:
            return statistics.geometric_mean(run[variant][op][metric] for op in ops)

        before_rounds = [geomean_ratio(r) for r in runs["before"]]
        after_rounds = [geomean_ratio(r) for r in runs["after"]]
        before, after = statistics.median(before_rounds), statistics.median(after_rounds)
        table[variant] = {
            "ops": len(ops),
            "before": before,
            "after": after,
            "after_over_before": after / before,
            "before_rounds": before_rounds,
            "after_rounds": after_rounds,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"checkouts": {k: str(v) for k, v in checkouts.items()}, "metric": metric, "variants": table}, indent=2
        )
    )
    print(f"\nhypershard µs / plain eager µs, geometric mean over the ops both time, median of {args.rounds} rounds")
    print(f"{'variant':<18} {'ops':>4} {'before':>8} {'after':>8} {'after/before':>13}")
    for variant, row in table.items():
        print(
            f"{variant:<18} {row['ops']:>4} {row['before']:>8.3f} {row['after']:>8.3f} {row['after_over_before']:>13.3f}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
