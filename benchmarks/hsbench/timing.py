"""Timing shared by the per-op sections. The machine is shared and noisy, so implementations are
timed interleaved in the same processes: many short samples, the starting implementation rotated
every repeat, a barrier before each sample, the garbage collector off inside a sample."""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable

from .common import summary


def calibrate(fn: Callable, target_s: float, slowest: Callable) -> int:
    """Calls per sample so that one sample lasts about target_s. Every rank makes the same calls
    (an op may run collectives): slowest(elapsed) is the maximum over the ranks."""
    for _ in range(20):
        fn()
    n = 8
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = slowest(time.perf_counter() - start)
        if elapsed >= 0.004 or n >= 1 << 20:
            return max(10, int(target_s / (elapsed / n)))
        n *= 4


def calibrate_one_call(fn: Callable, target_s: float, slowest: Callable) -> int:
    """Calls per sample from one timed call after one warm-up call (at least 1): for calls of
    milliseconds, where calibrate's 10 or more calls per sample would make a run slow."""
    fn()
    start = time.perf_counter()
    fn()
    elapsed = slowest(time.perf_counter() - start)
    return max(1, round(target_s / max(elapsed, 1e-9)))


def slowest_rank(elapsed: float) -> float:
    """The maximum of `elapsed` over the ranks."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def time_interleaved(
    fns: dict,
    solo: dict,
    rank: int,
    sample_s: float,
    repeats: int,
    setting: Callable = lambda impl: contextlib.nullcontext(),
    warm_first: bool = False,
    calibration: Callable = calibrate,
) -> tuple:
    """Times every implementation in fns ({impl: fn}) -> (calls per sample, {impl: [µs per call]}).

    solo[impl]: the implementation runs no collective, so it is timed on rank 0 alone while the
    other ranks wait in a barrier (ranks sharing few cores would otherwise preempt each other
    mid-sample); otherwise every rank runs it, the same number of calls everywhere.
    setting(impl): a context the implementation's calls run in (switches a global mode).
    warm_first: one untimed call after entering the setting, before each sample (a setting that
    invalidates a cache would otherwise charge the first call's miss to the sample).
    calibration(fn, sample_s, slowest) -> calls per sample (calibrate, or calibrate_one_call)."""
    import torch.distributed as dist

    counts = {}
    for impl, fn in fns.items():
        with setting(impl):
            if not solo[impl]:
                counts[impl] = calibration(fn, sample_s, slowest_rank)
            elif rank == 0:
                counts[impl] = calibration(fn, sample_s, lambda e: e)
    gc.collect()
    samples: dict = {impl: [] for impl in fns}
    order = list(fns)
    for rep in range(repeats):
        for impl in order[rep % len(order) :] + order[: rep % len(order)]:  # rotate the order
            gc.collect(0)
            dist.barrier()
            if solo[impl] and rank != 0:
                continue
            fn, n = fns[impl], counts[impl]
            with setting(impl):
                if warm_first:
                    fn()
                gc.disable()
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                elapsed = time.perf_counter() - start
                gc.enable()
            samples[impl].append(elapsed / n * 1e6)
    return counts, samples


def time_all_reduce(numel: int, repeats: int, calls: int = 50) -> dict:
    """Median µs of one torch.distributed.all_reduce of `numel` floats over the world (gloo)."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(numel)
    for _ in range(5):
        dist.all_reduce(t)
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return summary(samples)
