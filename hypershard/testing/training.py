"""Comparing a distributed training run with the same run on one device, and why the tolerances
are what they are.

Both runs start from the same parameters and see the same batches; they differ only in the
ORDER of floating-point sums (a sharded matmul adds partial products per rank, then the
all-reduce adds the ranks; gradient buckets flatten and add; clip_grad_norm_ adds per-shard
norms). Each such float32 sum of K terms is off by at most about K * u * sum|terms|, u = 2^-24,
and which way it rounds depends on the CPU's vector width and the BLAS kernel (MKL's AVX2 and
AVX-512 paths, OpenBLAS core types) and on the thread count. So no comparison here is bitwise
except two runs of the SAME program (the determinism tests), and the tolerances are set by how
rounding propagates, not by what one CPU happened to show:

- Loss of every step, relative: LOSS_RTOL = 1e-5. A loss is a mean of log-softmax terms; its
  rounding error is tens of u relative (measured: about 1e-7). A real fault (a missing
  all-reduce, a gradient off by a factor, a wrong shard) moves the loss by far more within a
  few steps -- but not at step 1 for a gradient fault, hence the two checks below.
- Gradients of the first step, per parameter, in norm: ||g_dist - g_ref|| <= GRAD_RTOL ||g_ref||.
  Same parameters, same batch: only summation order differs. A backward pass of depth D chains
  O(D) reductions, each adding a relative error of order K u; with D, K <= a few hundred that
  is < 1e-4 = GRAD_RTOL (about 1700 u). Norm-wise, because single elements that nearly cancel
  have unbounded relative error while the tensor's does not. The faults the check exists for
  give 0.25 (half of one of two data-parallel contributions) to 1 (a missing sum).
- A gradient that is a sum of terms which nearly cancel (Qwen3.5's dt_bias and A_log: sums over
  tokens of per-token terms) has a norm-wise error far above the chained-reduction estimate in
  ANY float32 evaluation: the one-device float32 run is 5.5e-5 of the norm away from the exact
  (float64) gradient, the tp2 x cp2 run 4.5e-5, and the two differ by 6.7e-5, too near
  GRAD_RTOL for every CPU. Such a test passes `exact`, the same one-device run in float64: each
  gradient is then compared with the exact one and allowed GRAD_RTOL of its norm plus
  CONDITIONING_FACTOR = 2 times the one-device float32 run's own distance from it. That distance
  measures how this gradient is conditioned on this CPU and BLAS; the distributed run does the same
  sums in another order, whose rounding is of the same size (measured 0.8x to 1.3x of it), and the
  allowance grows with it on a CPU where both grow. The added allowance is capped at
  CONDITIONING_CAP = 1e-2 of the norm, 25 times below the 0.25 or more a fault moves a gradient
  by: a gradient so badly conditioned that float32 cannot get within 0.5 % of it is a problem
  reported as such, not a pass.
- Parameters after the last step, per parameter, in norm, relative to how far training moved
  them: ||p_dist - p_ref|| <= UPDATE_RTOL ||p_ref - p_init|| + steps * u * ||p_ref||. AdamW's
  step is lr * m / (sqrt(v) + eps): for an element whose gradient is well above its rounding
  noise it inherits the gradient's relative error (~1e-6), but for an element whose gradient is
  AT the noise level m / sqrt(v) is sign-like and the two runs may move it in different
  directions by up to lr per step -- an elementwise rtol cannot hold there (this is what failed
  on an AMD EPYC: 4e-6 absolute on a 5e-3 update). Such elements carry a small share of the
  update's norm; UPDATE_RTOL = 1e-2 allows them 1 % of it, while a wrong gradient changes the
  update's direction by tens of percent. The second term is the float32 rounding of p + step
  itself (u |p| per element per step), for parameters that barely move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

__all__ = [
    "CONDITIONING_CAP",
    "CONDITIONING_FACTOR",
    "GRAD_RTOL",
    "LOSS_RTOL",
    "UPDATE_RTOL",
    "TrainingRecord",
    "check_training",
    "record_cp_training",
    "record_training",
]

U32 = 2.0**-24  # float32 unit roundoff
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
UPDATE_RTOL = 1e-2
CONDITIONING_FACTOR = 2.0
CONDITIONING_CAP = 1e-2


@dataclass
class TrainingRecord:
    """What a training run is compared on: full (global) tensors, by parameter name."""

    losses: list = field(default_factory=list)
    initial: dict = field(default_factory=dict)  # parameters before the first step
    first_grads: dict = field(default_factory=dict)  # gradients of the first step, before clipping
    final: dict = field(default_factory=dict)  # parameters after the last step


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if hasattr(t, "full_tensor"):  # a DTensor (a collective: every rank calls this)
        t = t.full_tensor()
    return t.to(torch.float64).clone()


def record_training(
    model: torch.nn.Module, batches: list, train: Optional[Callable] = None, **train_kwargs
) -> TrainingRecord:
    """Trains `model` on `batches` with hypershard.testing.models.train (or `train`) and records losses,
    initial parameters, first-step gradients and final parameters as full float64 tensors."""
    if train is None:
        from hypershard.testing.models import train
    record = TrainingRecord()
    record.initial = {name: _full(p) for name, p in model.named_parameters()}

    def on_backward(step: int, m: torch.nn.Module) -> None:
        if step == 0:
            record.first_grads = {name: _full(p.grad) for name, p in m.named_parameters() if p.grad is not None}

    record.losses = train(model, batches, on_backward=on_backward, **train_kwargs)
    record.final = {name: _full(p) for name, p in model.named_parameters()}
    return record


def record_cp_training(model: torch.nn.Module, batches: list, mesh) -> tuple:
    """record_training of a model on a context-parallel mesh, with what strict-mode cp tests check:
    (record, dispatch stats, attention calls per cp algorithm), both counted over the run alone.
    The mesh's cp declarations go back to their defaults afterwards (the cases of one launch share
    the mesh)."""
    from .. import _C

    _C.reset_dispatch_stats()
    _C.reset_cp_attention_calls()
    try:
        got = record_training(model, batches)
        return got, _C.dispatch_stats(), _C.cp_attention_calls()
    finally:
        mesh.load_balanced_sequence_axis = -1
        mesh.cp_algorithm = "all_gather_kv"


def bitwise_differences(got: TrainingRecord, base: TrainingRecord) -> list:
    """What differs between two records bit for bit (losses, first-step gradients, final parameters;
    [] when nothing): for runs that must run the same ops on the same values in the same order."""
    bad = [] if got.losses == base.losses else [f"losses {got.losses} vs {base.losses}"]
    for kind in ("first_grads", "final"):
        a, b = getattr(got, kind), getattr(base, kind)
        if set(a) != set(b):
            bad.append(f"{kind}: other names")
        bad += [f"{kind} {n}" for n in a if n in b and not torch.equal(a[n], b[n])]
    return bad


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) if t.numel() else 0.0


def check_training(
    got: TrainingRecord, expected: TrainingRecord, exact: Optional[TrainingRecord] = None
) -> tuple[list, dict]:
    """(problems, worst) comparing a distributed record with the single-device one: `problems`
    lists every check that failed (empty = equal within the tolerances above); `worst` has the
    largest observed ratio of each kind, for reports. `exact`: the one-device run in float64, for
    gradients that nearly cancel (see the module docstring)."""
    problems = []
    worst = {"loss_rel": 0.0, "grad_rel": 0.0, "update_rel": 0.0}
    steps = len(expected.losses)
    if len(got.losses) != steps:
        problems.append(f"{len(got.losses)} losses, expected {steps}")
    for step, (a, b) in enumerate(zip(got.losses, expected.losses), 1):
        rel = abs(a - b) / max(abs(b), 1e-30)
        worst["loss_rel"] = max(worst["loss_rel"], rel)
        if not rel <= LOSS_RTOL:
            problems.append(f"loss of step {step}: {a!r} vs {b!r} (relative {rel:.2e} > {LOSS_RTOL:g})")
    if set(got.first_grads) != set(expected.first_grads):
        problems.append(
            f"parameters with a gradient differ: {sorted(set(got.first_grads) ^ set(expected.first_grads))}"
        )
    check_first_grads(got, expected, GRAD_RTOL, problems, worst, exact)
    check_final_params(got, expected, UPDATE_RTOL, problems, worst)
    return problems, worst


def check_first_grads(
    got: TrainingRecord,
    expected: TrainingRecord,
    rtol: float,
    problems: list,
    worst: dict,
    exact: Optional[TrainingRecord] = None,
) -> None:
    """Each parameter's first-step gradient within `rtol` of its norm (appends to `problems`,
    keeps the largest ratio in worst["grad_rel"]); with `exact` (float64), compared with the exact
    gradient and allowed CONDITIONING_FACTOR times the one-device float32 run's own error more."""
    for name, g_ref in expected.first_grads.items():
        if name not in got.first_grads:
            continue
        g = got.first_grads[name]
        if g.shape != g_ref.shape:
            problems.append(f"{name}: gradient shape {tuple(g.shape)}, expected {tuple(g_ref.shape)}")
            continue
        if exact is None:
            err, scale, allowed = _norm(g - g_ref), _norm(g_ref), rtol * _norm(g_ref)
        else:
            g_exact = exact.first_grads[name]
            err, scale = _norm(g - g_exact), _norm(g_exact)
            allowed = rtol * scale + min(CONDITIONING_FACTOR * _norm(g_ref - g_exact), CONDITIONING_CAP * scale)
        rel = err / scale if scale else (0.0 if err == 0 else math.inf)
        worst["grad_rel"] = max(worst["grad_rel"], rel)
        if not err <= allowed:
            against = "its norm" if exact is None else "the exact gradient's norm"
            problems.append(
                f"{name}: first-step gradient differs by {rel:.2e} of {against} (allowed {allowed / (scale or 1):.2e})"
            )


def check_final_params(
    got: TrainingRecord, expected: TrainingRecord, update_rtol: float, problems: list, worst: dict
) -> None:
    """Each parameter after the last step within `update_rtol` of its update's norm, plus one fp32
    rounding of the parameter per step (appends to `problems`, keeps worst["update_rel"])."""
    steps = len(expected.losses)
    for name, p_ref in expected.final.items():
        p = got.final.get(name)
        if p is None or p.shape != p_ref.shape:
            problems.append(f"{name}: missing or of another shape after training")
            continue
        err, moved = _norm(p - p_ref), _norm(p_ref - expected.initial[name])
        bound = update_rtol * moved + steps * U32 * _norm(p_ref)
        rel = err / moved if moved else (0.0 if err == 0 else math.inf)
        worst["update_rel"] = max(worst["update_rel"], rel)
        if not err <= bound:
            problems.append(
                f"{name}: after {steps} steps differs by {err:.3e} = {rel:.2e} of its update "
                f"{moved:.3e} (allowed {update_rtol:g} of it + {steps} u |p|)"
            )
