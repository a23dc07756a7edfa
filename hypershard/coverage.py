"""python -m hypershard.coverage --model qwen3 --mesh dp=2,tp=2

Runs forward, loss, backward, clip_grad_norm_ and an AdamW step of a tiny HuggingFace model
(random weights, no hub) parallelized on a CPU mesh of local ranks, and lists every ATen op that
reached hypershard with its call count and whether a rule or the fallback served it. The run
is in default (not strict) mode, so ops without a rule run through the fallback (inputs gathered
to Replicate) and one run lists all of them. Exits 1 when any op was served by the fallback, or
when the distributed losses differ from the single-device run.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from .launch import mesh_size, parse_mesh, spawn_local_ranks


def parse_overrides(items: list) -> dict:
    out = {}
    for item in items or []:
        key, _, value = item.partition("=")
        out[key] = json.loads(value) if value[:1] in "[{0123456789-tfn" and value not in ("", ) else value
    return out


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    import hypershard as hs
    from hypershard.models import make_batches, tiny_config, tiny_model, train
    from hypershard.parallel import parallelize

    shape, names = args.mesh
    mesh = hs.init_device_mesh("cpu", shape, names)
    config = tiny_config(args.model, **parse_overrides(args.config))
    batches = make_batches(config.vocab_size, args.steps, batch=args.batch, seq=args.seq)
    reference = train(tiny_model(config), batches)
    for op in args.without_rule or []:
        hs._C.set_rule_enabled(op, False)
    hs._C.reset_op_counts()
    hs._C.reset_dispatch_stats()
    error = None
    with hs.strict(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warnings: the report lists those ops
        try:
            losses = train(parallelize(tiny_model(config), mesh), batches)
        except Exception as exc:  # reported, then the exit code says it failed
            losses, error = None, f"{type(exc).__name__}: {exc}"
    return {"ops": hs._C.op_counts(), "reference": reference, "losses": losses, "error": error,
            "fallback_bytes": hs._C.dispatch_stats()["fallback_bytes"],
            "implicit_calls": hs._C.dispatch_stats()["implicit_calls"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hypershard.coverage", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3", help="transformers model_type with a tiny config (default qwen3)")
    parser.add_argument("--mesh", type=parse_mesh, default=parse_mesh("dp=2,tp=2"),
                        help="mesh axes and sizes, e.g. dp=2,tp=2 (tp uses the model's own TP plan)")
    parser.add_argument("--config", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. intermediate_size=66")
    parser.add_argument("--steps", type=int, default=1, help="training steps (default 1)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--timeout", type=int, default=120, help="collective timeout in seconds")
    parser.add_argument("--launch-timeout", type=float, default=900,
                        help="seconds before stuck ranks are reported and killed (default 900)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--without-rule", action="append", metavar="OP",
                        help="run as if OP (e.g. aten::_grouped_mm) had no rule: the fallback serves it "
                             "(to see what the fallback costs, or to test this tool); repeatable")
    args = parser.parse_args(argv)

    report = spawn_local_ranks(_rank, mesh_size(args.mesh[0]), args, timeout=args.launch_timeout,
                               pg_timeout=args.timeout)[0]

    ops = report["ops"]
    fallback = [name for name, _, has_rule in ops if not has_rule]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        mesh_text = ",".join(f"{n}={s}" for s, n in zip(*args.mesh))
        print(f"hypershard coverage: {args.model} on mesh {mesh_text}, {args.steps} step(s): forward, loss, "
              f"backward, clip_grad_norm_, AdamW")
        print(f"{'op':58s} {'calls':>6s}  rule")
        for name, calls, has_rule in ops:
            print(f"{name:58s} {calls:6d}  {'yes' if has_rule else 'FALLBACK'}")
        print(f"{len(ops)} ops reached, {len(ops) - len(fallback)} with a rule, {len(fallback)} served by the "
              f"fallback (rank 0 gathered {report['fallback_bytes']} bytes for them); "
              f"{report['implicit_calls']} calls whose rule refused the inputs' layouts ran on implicitly "
              f"redistributed ones")
        if report["error"]:
            print(f"the distributed run failed: {report['error']}")
        elif report["losses"] is not None:
            diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(report["losses"], report["reference"])]
            print("loss per step (distributed / single device): " + ", ".join(
                f"{a:.6f}/{b:.6f}" for a, b in zip(report["losses"], report["reference"])) +
                f"; max relative difference {max(diffs):.2e}")
    losses_ok = report["losses"] is not None and all(
        abs(a - b) <= 1e-5 * max(abs(b), 1e-12) for a, b in zip(report["losses"], report["reference"]))
    return 0 if not fallback and losses_ok and not report["error"] else 1


if __name__ == "__main__":
    sys.exit(main())
