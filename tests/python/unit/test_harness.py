"""Tests of the multi-process harness itself (hypershard.testing), run on torch's own DTensor
(backend="torch") so they need nothing from hypershard's runtime.

Three launches of 2 ranks do the work: one shared run of many cases (pass, wrong result, wrong
gradient, expected errors, an error on one rank only, a crash, a sweep, a 1-rank group), and
one run with a hang.  The rest are pure-Python checks of the case notation.
"""

import importlib.util
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F


def _load_harness():
    try:
        import hypershard.testing as harness
        return harness
    except Exception:  # noqa: BLE001 -- any failure of hypershard's own import
        # hypershard's extension is not built, or is stale against its Python side (ImportError,
        # AttributeError, ...).  The harness imports nothing from hypershard at module level, so
        # load its package on its own.
        root = Path(__file__).resolve().parents[3] / "hypershard" / "testing"
        spec = importlib.util.spec_from_file_location(
            "hypershard_testing", root / "__init__.py", submodule_search_locations=[str(root)])
        harness = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = harness
        spec.loader.exec_module(harness)
        return harness


H = _load_harness()
Case, Input = H.Case, H.Input


# ---------------------------------------------------------------------------------------------
# notation (no processes)

def test_placement_notation():
    parse = H.parse_placement
    assert str(parse("S(1)")) == str(parse("S1")) == str(parse("Shard(1)")) == "S(1)"
    assert str(parse("R")) == str(parse("Replicate()")) == "R"
    assert str(parse("P")) == str(parse("Partial")) == "P(sum)"
    assert str(parse("P(max)")) == "P(max)" and str(parse("P(prod)")) == "P(product)"
    from torch.distributed.tensor import Partial, Replicate, Shard
    assert [str(parse(p)) for p in (Shard(0), Replicate(), Partial("avg"))] == \
        ["S(0)", "R", "P(avg)"]
    with pytest.raises(ValueError, match="not a placement"):
        parse("X(0)")
    with pytest.raises(ValueError, match="unknown reduce op"):
        parse("P(median)")


def test_layouts_are_validated_before_launching():
    layout = H.spec.normalize_layout(["S(-1)", "R"], ("dp", "tp"), 2)
    assert layout.kind == "placements" and str(layout) == "S(1),R"
    alias = H.spec.normalize_layout(("dp", "None"), ("dp", "tp"), 2)
    assert alias.kind == "alias" and alias.items == (("dp",), ()) and alias.raw == ("dp", "None")
    nested = H.spec.normalize_layout((("dp", "tp"), None), ("dp", "tp"), 2)
    assert nested.items == (("dp", "tp"), ())
    with pytest.raises(ValueError, match="2 axes"):
        H.spec.normalize_layout(["S(0)"], ("dp", "tp"), 2)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        H.spec.normalize_layout(("cp", "None"), ("dp", "tp"), 2)
    with pytest.raises(ValueError, match="out of range"):
        H.spec.normalize_layout(["S(2)"], ("dp",), 2)
    bad = Case("bad", fn=torch.neg, inputs=[Input((4,), placements=["S(0)", "R"])])
    with pytest.raises(ValueError, match="case 'bad', input 0"):
        H.run_cases([bad], world_size=2, backend="torch")
    twice = [Case("x", fn=torch.neg, inputs=[Input((4,))])] * 2
    with pytest.raises(ValueError, match="duplicate case names"):
        H.run_cases(twice, world_size=2, backend="torch")
    assert H.spec.normalize_mesh({"dp": 2, "tp": 2}) == ((2, 2), ("dp", "tp"))
    assert H.spec.normalize_mesh((2, 2)) == ((2, 2), ("d0", "d1"))
    assert H.spec.normalize_mesh(None, 4) == ((4,), ("dp",))


def test_placement_sweep():
    combos = H.placement_sweep((2,), [2, 1])
    assert len(combos) == 3 * 2
    assert (("S(1)",), ("R",)) in combos
    assert len(H.placement_sweep((2, 2), 2)) == 3 ** 2
    with_partial = H.placement_sweep(2, [1, 1], allow_partial=[True, False])
    assert len(with_partial) == 3 * 2 and (("P",), ("S(0)",)) in with_partial
    cases = H.sweep_cases("add", torch.add, [Input((4, 6)), Input((4, 6))], mesh=((2,), ("dp",)))
    assert len(cases) == 9 and cases[0].name == "add[R|R]"
    assert len({tuple(i.seed for i in c.inputs) for c in cases}) == 1  # same values everywhere


def test_inputs_are_seeded():
    item = Input((3, 4), seed=7)
    assert torch.equal(item.make(7), item.make(7)) and not torch.equal(item.make(7), item.make(8))
    targets = Input((1000,), torch.int64, init=H.randint(2, 5)).make(0)
    assert targets.dtype == torch.int64 and targets.min() == 2 and targets.max() == 4
    half = Input((5,), torch.bfloat16).make(3)
    assert torch.equal(half, Input((5,)).make(3).to(torch.bfloat16))
    assert Input((2,)).wants_grad and not Input((2,), torch.int64).wants_grad
    with pytest.raises(TypeError, match="by keyword"):
        Input((2,), ["S(0)"])


def test_compare_tensors():
    expected = torch.tensor([1.0, float("nan"), float("inf"), 0.0])
    assert H.compare_tensors("x", expected.clone(), expected, 1e-5, 1e-6)[0] is None
    got = expected.clone()
    got[0] = 1.001
    problem, max_abs, max_rel = H.compare_tensors("x", got, expected, 1e-5, 1e-6)
    assert "1 of 4 elements differ" in problem and "worst at (0,)" in problem
    assert math.isclose(max_abs, 1e-3, rel_tol=1e-3) and math.isclose(max_rel, 1e-3, rel_tol=1e-3)
    got[1] = 0.0
    assert "2 of 4" in H.compare_tensors("x", got, expected, 1e-5, 1e-6)[0]
    assert "shape" in H.compare_tensors("x", torch.ones(2), torch.ones(3), 0, 0)[0]
    ints = torch.tensor([1, 2, 3])
    assert "1 of 3" in H.compare_tensors("i", ints + torch.tensor([0, 0, 1]), ints, 0, 0)[0]


# ---------------------------------------------------------------------------------------------
# one shared launch of many cases

def _wrong_grad(a):
    return a * 2 - a.detach()  # the right value, twice the gradient


def _fail_everywhere(a):
    raise ValueError("unsupported layout for this op")


def _fail_on_rank0(a):
    if dist.get_rank() == 0:
        raise ValueError("rank 0 only")
    return a.full_tensor()  # rank 1 waits in a collective rank 0 never enters


def _crash_rank1(a):
    if dist.get_rank() == 1:
        os._exit(7)
    return a


def _seen_as_distributed(a):
    return a * (2.0 if H.in_distributed_run() else 1.0)


PASSING = [
    Case("add_shard_replicate", fn=torch.add,
         inputs=[Input((4, 6), placements=["S(0)"]), Input((4, 6), placements=["R"])]),
    Case("add_bcast", fn=lambda a, b: a + b,
         inputs=[Input((5, 6), placements=["S(0)"]), Input((6,), placements=["S(0)"])],
         mesh=((2,), ("dp",))),
    Case("matmul_partial_out", fn=torch.mm,
         inputs=[Input((4, 8), placements=["S(1)"]), Input((8, 6), placements=["S(0)"])]),
    Case("matmul_2d_alias", fn=torch.mm, mesh=((2, 1), ("dp", "tp")),
         inputs=[Input((4, 8), placements=("dp", "tp")), Input((8, 6), placements=("None", "tp"))]),
    Case("partial_inputs", fn=lambda a, b: (a * 2 + b).sum(0),
         inputs=[Input((4, 6), placements=["P"]), Input((4, 6), placements=["P(sum)"])]),
    Case("nll_int_targets", fn=lambda x, t: F.nll_loss(x.log_softmax(-1), t),
         inputs=[Input((8, 10), placements=["R"]),
                 Input((8,), torch.int64, init=H.randint(0, 10), placements=["R"])]),
    Case("max_with_indices", fn=lambda a: a.max(dim=1),
         inputs=[Input((4, 6), placements=["S(0)"])]),
    Case("double_precision", fn=torch.tanh,
         inputs=[Input((6, 3), torch.float64, placements=["S(0)"])]),
    Case("mixed_tensor_error", fn=lambda a: a + torch.ones(4, 6),
         inputs=[Input((4, 6), placements=["S(0)"])],
         expect_error="mixed torch.Tensor and DTensor"),
    Case("expected_error", fn=torch.neg, dist_fn=_fail_everywhere,
         inputs=[Input((4,), placements=["S(0)"])], expect_error="unsupported layout"),
    Case("one_rank_mesh", fn=torch.exp, mesh=1, inputs=[Input((3, 3), placements=["R"])]),
]
SWEEP = H.sweep_cases("mul_sweep", torch.mul, [Input((4, 6)), Input((4, 6))],
                      mesh=((2,), ("dp",)))
FAILING = [
    Case("wrong_result", fn=torch.add, dist_fn=lambda a, b: a + b + 1,
         inputs=[Input((4, 6), placements=["S(0)"]), Input((4, 6), placements=["R"])]),
    Case("wrong_grad", fn=lambda a: a * 1, dist_fn=_wrong_grad,
         inputs=[Input((4, 6), placements=["S(1)"])]),
    Case("wrong_via_flag", fn=_seen_as_distributed, inputs=[Input((4,), placements=["S(0)"])],
         check_grad=False),
    Case("error_text_differs", fn=torch.neg, dist_fn=_fail_everywhere,
         inputs=[Input((4,), placements=["S(0)"])], expect_error="something else"),
    Case("error_missing", fn=torch.neg, inputs=[Input((4,), placements=["S(0)"])],
         expect_error="never raised"),
    Case("error_on_one_rank", fn=torch.neg, dist_fn=_fail_on_rank0,
         inputs=[Input((4,), placements=["S(0)"])]),
]
AFTER_DESYNC = Case("runs_after_desync", fn=torch.mul,
                    inputs=[Input((4, 6), placements=["S(1)"]), Input((4, 6), placements=["S(0)"])])
CRASH = Case("crash", fn=torch.neg, dist_fn=_crash_rank1,
             inputs=[Input((4,), placements=["S(0)"])])
AFTER_CRASH = Case("runs_after_crash", fn=torch.sin, inputs=[Input((4, 6), placements=["S(0)"])])


@pytest.fixture(scope="module")
def shared_run():
    cases = PASSING + FAILING + [AFTER_DESYNC, CRASH, AFTER_CRASH] + SWEEP
    return H.run_cases(cases, world_size=2, backend="torch", timeout=60, collective_timeout=2)


def test_passing_cases(shared_run):
    for case in PASSING + SWEEP + [AFTER_DESYNC, AFTER_CRASH]:
        shared_run.check(case.name)
    assert "raised as expected" in shared_run["expected_error"].message


def test_wrong_result_is_reported_with_ranks_and_diffs(shared_run):
    result = shared_run["wrong_result"]
    assert result.status == "failed"
    assert "ranks 0, 1: output: 24 of 24 elements differ; max abs diff 1" in result.message
    assert math.isclose(result.max_abs_diff, 1.0, rel_tol=1e-5)
    assert "grad" not in result.message  # the gradient of a + b + 1 is still right
    grad = shared_run["wrong_grad"]
    assert grad.status == "failed" and "grad of input 0" in grad.message
    assert "output" not in grad.message
    assert shared_run["wrong_via_flag"].status == "failed"


def test_expected_errors(shared_run):
    differs = shared_run["error_text_differs"]
    assert differs.status == "failed"
    assert "expected an error containing 'something else'" in differs.message
    assert "unsupported layout for this op" in differs.message
    missing = shared_run["error_missing"]
    assert missing.status == "failed" and "succeeded" in missing.message


def test_error_on_one_rank_recreates_the_group(shared_run):
    result = shared_run["error_on_one_rank"]
    assert result.status == "error"
    assert "rank 0: the distributed run raised:\nValueError: rank 0 only" in result.message
    assert "rank 1: the distributed run raised" in result.message  # its collective timed out
    assert "recreated for the next cases" in result.message
    assert shared_run["runs_after_desync"].passed


def test_crash_is_reported_and_later_cases_still_run(shared_run):
    result = shared_run["crash"]
    assert result.status == "crash"
    assert "rank 1: running case 'crash' (died, exit code 7)" in result.message
    assert shared_run["runs_after_crash"].passed and shared_run[SWEEP[-1].name].passed
    sizes = [launch.world_size for launch in shared_run.launches]
    assert sorted(sizes) == [1, 2, 2]  # the 1-rank case in its own launch; one resume
    assert all(not os.path.exists(f"/proc/{pid}") for launch in shared_run.launches
               for pid in launch.pids)


def test_assert_all_passed_lists_every_failure(shared_run):
    with pytest.raises(AssertionError) as info:
        H.assert_all_passed(shared_run)
    text = str(info.value)
    assert text.startswith(f"{len(FAILING) + 1} of {len(shared_run)} cases did not pass")
    for case in FAILING + [CRASH]:
        assert case.name in text
    assert "add_bcast" not in text


# ---------------------------------------------------------------------------------------------
# hang

def _hang_on_rank1(a):
    if dist.get_rank() == 1:
        time.sleep(3600)
    return a


def test_hang_is_killed_and_named():
    cases = [Case("before_hang", fn=torch.neg, inputs=[Input((4,), placements=["S(0)"])]),
             Case("hangs", fn=torch.neg, dist_fn=_hang_on_rank1,
                  inputs=[Input((4,), placements=["S(0)"])]),
             Case("after_hang", fn=torch.cos, inputs=[Input((4, 2), placements=["S(1)"])])]
    timeout = 15
    start = time.monotonic()
    results = H.run_cases(cases, world_size=2, backend="torch", timeout=timeout)
    elapsed = time.monotonic() - start
    hang = results["hangs"]
    assert hang.status == "hang"
    assert "possible hang in case 'hangs'" in hang.message
    assert "rank 0: waiting for the other ranks after case 'hangs'" in hang.message
    assert "rank 1: running case 'hangs'" in hang.message
    assert "in _hang_on_rank1" in hang.message  # the hung rank's stack
    assert results["before_hang"].passed and results["after_hang"].passed
    first = results.launches[0]
    assert first.outcome == "hang" and first.duration < timeout + 5
    assert elapsed < timeout + 15  # including the resumed launch of "after_hang"
    assert multiprocessing.active_children() == []
    assert all(not os.path.exists(f"/proc/{pid}") for launch in results.launches
               for pid in launch.pids)


# ---------------------------------------------------------------------------------------------
# a device left unusable (CUDA's device-side asserts), imitated on CPU

class AcceleratorError(RuntimeError):
    """Named as torch's: a CUDA error after which the process's device context is unusable."""


def _device_left_unusable(a):
    os.environ["HYPERSHARD_TEST_DEVICE_UNUSABLE"] = "1"  # this rank process only
    raise AcceleratorError("CUDA error: device-side assert triggered")


def _needs_a_usable_device(a):
    if os.environ.get("HYPERSHARD_TEST_DEVICE_UNUSABLE"):
        raise RuntimeError("ran in the process an earlier case left with an unusable device")
    return -a


def test_unusable_device_ends_the_launch_and_later_cases_run_in_fresh_ranks():
    # On a GPU one device-side assert (an index out of range) made every later case of the same
    # launch fail with it; the ranks now stop after such a case and the rest run in a new launch.
    cases = [Case("device_assert", fn=torch.neg, dist_fn=_device_left_unusable,
                  inputs=[Input((4,), placements=["S(0)"])]),
             Case("after_device_assert", fn=torch.neg, dist_fn=_needs_a_usable_device,
                  inputs=[Input((4,), placements=["S(0)"])])]
    results = H.run_cases(cases, world_size=2, backend="torch", timeout=60)
    failed = results["device_assert"]
    assert failed.status == "error" and "AcceleratorError: CUDA error: device-side assert" in failed.message
    assert results["after_device_assert"].passed, results["after_device_assert"].message
    assert [launch.outcome for launch in results.launches] == ["restart", "ok"]
    assert results.launches[0].case == "device_assert" and not results.problems


# ---------------------------------------------------------------------------------------------
# the hypershard backend

def _hypershard_runtime_missing():
    try:
        H.HypershardAdapter().check()
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_hypershard_backend_reports_a_missing_runtime():
    missing = _hypershard_runtime_missing()
    if not missing:
        pytest.skip("hypershard's runtime is available")
    with pytest.raises(RuntimeError, match="backend 'hypershard'"):
        H.run_cases([Case("x", fn=torch.neg, inputs=[Input((4,))])], world_size=2)


@pytest.mark.skipif(bool(_hypershard_runtime_missing()), reason="hypershard runtime not built")
def test_hypershard_backend_basic_cases():
    cases = [Case("hs_add", fn=torch.add,
                  inputs=[Input((4, 6), placements=["S(0)"]), Input((4, 6), placements=["R"])]),
             Case("hs_mul_alias", fn=torch.mul,  # alias tuples go through to hypershard
                  inputs=[Input((4, 6), placements=("dp", "None")),
                          Input((4, 6), placements=("None", "None"))])]
    H.assert_all_passed(H.run_cases(cases, world_size=2, backend="hypershard", timeout=120))
