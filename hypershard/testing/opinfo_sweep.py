"""python -m hypershard.testing.opinfo_sweep [--world 2] [--samples 3] [--strict] [--ops add,mm] [--json FILE]
    [--variants replicate,sharded,grad,sharded_2d]

PyTorch's own operator catalogue (OpInfo op_db, float32 CPU samples) on hypershard DTensors, as
torch's test/distributed/tensor/test_dtensor_ops.py does for torch's DTensor: every tensor of a
sample becomes a DTensor, once Replicate and once sharded on its largest dim (uneven shards
included), the op runs, and its outputs (gathered) are compared with the same op on plain
tensors. Each (op, variant) is "passed" (every sample matched), "wrong" (some output differs:
a silently wrong result), "error" (the op raised) or "skipped" (no float32 CPU sample). The
"grad" variant (hypershard.testing.opinfo_grad) compares the input gradients of the ops that
support autograd instead, inputs sharded; "sharded_2d" runs the forward on a 2-D mesh (--world 4:
2 x 2), two dims sharded (or one, over both axes). Default mode counts what the fallback and the rules
compute together; --strict counts native rules only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import warnings

from .opinfo_common import (
    ALL_VARIANTS,
    GRAD_VARIANT,
    MESH_2D_VARIANT,
    UNINITIALIZED,
    VARIANTS,
    compare,
    describe,
    distribute,
    fresh_copy,
    gather,
    op_key,
)
from .opinfo_grad import run_grad_op

PASSING_HEADER = """\
# (op|variant) pairs of PyTorch's OpInfo catalogue that hypershard computes correctly in {mode}
# (written by python -m hypershard.testing.opinfo_sweep --write-passing); the level0 OpInfo test
# checks that every pair listed still passes: the list may only grow.
"""


def _catalogue(names: set | None) -> list:
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]
    if names:
        ops = [op for op in ops if op_key(op) in names or op.name in names]
    return ops


def _run_op(op, mesh, variant: str, samples: int) -> tuple[str, str]:
    import torch

    count = 0
    # OpInfo draws its samples at random: drawn before anything runs, so every rank has the same
    # ones whatever the ops in between draw (rules for random ops draw per shard).
    torch.manual_seed(0)
    drawn = list(itertools.islice(op.sample_inputs("cpu", torch.float32, requires_grad=False), 2 * samples))
    for sample in drawn:
        if count >= samples:
            break
        count += 1
        torch.manual_seed(count)
        # Both runs see the same fresh contiguous copies (a sample may be a view into a larger
        # storage, which a DTensor's local never is).
        plain_args, plain_kwargs = fresh_copy([sample.input, *sample.args]), fresh_copy(dict(sample.kwargs))
        try:
            expected = op(*fresh_copy(plain_args), **fresh_copy(plain_kwargs))
        except Exception:  # noqa: BLE001 -- a sample torch itself rejects on one device
            count -= 1
            continue
        torch.manual_seed(count)
        try:
            args = distribute(plain_args, mesh, variant)
            kwargs = distribute(plain_kwargs, mesh, variant)
            got = gather(op(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 -- the sweep records what raised
            return "error", describe(exc)
        try:
            compare(got, expected, values=op.name not in UNINITIALIZED)
        except AssertionError as exc:
            return "wrong", str(exc).strip().splitlines()[0][:300]
    return ("passed", "") if count else ("skipped", "no float32 CPU sample")


def sweep_rank(
    rank: int,
    world: int,
    names: list | None,
    samples: int,
    strict: bool,
    verbose: bool = False,
    variants: tuple = VARIANTS,
) -> dict:
    import hypershard as hs

    warnings.simplefilter("ignore")
    hs.set_strict(strict)
    mesh = hs.init_device_mesh("cpu", (world,), ("dp",))
    mesh_2d = None
    if MESH_2D_VARIANT in variants:
        if world < 4 or world % 2:
            raise ValueError(
                f"opinfo_sweep: the {MESH_2D_VARIANT} variant needs an even world of at least 4, not {world}"
            )
        mesh_2d = hs.init_device_mesh("cpu", (2, world // 2), ("dp", "tp"))
    results = {}
    for op in _catalogue(set(names) if names else None):
        for variant in variants:
            if variant == GRAD_VARIANT and not op.supports_autograd:
                continue
            if verbose and rank == 0:
                print(f"opinfo_sweep: {op_key(op)} {variant}", file=sys.stderr, flush=True)
            if variant == GRAD_VARIANT:
                results[f"{op_key(op)}|{variant}"] = run_grad_op(op, mesh, samples)
            else:
                results[f"{op_key(op)}|{variant}"] = _run_op(
                    op, mesh_2d if variant == MESH_2D_VARIANT else mesh, variant, samples
                )
    return results


def run(
    world: int = 2,
    samples: int = 3,
    strict: bool = False,
    names: list | None = None,
    timeout: float = 1800.0,
    verbose: bool = False,
    variants: tuple = VARIANTS,
) -> dict:
    """{"op|variant": (status, detail)} from rank 0 (every rank computes the same). `variants`:
    any of ALL_VARIANTS; the forward ones by default (run_grad runs the gradient one)."""
    from hypershard.launch import spawn_local_ranks

    unknown = set(variants) - set(ALL_VARIANTS)
    if unknown:
        raise ValueError(f"opinfo_sweep: unknown variants {sorted(unknown)}; allowed: {', '.join(ALL_VARIANTS)}")
    return spawn_local_ranks(
        sweep_rank, world, names, samples, strict, verbose, tuple(variants), timeout=timeout, pg_timeout=120
    )[0]


def run_grad(
    world: int = 2,
    samples: int = 3,
    strict: bool = False,
    names: list | None = None,
    timeout: float = 1800.0,
    verbose: bool = False,
) -> dict:
    """{"op|grad": (status, detail)} for every op whose OpInfo supports autograd: run() of the
    gradient variant alone (what a level0 test of gradients calls)."""
    return run(world, samples, strict, names, timeout, verbose, variants=(GRAD_VARIANT,))


def summary(results: dict) -> dict:
    """{variant: counts per status and "ops"} for the variants present in `results`."""
    out = {}
    for variant in ALL_VARIANTS:
        statuses = [s for key, (s, _) in results.items() if key.endswith(f"|{variant}")]
        if not statuses:
            continue
        out[variant] = {k: statuses.count(k) for k in ("passed", "wrong", "error", "skipped")}
        out[variant]["ops"] = len(statuses)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hypershard.testing.opinfo_sweep", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--samples", type=int, default=3, help="samples per op (default 3)")
    parser.add_argument("--strict", action="store_true", help="native rules only (no fallback)")
    parser.add_argument("--ops", help="comma-separated op names (default: all of op_db)")
    parser.add_argument("--json", help="write every (op, variant) result to this file")
    parser.add_argument(
        "--write-passing",
        metavar="FILE",
        help="write the passing (op|variant) pairs, one a line (the strict list of the level0 test)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--verbose", action="store_true", help="rank 0 prints each op as it starts")
    parser.add_argument(
        "--variants",
        default=",".join((*VARIANTS, GRAD_VARIANT)),
        help=f"comma-separated, of {','.join(ALL_VARIANTS)} (default: all but {MESH_2D_VARIANT}, "
        f"which needs --world 4 or more)",
    )
    args = parser.parse_args(argv)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if set(variants) - set(ALL_VARIANTS):
        parser.error(f"--variants {args.variants}: allowed: {','.join(ALL_VARIANTS)}")
    start = time.perf_counter()
    results = run(
        args.world,
        args.samples,
        args.strict,
        args.ops.split(",") if args.ops else None,
        args.timeout,
        args.verbose,
        variants,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    if args.write_passing:
        header = PASSING_HEADER.format(mode="strict mode" if args.strict else "default mode")
        with open(args.write_passing, "w") as f:
            f.write(header + "".join(f"{key}\n" for key, (status, _) in sorted(results.items()) if status == "passed"))
    for variant, counts in summary(results).items():
        print(
            f"{variant:9s} {counts['passed']} passed, {counts['wrong']} WRONG, {counts['error']} raised, "
            f"{counts['skipped']} skipped of {counts['ops']} ops"
        )
    for key, (status, detail) in sorted(results.items()):
        if status == "wrong":
            print(f"WRONG {key}: {detail}")
    print(f"({time.perf_counter() - start:.0f} s, {'strict' if args.strict else 'default'} mode, {args.world} ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
