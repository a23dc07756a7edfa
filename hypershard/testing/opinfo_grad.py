"""The gradient variant of the OpInfo sweep (hypershard.testing.opinfo_sweep, key "op|grad").

For every op whose OpInfo supports autograd: the sample's tensors that want gradients become
fresh leaves, once plain and once as DTensors sharded on their largest dim (the "sharded"
variant's layouts); the op runs both ways; the gradient of sum_k (out_k * w_k).sum() over its
differentiable outputs (the same random weights w_k on both sides, each DTensor weight in its
output's layout) flows back; every input's gradient (gathered) must match the plain one with
the sweep's RTOL/ATOL, or else be as close to the float64 gradient as float32 rounding allows
(see _within_float32_rounding; such a pass says so in its detail). A gradient that is None on
one side only is "wrong". A sample torch itself cannot differentiate, or with no differentiable
output, is passed over; an op left with none is "skipped".
"""

from __future__ import annotations

import itertools
from typing import Any

from .opinfo_common import ATOL, RTOL, compare, describe, distribute_tensor, gather, map_tensors

# The weights are random so that a gradient routed to the wrong element cannot cancel out.
WEIGHT_SEED = 1000


def _differentiable(t) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _flat_tensors(value: Any) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


def _grad_inputs(sample, convert) -> tuple[list, dict, list]:
    """The sample's arguments as fresh tensors (convert of a detached contiguous copy), those the
    sample wants gradients of made leaves that require grad; returns (args, kwargs, leaves).
    A tensor the sample passes twice becomes one leaf, so its gradient accumulates as in torch."""
    import torch

    made, leaves = {}, []

    def fresh(t):
        if id(t) not in made:
            if t.layout != torch.strided:  # sparse ones stay as they are
                made[id(t)] = t
                return t
            copy = convert(t.detach().clone())
            if t.requires_grad and _differentiable(t):
                copy.requires_grad_(True)
                leaves.append(copy)
            made[id(t)] = copy
        return made[id(t)]

    return (map_tensors([sample.input, *sample.args], fresh), map_tensors(dict(sample.kwargs), fresh), leaves)


def _output_weights(outputs: list) -> list:
    import torch

    generator = torch.Generator().manual_seed(WEIGHT_SEED)
    return [torch.randn(out.shape, dtype=out.dtype, generator=generator) for out in outputs]


def _weight_like(weight, out):
    """The plain weight in the DTensor output's layout; a Partial axis becomes Replicate (a
    product of two sum-Partials is not the Partial of the product)."""
    import hypershard as hs

    if not hs._C.is_dtensor(out):
        return weight
    placements = [hs.Replicate() if p.is_partial() else p for p in out.placements]
    return hs.distribute_tensor(weight, out.device_mesh, placements)


def _weighted_sum(outputs: list, weights: list):
    total = 0
    for out, weight in zip(outputs, weights):
        term = (out * weight).sum()
        total = total + (term.real if term.is_complex() else term)  # backward needs a real loss
    return total


def _grad_mismatch(got: list, expected: list, dtensor_leaves: list) -> str:
    """ "" when every DTensor input's gradient matches the plain one; else what differs."""
    for index, (grad, reference, leaf) in enumerate(zip(got, expected, dtensor_leaves)):
        if (grad is None) != (reference is None):
            zero = " (all zero)" if grad is not None and not grad.any() else ""
            where = "on DTensors" if grad is None else "on one device"
            return f"input #{index} {tuple(leaf.shape)}: gradient is None {where}, not on the other{zero}"
        if grad is not None:
            try:
                compare(grad, reference)
            except AssertionError as exc:
                # assert_close's lines after the first say how many elements differ, and by how much
                lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
                return f"input #{index} {tuple(leaf.shape)} gradient: {'; '.join(lines[:4])[:300]}"
    return ""


def _float64_grads(op, sample, process, chosen: list, weights: list) -> list:
    """The one-device gradients again, computed in float64 from the same float32 values."""
    import torch

    def widen(t):
        return t.double() if t.dtype == torch.float32 else t.cdouble() if t.dtype == torch.complex64 else t

    args, kwargs, leaves = _grad_inputs(sample, widen)
    outputs = _flat_tensors(process(op(*args, **kwargs)))
    _weighted_sum([outputs[i] for i in chosen], [widen(w) for w in weights]).backward()
    return [leaf.grad for leaf in leaves]


def _within_float32_rounding(got: list, expected: list, exact: list) -> bool:
    """Whether every DTensor gradient is as close to the float64 one as float32 allows here: the
    module's tolerance plus twice the one-device gradient's own worst error. A backward sums
    many more terms than a forward sample (kron's: 200 products near 100 that cancel to ~1), so
    the same float32 sum in another order can differ by more than ATOL from the one-device one."""
    import torch

    for grad, reference, truth in zip(got, expected, exact):
        if (grad is None) != (truth is None):
            return False
        if grad is None:
            continue
        own_error = (reference.to(truth.dtype) - truth).abs()
        own_error = own_error[~own_error.isnan()]
        scale = own_error.max().item() if own_error.numel() else 0.0
        if not torch.isfinite(torch.tensor(scale)):
            return False
        try:
            torch.testing.assert_close(
                grad.to(truth.dtype), truth, rtol=RTOL, atol=ATOL + 2 * scale, equal_nan=True, check_stride=False
            )
        except AssertionError:
            return False
    return True


def run_grad_op(op, mesh, samples: int) -> tuple[str, str]:
    """(status, detail) of the gradient variant for one OpInfo op, over up to `samples` samples."""
    import torch

    count, rounding_note = 0, ""
    torch.manual_seed(0)  # as _run_op: every rank draws the same samples
    drawn = list(itertools.islice(op.sample_inputs("cpu", torch.float32, requires_grad=True), 2 * samples))
    for sample in drawn:
        if count >= samples:
            break
        # torch's gradient tests apply it too: it keeps what a gradient is well defined for (the
        # sign- and phase-free parts of svd's or eigh's vectors, say).
        process = sample.output_process_fn_grad
        sample_seed = count + 1  # the same random draws in both runs (dropout, say)
        torch.manual_seed(sample_seed)
        args, kwargs, leaves = _grad_inputs(sample, lambda t: t)
        try:
            outputs = _flat_tensors(process(op(*args, **kwargs)))
            chosen = [i for i, out in enumerate(outputs) if out.requires_grad and _differentiable(out)]
            if not chosen or not leaves:
                continue
            weights = _output_weights([outputs[i] for i in chosen])
            _weighted_sum([outputs[i] for i in chosen], weights).backward()
        except Exception:  # noqa: BLE001 -- a sample torch itself rejects (or cannot differentiate)
            continue
        expected = [leaf.grad for leaf in leaves]
        count += 1

        torch.manual_seed(sample_seed)
        phase = "forward"
        try:
            args, kwargs, dtensor_leaves = _grad_inputs(sample, lambda t: distribute_tensor(t, mesh, "sharded"))
            got_outputs = _flat_tensors(process(op(*args, **kwargs)))
            if len(got_outputs) != len(outputs):
                return "wrong", f"{len(got_outputs)} tensor outputs on DTensors, {len(outputs)} on one device"
            for i in chosen:
                if tuple(got_outputs[i].shape) != tuple(outputs[i].shape) or not got_outputs[i].requires_grad:
                    return "wrong", (
                        f"output #{i}: shape {tuple(got_outputs[i].shape)} requires_grad="
                        f"{got_outputs[i].requires_grad} on DTensors, {tuple(outputs[i].shape)} "
                        "requires_grad=True on one device"
                    )
            phase = "weighted sum"  # the sweep's own ops, named apart from the op's
            picked = [got_outputs[i] for i in chosen]
            loss = _weighted_sum(picked, [_weight_like(w, out) for w, out in zip(weights, picked)])
            phase = "backward"
            loss.backward()
            phase = "gathering the gradients"
            got = [None if leaf.grad is None else gather(leaf.grad) for leaf in dtensor_leaves]
        except Exception as exc:  # noqa: BLE001 -- the sweep records what raised
            return "error", f"{phase}: {describe(exc)}"
        mismatch = _grad_mismatch(got, expected, dtensor_leaves)
        if mismatch:
            torch.manual_seed(sample_seed)
            try:
                exact = _float64_grads(op, sample, process, chosen, weights)
            except Exception:  # noqa: BLE001 -- no float64 run to judge by: the mismatch stands
                return "wrong", mismatch
            if not _within_float32_rounding(got, expected, exact):
                return "wrong", mismatch
            rounding_note = f"passed by float32 rounding vs float64 (sample {count}): {mismatch}"
    return ("passed", rounding_note) if count else ("skipped", "no float32 CPU sample with a differentiable output")
