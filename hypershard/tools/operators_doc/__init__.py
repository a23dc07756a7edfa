"""python -m hypershard.tools.operators_doc [--check] [--out docs/operators.md]

Writes docs/operators.md from the operator registry: every op with a distributed rule
(hypershard._C.rule_registrations()), grouped by family, each family with the header comment of
its csrc/ops/<family>.cpp, and per op what its rule plans for three layouts of the op's first
tensor argument on a 2-rank mesh: Shard(0), Shard(last dim) and Partial(sum). The layouts are
PROBED: the rule runs (hypershard.testing.planning, no processes) on arguments shaped like a real
call of the op, traced from PyTorch's OpInfo samples (forward, in-place variant and backward),
from a few calls of hypershard's own ops and the fused optimizers, and from calls written out for
ops no trace reaches; an overload no call reaches borrows a sibling's call (add.Tensor's
arguments for add_.Tensor and add.out) where the schema takes them. The output is deterministic
(sorted, no times, no paths), so a test regenerates it and compares it with the checked-in file;
--check does the same and exits 1 when the file is stale.

Modules, in the order the generator uses them:
  registrations  what the registry exports: per op its family, key mode, table or tag
  calls          a call as the document sees it (TensorMeta for tensors) and shared helpers
  tracing        TorchDispatchMode recording of eager code; OpInfo samples as that code
  hand_table     code and calls written out for ops no OpInfo sample reaches
  samples        collect_samples: every call per op, traced and written out
  siblings       an overload no call reaches borrows a sibling overload's call
  probing        the rule planned on Shard(0) / Shard(last) / Partial(sum); a Row per op
  cuda_trace     the ops a training step reaches on CUDA and not on CPU (testing.cuda_lowering)
  rendering      the markdown: introduction, summary, the ops reached on CUDA, per-family comment
                 and tables
  staleness      the checked-in file against a fresh generation
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .calls import Call, TensorMeta, op_key, resolve
from .probing import PROBES, Probe, Prober, Row, probe_rules
from .registrations import registrations, registry, tagged_pointwise
from .rendering import document, family_header, render
from .samples import collect_samples
from .siblings import sibling_calls
from .staleness import DEFAULT_OUT, STALE, check

__all__ = [
    "Call",
    "DEFAULT_OUT",
    "PROBES",
    "Probe",
    "Prober",
    "Row",
    "STALE",
    "TensorMeta",
    "check",
    "collect_samples",
    "document",
    "family_header",
    "generate",
    "main",
    "op_key",
    "probe_rules",
    "registrations",
    "registry",
    "render",
    "resolve",
    "sibling_calls",
    "tagged_pointwise",
]


def generate() -> str:
    rules = registry()
    return render(rules, collect_samples(op for op, _ in rules))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hypershard.tools.operators_doc", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument(
        "--out", default=str(DEFAULT_OUT), help="the file to write or check (default docs/operators.md)"
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when --out differs from a fresh run"
    )
    args = parser.parse_args(argv)
    text = generate()
    out = Path(args.out)
    if args.check:
        problem = check(text, out)
        print(problem or f"{args.out} is current")
        return 1 if problem else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {args.out}")
    return 0
