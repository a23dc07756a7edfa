"""Level0: PyTorch's OpInfo catalogue (op_db, float32 CPU samples, up to 3 per op) on 2-rank
DTensors, every tensor Replicate and then sharded on its largest dim, compared with one device
(hypershard.testing.opinfo_sweep; like torch's test/distributed/tensor/test_dtensor_ops.py).

- Default mode (rules + the fallback): every (op, variant) passes except EXPECTED_FAILURES below,
  each with its reason and the error text it must still raise (an entry that starts passing
  fails the test, so the table stays true).
- Strict mode (native rules only): every pair in data/opinfo_strict_passing.txt passes; the list
  may only grow (regenerate it with the sweep's --write-passing when rules land).
- Both: zero silently wrong results.
"""

from pathlib import Path

from hypershard.testing import opinfo_sweep

STRICT_PASSING = Path(__file__).parent / "data" / "opinfo_strict_passing.txt"

_VIEW = ("a view that would cut a sharded dim; redistributing views are not built yet", "would cut through a sharded dim")
_PARTIAL = ("a Partial(sum) input the next op cannot keep; implicit reduction is not built yet",
            "Partial(sum) input is not supported")
_DTYPE = ("gloo has no collective for this dtype (complex, int16); byte reinterpretation is not built yet",
          "Invalid scalar type")
_AS_STRIDED = ("as_strided of a sharded tensor cannot be mapped to local shards",
               "as_strided on a sharded tensor cannot be mapped")
_DATA_PTR = ("torch's composite kernel reads the argument's data pointer (a DTensor has no storage)",
             "Cannot access data pointer")
_PLAIN_OUT = ("torch's composite kernel writes a DTensor result into a plain out= tensor it allocated",
              "writes into the plain tensor argument out")
_SPARSE = ("sparse tensors are not DTensors", "")
_NONZERO_0D = ("nonzero(as_tuple=True) of a 0-d DTensor: unbind of the [n, 0] result fails",
               "negative dimension -1")

EXPECTED_FAILURES = {
    **{f"{op}|sharded": _VIEW for op in ("cartesian_prod", "flatten", "linalg.tensorsolve", "nn.functional.instance_norm",
                                         "ravel", "repeat_interleave", "tensordot", "view", "view_as")},
    **{f"{op}|sharded": _PARTIAL for op in ("corrcoef", "cov", "masked.std", "masked.var", "nn.functional.rms_norm",
                                            "nn.functional.scaled_dot_product_attention")},
    **{f"{op}|sharded": _DTYPE for op in ("cdouble", "cfloat", "chalf", "short", "fft.fft2", "fft.fftn", "fft.hfft",
                                          "fft.hfft2", "fft.hfftn", "fft.ifft2", "fft.ifftn", "fft.irfft",
                                          "fft.irfft2", "fft.irfftn")},
    **{f"{op}|sharded": _AS_STRIDED for op in ("as_strided", "as_strided.partial_views", "stft")},
    **{f"{op}|{v}": _DATA_PTR for op in ("nn.functional.ctc_loss", "nn.functional.max_pool1d", "tensor_split")
       for v in opinfo_sweep.VARIANTS},
    **{f"{op}|{v}": _PLAIN_OUT for op in ("linalg.matrix_rank", "linalg.matrix_rank.hermitian")
       for v in opinfo_sweep.VARIANTS},
    **{f"{op}|{v}": _SPARSE for op in ("sparse.mm.reduce", "sparse.sampled_addmm", "to_sparse")
       for v in opinfo_sweep.VARIANTS},
    **{f"nonzero|{v}": _NONZERO_0D for v in opinfo_sweep.VARIANTS},
}


def _wrong(results):
    return {key: detail for key, (status, detail) in results.items() if status == "wrong"}


def test_default_mode_computes_the_catalogue():
    results = opinfo_sweep.run(world=2, samples=3, strict=False, timeout=1200)
    assert not _wrong(results), f"silently wrong results: {_wrong(results)}"
    problems = []
    for key, (status, detail) in sorted(results.items()):
        if key in EXPECTED_FAILURES:
            reason, text = EXPECTED_FAILURES[key]
            if status != "error" or text not in detail:
                problems.append(f"{key}: expected to fail ({reason}; with {text!r}), got {status}: {detail}")
        elif status not in ("passed", "skipped"):
            problems.append(f"{key}: {status}: {detail}")
    stale = sorted(set(EXPECTED_FAILURES) - set(results))
    assert not stale, f"EXPECTED_FAILURES names pairs the sweep does not run: {stale}"
    assert not problems, "\n".join(problems)


def test_strict_mode_native_rules_only_grow():
    results = opinfo_sweep.run(world=2, samples=3, strict=True, timeout=1200)
    assert not _wrong(results), f"silently wrong results: {_wrong(results)}"
    listed = [line for line in STRICT_PASSING.read_text().splitlines() if line and not line.startswith("#")]
    regressed = [f"{key}: {results.get(key)}" for key in listed if results.get(key, ("missing",))[0] != "passed"]
    assert not regressed, "pairs that passed on native rules no longer do:\n" + "\n".join(regressed)
