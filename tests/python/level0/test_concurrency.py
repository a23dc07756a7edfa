"""Level0: the per-op path is thread-safe. Autograd may run backward passes on several threads;
here THREADS threads each run forward and backward ITERATIONS times on their own graph (own
shapes, so plan-cache misses and inserts race with hits on other threads), on a real 2-rank
mesh, and every thread's outputs and gradients must equal the single-threaded reference.

The graphs need no collective (sharded rows, replicated weights without gradients): c10d
collectives issued concurrently from several threads would be matched in different orders on
different ranks, which no DTensor library can allow. What is exercised is hypershard's own
shared state: per-op metadata, the plan caches, interned layouts and the traffic counters.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from hypershard.testing import Case, Input, assert_all_passed, in_distributed_run, run_cases

THREADS = 4
ITERATIONS = 25


def graph(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """Forward of thread k: matmul, pointwise, views, softmax, layer norm -- all row-local."""
    h = (x @ w[:, : 4 + k]).relu() * 0.5 + 1.0
    h = h.transpose(0, 1).contiguous().transpose(0, 1)
    h = h.view(h.shape[0], 2 + k // 2, -1) if (4 + k) % (2 + k // 2) == 0 else h.unsqueeze(1)
    h = h.reshape(h.shape[0], -1).softmax(-1)
    return F.layer_norm(h, (h.shape[-1],)).sum(-1)


def step(x: torch.Tensor, w: torch.Tensor, k: int) -> tuple:
    xk = (x * (1.0 + k)).detach().requires_grad_(True)
    out = graph(xk, w, k)
    out.backward(torch.ones_like(out))
    return out.detach(), xk.grad


def run_threads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: each thread's step once, in order. Distributed: THREADS threads at once, each
    ITERATIONS steps that must repeat bit for bit; gathered afterwards, in order (full_tensor is
    a collective, kept off the concurrent part)."""
    if not in_distributed_run():
        return torch.cat([t.reshape(-1) for k in range(THREADS) for t in step(x, w, k)])
    results: dict = {}
    errors: list = []
    barrier = threading.Barrier(THREADS)

    def work(k: int) -> None:
        try:
            barrier.wait()  # start together
            for _ in range(ITERATIONS):
                value, grad = step(x, w, k)
                if k in results:
                    first_value, first_grad = results[k]
                    assert torch.equal(first_value.to_local(), value.to_local()) and \
                        torch.equal(first_grad.to_local(), grad.to_local()), \
                        f"thread {k}: a repeated iteration gave a different result"
                results[k] = (value, grad)
        except BaseException as exc:  # noqa: BLE001 -- re-raised on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (deadlock?)"
    if errors:
        raise errors[0]
    parts = []
    for k in range(THREADS):
        value, grad = results[k]
        assert grad.placements == x.placements, (k, grad.placements)
        parts += [value.full_tensor().reshape(-1), grad.full_tensor().reshape(-1)]
    return torch.cat(parts)


def test_concurrent_forward_and_backward():
    cases = [Case("threads_rows_sharded", run_threads,
                  [Input((8, 6), placements=["S(0)"], requires_grad=False),
                   Input((6, 8), placements=["R"], requires_grad=False)], ((2,), ("dp",)), check_grad=False),
             Case("threads_rows_sharded_2d", run_threads,
                  [Input((8, 6), placements=["S(0)", "S(0)"], requires_grad=False),
                   Input((6, 8), placements=["R", "R"], requires_grad=False)], ((2, 2), ("a", "b")),
                  check_grad=False)]
    assert_all_passed(run_cases(cases, backend="hypershard", timeout=300))
