"""Level0: PyTorch's OpInfo catalogue (op_db, float32 CPU samples, up to 3 per op) on DTensors,
compared with one device (hypershard.testing.opinfo_sweep; like torch's
test/distributed/tensor/test_dtensor_ops.py): on 2 ranks every tensor Replicate, then sharded on
its largest dim (uneven shards included), then the input gradients of the ops that support
autograd (inputs sharded); on a 2 x 2 mesh two dims sharded (or one dim over both axes).

- Default mode (rules + the fallback + implicit redistribution): every (op, variant) passes
  except EXPECTED_FAILURES below, each with its reason and the error text it must still raise
  (an entry that starts passing fails the test, so the table stays true).
- Strict mode (native rules only): every pair in data/opinfo_strict_passing.txt passes; the list
  may only grow (regenerate it with the sweep's --strict --write-passing when rules land).
- Both: zero silently wrong results.
"""

from pathlib import Path

from hypershard.testing import opinfo_sweep

STRICT_PASSING = Path(__file__).parent / "data" / "opinfo_strict_passing.txt"

_SPARSE = ("sparse tensors are not DTensors (a sparse operand next to dense DTensors dispatches to "
           "torch's Sparse*PrivateUse2 keys, which nothing implements; torch's DTensor has no sparse support either)",
           "")
_WRITE_THROUGH = ("the backward formula writes (copy_) into a view of a sharded buffer that had to be "
                  "redistributed; such a view does not alias its base, so the write is refused rather than lost",
                  "writing into it would be lost")
FORWARD = (*opinfo_sweep.VARIANTS, opinfo_sweep.MESH_2D_VARIANT)

EXPECTED_FAILURES = {
    **{f"{op}|{v}": _SPARSE for op in ("sparse.mm.reduce", "sparse.sampled_addmm", "to_sparse") for v in FORWARD},
    **{f"{op}|grad": _SPARSE for op in ("sparse.mm.reduce", "sparse.sampled_addmm")},
    **{f"{op}|grad": _WRITE_THROUGH for op in ("linalg.householder_product", "ormqr")},
}


def _wrong(results):
    return {key: detail for key, (status, detail) in results.items() if status == "wrong"}


def _check_default_mode(results, variants):
    assert not _wrong(results), f"silently wrong results: {_wrong(results)}"
    problems = []
    for key, (status, detail) in sorted(results.items()):
        if key in EXPECTED_FAILURES:
            reason, text = EXPECTED_FAILURES[key]
            if status != "error" or text not in detail:
                problems.append(f"{key}: expected to fail ({reason}; with {text!r}), got {status}: {detail}")
        elif status not in ("passed", "skipped"):
            problems.append(f"{key}: {status}: {detail}")
    stale = sorted(k for k in set(EXPECTED_FAILURES) - set(results) if k.rsplit("|", 1)[1] in variants)
    assert not stale, f"EXPECTED_FAILURES names pairs the sweep does not run: {stale}"
    assert not problems, "\n".join(problems)


def test_default_mode_computes_the_catalogue():
    variants = (*opinfo_sweep.VARIANTS, opinfo_sweep.GRAD_VARIANT)
    _check_default_mode(opinfo_sweep.run(world=2, samples=3, strict=False, timeout=1500, variants=variants), variants)


def test_default_mode_on_a_2d_mesh():
    variants = (opinfo_sweep.MESH_2D_VARIANT,)
    _check_default_mode(opinfo_sweep.run(world=4, samples=3, strict=False, timeout=1500, variants=variants), variants)


def test_strict_mode_native_rules_only_grow():
    results = opinfo_sweep.run(world=2, samples=3, strict=True, timeout=1500,
                               variants=(*opinfo_sweep.VARIANTS, opinfo_sweep.GRAD_VARIANT))
    assert not _wrong(results), f"silently wrong results: {_wrong(results)}"
    listed = [line for line in STRICT_PASSING.read_text().splitlines() if line and not line.startswith("#")]
    regressed = [f"{key}: {results.get(key)}" for key in listed if results.get(key, ("missing",))[0] != "passed"]
    assert not regressed, "pairs that passed on native rules no longer do:\n" + "\n".join(regressed)
