"""hypershard.testing: the multi-process harness behind every distributed test.

It runs many declarative cases per launch of N local ranks and checks each against a
single-process reference: every output (gathered to the full global tensor) and every input
gradient (backward of a fixed, seeded random cotangent per differentiable output, done the same
way in both runs), with per-case rtol/atol (float32 default: rtol=1e-5, atol=1e-6).

    import torch
    from hypershard.testing import Case, Input, randint, run_cases, assert_all_passed

    cases = [
        Case("add_bcast", fn=lambda a, b: a + b,
             inputs=[Input((4, 6), placements=["S(0)"]), Input((6,), placements=["R"])],
             mesh=((2,), ("dp",))),
        Case("mm_2d", fn=torch.mm, mesh={"dp": 2, "tp": 2},
             inputs=[Input((4, 8), placements=("dp", "tp")),       # alias notation
                     Input((8, 6), placements=["R", "S(1)"])]),
        Case("nll", fn=lambda x, t: torch.nn.functional.nll_loss(x.log_softmax(-1), t),
             inputs=[Input((8, 10), placements=["S(0)"]),
                     Input((8,), torch.int64, init=randint(0, 10), placements=["S(0)"])]),
        Case("bad_layout", fn=torch.mm, expect_error="Missing operator",
             inputs=[Input((4, 4), placements=["P"]), Input((4, 4), placements=["P"])]),
    ]
    results = run_cases(cases, world_size=2, backend="hypershard", timeout=120)
    assert_all_passed(results)      # AssertionError listing every case that did not pass

Cases (spec.Case): name, fn, inputs, mesh (``((shape), (names))``, ``{"dp": 2}``, a bare shape, or
None = 1-D "dp" over `world_size`), dist_fn (run instead of fn in the distributed half),
expect_error (every rank must raise with this text, and the process group must still work
afterwards), rtol/atol, check_grad, check_inputs (in-place ops), grad_placements, seed.

Inputs (spec.Input): shape and dtype of the global tensor, placements, seed (default derived
from the case name and position; the reference and the distributed run use the same values),
requires_grad (default: floating dtypes), init (randn / uniform(lo, hi) / randint(lo, hi) /
arange() / constant(v) / a callable (shape, dtype, generator) -> Tensor / a fixed tensor), plain
(pass a plain tensor to the distributed run too).

Placements, one per mesh axis: "R", "S(d)" (or "Sd", "Shard(d)"), "P" / "P(sum|avg|max|min|
product)", or placement objects.  Hyper-Parallel alias tuples, one entry per tensor dim
(``("dp", "None")``, ``(("dp", "tp"), "None")``), are passed through to hypershard and
translated for torch.  ``placement_sweep(mesh_shape, ndim_per_input, allow_partial=False)`` lists
every combination; ``sweep_cases(name, fn, inputs, mesh)`` makes one Case per combination.

run_cases(cases, world_size=None, backend="hypershard" | "torch" | Adapter, timeout=300,
collective_timeout=None, resume=True, keep_dir=None) groups the cases by world size and runs each
group in one launch: ranks are forked from the caller (so cases may use lambdas; OMP_NUM_THREADS=1,
one torch thread), rendezvous through a TCPStore the parent owns on an OS-chosen port, use gloo
with `collective_timeout`, create and cache one mesh per (shape, names), and report each case by
rank.  With backend="hypershard" every rank runs in strict mode (Adapter.setup_rank), so an op
without a rule fails its case instead of passing through the fallback.  When a launch does not finish within `timeout`, the parent dumps the ranks' stacks, kills
them and reports "possible hang in case <name>" with what every rank was doing; a rank that dies
is reported as a crash of its case; with `resume` the cases after it run in a new launch.
Every launch uses a fresh temporary directory (kept with keep_dir=True or
HYPERSHARD_TESTING_KEEP=1) and leaves no process behind.

The result (results.RunResult) maps case names to CaseResult (status passed / failed / error /
hang / crash / not_run, message naming the ranks and the max abs/rel differences, durations);
``results.check(name)`` asserts one case (for one pytest test per case over a shared launch).
Inside a case function, in_distributed_run(), current_mesh() and current_rank() tell where it
runs, and replicated(t) makes a DTensor Replicate (identity in the reference).  This package never imports hypershard at module level: its adapters import the DTensor
library lazily, so the harness (with backend="torch") works before hypershard's runtime is built.
"""

from .adapters import (
    Adapter,
    DefaultModeAdapter,
    HypershardAdapter,
    NoisyPartialAdapter,
    TorchAdapter,
    get_adapter,
    register_adapter,
)
from .launcher import run_cases
from .results import CaseResult, LaunchInfo, RunResult, assert_all_passed
from .spec import (
    Case,
    Input,
    arange,
    constant,
    default_tolerance,
    parse_placement,
    placement_sweep,
    randint,
    randn,
    sweep_cases,
    uniform,
)
from .worker import (
    compare_tensors,
    counting,
    current_mesh,
    current_rank,
    debug_checked,
    in_distributed_run,
    layout_problems,
    replicated,
    traffic_checked,
)

__all__ = [
    "Adapter",
    "Case",
    "CaseResult",
    "DefaultModeAdapter",
    "HypershardAdapter",
    "Input",
    "LaunchInfo",
    "NoisyPartialAdapter",
    "RunResult",
    "TorchAdapter",
    "arange",
    "assert_all_passed",
    "compare_tensors",
    "constant",
    "counting",
    "current_mesh",
    "traffic_checked",
    "current_rank",
    "debug_checked",
    "default_tolerance",
    "get_adapter",
    "in_distributed_run",
    "layout_problems",
    "parse_placement",
    "placement_sweep",
    "randint",
    "randn",
    "register_adapter",
    "replicated",
    "run_cases",
    "sweep_cases",
    "uniform",
]
