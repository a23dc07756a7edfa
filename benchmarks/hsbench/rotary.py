"""Section "rotary": hypershard's fused rotary position embedding
(`hypershard.ops.rotary_position_embedding`, one C++ pass with its own backward) against the same
maths composed from cat/neg/mul/stack (`rotary_position_embedding_composed`), forward and
forward + backward, on a training-sized q/k tensor x [B, N, S, D] with cos/sin [1, 1, S, D]:

  1device   plain tensors on one device (rank 0 of the launch, the other rank waiting)
  2rank_tp  hypershard DTensors on a 2-rank CPU mesh, x (and its gradient) Shard(1) (heads),
            cos/sin Replicate, strict mode; torch DTensor runs the composed form on the same
            placements (it has no fused rotary op); plain eager on this rank's local shard
  2rank_dp  the same with x Shard(0) (batch)

Large ops (milliseconds per call), so the per-op sections' timing (>= 10 calls per sample, 20
warm-up calls) is replaced by a lighter one: 2 warm-up calls, then samples of as many calls as
fit in --sample-ms (at least one), the implementations interleaved and rotated as there. The
peak extra memory of one call is measured afterwards in the same processes (RSS high-water mark
over the call, glibc's mmap threshold fixed as in the memory section)."""

from __future__ import annotations

import argparse
import gc
import time
from typing import Callable

from .common import error_text, full_value, geomean, rank0_per_world, ratio, summary
from .memory import malloc_trim, reset_peak_rss, set_mmap_threshold, vm_kib
from .timing import calibrate_one_call, time_interleaved

ROTARY_SHAPE = (4, 16, 512, 128)  # x: B, N (heads), S, D
ROTARY_QUICK_SHAPE = (2, 8, 256, 128)
ROTARY_MODES = (0, 1, 3)  # half (GPT-NeoX), interleave (GPT-J), interleave-half
MODE_NAMES = {0: "half", 1: "interleave", 2: "quarter", 3: "interleave-half"}
ROTARY_DTYPES = ("float32", "bfloat16")
ROTARY_PASSES = ("forward", "forward_backward")
# variant -> the dim x is sharded on (None: one device, plain tensors)
ROTARY_VARIANTS = {"1device": None, "2rank_tp": 1, "2rank_dp": 0}
SINGLE_IMPLS = ("fused", "composed")
SHARDED_IMPLS = ("hypershard_fused", "hypershard_composed", "torch_dtensor_composed", "plain_fused", "plain_composed")
IMPL_TEXT = {
    "fused": "fused",
    "composed": "composed",
    "hypershard_fused": "hypershard fused",
    "hypershard_composed": "hypershard composed",
    "torch_dtensor_composed": "torch DTensor composed",
    "plain_fused": "plain fused (local shard)",
    "plain_composed": "plain composed (local shard)",
}
# max |result - float64 reference| / max |reference| allowed (bf16: the composed form rounds after
# every op, the fused one once)
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
MMAP_THRESHOLD = 64 * 1024


def rotary_inputs(shape, mode: int, dtype, seed: int) -> tuple:
    """x, cos, sin and the output gradient g, identical on every rank. cos/sin hold real rotary
    angles (base 10000) laid out as the mode pairs positions: halves (modes 0, 3) or neighbours (1)."""
    import torch

    B, N, S, D = shape
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.arange(S, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = angles.repeat_interleave(2, dim=-1) if mode == 1 else torch.cat((angles, angles), dim=-1)
    cos = angles.cos()[None, None].to(dtype)
    sin = angles.sin()[None, None].to(dtype)
    x = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    return x, cos, sin, g


def _reference(x, cos, sin, g, mode: int) -> tuple:
    """y and dx in float64 from the composed form (on the inputs' rounded values)."""
    import torch
    from hypershard.ops import rotary_position_embedding_composed

    xd = x.double().requires_grad_()
    y = rotary_position_embedding_composed(xd, cos.double(), sin.double(), mode)
    (dx,) = torch.autograd.grad(y, xd, g.double())
    return y.detach(), dx


def _rel_err(result, expected) -> float:
    return float((result.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def time_rotating(fns: dict, solo: dict, rank: int, sample_s: float, repeats: int) -> tuple:
    """(calls per sample, {impl: [ms per call]}): timing.time_interleaved (a barrier before each
    sample, the starting implementation rotated every repeat, the garbage collector off inside a
    sample; solo implementations on rank 0 alone), calibrated from one timed call after a warm-up
    one: these calls take milliseconds."""
    counts, samples = time_interleaved(fns, solo, rank, sample_s, repeats, calibration=calibrate_one_call)
    return counts, {impl: [us / 1e3 for us in values] for impl, values in samples.items()}


def peak_extra_mb(fn: Callable):
    """Growth of the RSS high-water mark over one call (its result held until the mark is read);
    None where the peak cannot be reset. Call it warm: a first call's plans and caches would count."""
    gc.collect()
    malloc_trim()
    base = vm_kib("VmRSS")
    if not reset_peak_rss():
        return None
    result = fn()
    peak = vm_kib("VmHWM")
    del result
    return (peak - base) / 1024


def rotary_worker(rank: int, world: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist
    from hypershard.ops import rotary_position_embedding, rotary_position_embedding_composed
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor as tdistribute

    import hypershard as hs

    from .collectives import CollectiveBytes

    hs.set_strict(True)  # no fallback: an op without a rule raises (and is reported, not timed)
    mesh = hs.init_device_mesh("cpu", (world,), ("x",))
    tmesh = torch_mesh("cpu", (world,), mesh_dim_names=("x",))
    shape = tuple(args["shape"])
    # torch's and hypershard's modules hold millions of objects: a full collection takes ~0.1 s.
    # Frozen, they are left out of every later collection (this section's own garbage is small)
    gc.collect()
    gc.freeze()

    def impl_fn(impl: str, pass_: str, inputs: tuple, mode: int, dim):
        """One call of impl (on the global tensors for "fused"/"composed"): forward (x without
        grad) or forward + backward (dx only: cos/sin are buffers in training) -> its result (y or dx)."""
        x, cos, sin, g = (t.clone() for t in inputs)  # distribute_tensor may alias its input
        if impl.startswith("plain"):
            x, g = x.chunk(world, dim)[rank].clone(), g.chunk(world, dim)[rank].clone()
        elif impl.startswith("hypershard"):
            x, g = (hs.distribute_tensor(t, mesh, [hs.Shard(dim)]) for t in (x, g))
            cos, sin = (hs.distribute_tensor(t, mesh, [hs.Replicate()]) for t in (cos, sin))
        elif impl.startswith("torch_dtensor"):
            x, g = (tdistribute(t, tmesh, [TShard(dim)]) for t in (x, g))
            cos, sin = (tdistribute(t, tmesh, [TReplicate()]) for t in (cos, sin))
        op = rotary_position_embedding if impl.endswith("fused") else rotary_position_embedding_composed
        if pass_ == "forward":
            return lambda: op(x, cos, sin, mode)
        x.requires_grad_()

        def forward_backward():
            return torch.autograd.grad(op(x, cos, sin, mode), x, g)[0]

        return forward_backward

    def agreed(values: list, op) -> list:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def cases():
        """(variant, key, mode, dtype name, pass, inputs, reference, impls, shard dim) of every figure."""
        for mode in args["modes"]:
            for d, dtype_name in enumerate(args["dtypes"]):
                inputs = rotary_inputs(shape, mode, getattr(torch, dtype_name), seed=10 * mode + d)
                reference = _reference(*inputs, mode)
                for variant, dim in ROTARY_VARIANTS.items():
                    impls = SINGLE_IMPLS if dim is None else SHARDED_IMPLS
                    for p, pass_ in enumerate(ROTARY_PASSES):
                        yield (
                            variant,
                            f"mode{mode}_{dtype_name}_{pass_}",
                            mode,
                            dtype_name,
                            pass_,
                            inputs,
                            reference[p],
                            impls,
                            dim,
                        )

    phase_start = time.perf_counter()
    seconds: dict = {}
    variants: dict = {v: {} for v in ROTARY_VARIANTS}
    timed: dict = {}  # (variant, key) -> {impl: solo}, for the memory pass
    for variant, key, mode, dtype_name, pass_, inputs, expected, impls, dim in cases():
        case_start = time.perf_counter()
        entry: dict = {"mode": mode, "mode_name": MODE_NAMES[mode], "dtype": dtype_name, "pass": pass_}
        # one checked call per implementation: its global result vs the float64 reference, and
        # the collectives it runs (hypershard's count; torch's at its dispatcher)
        check, errors, collectives = {}, {}, {}
        for impl in impls:
            try:
                fn = impl_fn(impl, pass_, inputs, mode, dim)
                hs._C.reset_traffic()
                with CollectiveBytes() as counter:
                    result = fn()
                collectives[impl] = (
                    hs._C.traffic()["collectives"] if impl.startswith("hypershard") else counter.collectives
                )
                want = expected if not impl.startswith("plain") else expected.chunk(world, dim)[rank]
                got = full_value(result)
                errors[impl] = _rel_err(got, want) if got.shape == want.shape else float("inf")
                check[impl] = errors[impl] <= TOLERANCE[dtype_name]
            except Exception as exc:  # noqa: BLE001 (recorded; the implementation is not timed)
                check[impl] = error_text(exc)
        # every rank must time the same implementations (the timing runs barriers)
        ok = agreed([int(not isinstance(check[i], str)) for i in impls], dist.ReduceOp.MIN)
        fns = {i: impl_fn(i, pass_, inputs, mode, dim) for i, good in zip(impls, ok) if good}
        counted = agreed([collectives.get(i, 0) for i in impls], dist.ReduceOp.MAX)
        collectives = {i: n for i, n in zip(impls, counted) if i in fns}
        solo = {i: collectives[i] == 0 for i in fns}
        counts, samples = time_rotating(fns, solo, rank, args["sample_s"], args["repeats"])
        timed[(variant, key)] = solo
        del fns
        if rank != 0:
            continue
        stats = {i: summary(s) for i, s in samples.items()}
        for i in impls:
            entry[f"{i}_ms"] = stats[i]["median"] if i in stats else None
        ms = {i: entry[f"{i}_ms"] for i in impls}
        if dim is None:
            entry["fused_vs_composed"] = ratio(ms["fused"], ms["composed"])
            entry["fused_vs_composed_best"] = ratio(
                stats.get("fused", {}).get("min"), stats.get("composed", {}).get("min")
            )
        else:
            entry.update(
                {
                    "fused_vs_composed": ratio(ms["hypershard_fused"], ms["hypershard_composed"]),
                    "fused_vs_composed_best": ratio(
                        stats.get("hypershard_fused", {}).get("min"), stats.get("hypershard_composed", {}).get("min")
                    ),
                    "fused_vs_torch_dtensor_composed": ratio(ms["hypershard_fused"], ms["torch_dtensor_composed"]),
                    "composed_vs_torch_dtensor_composed": ratio(
                        ms["hypershard_composed"], ms["torch_dtensor_composed"]
                    ),
                    # hypershard's overhead on this size: DTensor vs plain eager on the same local shard
                    "fused_vs_plain_fused": ratio(ms["hypershard_fused"], ms["plain_fused"]),
                    "composed_vs_plain_composed": ratio(ms["hypershard_composed"], ms["plain_composed"]),
                    "plain_fused_vs_plain_composed": ratio(ms["plain_fused"], ms["plain_composed"]),
                }
            )
        entry.update(
            {
                "matches_reference": check,
                "max_rel_err": errors,
                "samples_ms": {i: {"min": s["min"], "max": s["max"], "n": s["n"]} for i, s in stats.items()},
                "calls_per_sample": counts,
                "collectives_per_call": collectives,
                "timed_on": {i: "rank 0 alone" if solo[i] else "every rank" for i in solo},
                "seconds": time.perf_counter() - case_start,
            }
        )
        variants[variant][key] = entry

    # peak extra memory of one call, after all timing (the fixed mmap threshold makes freed
    # blocks go back to the OS, so RSS follows live memory, but costs page faults on every call)
    seconds["checks_and_timing"] = time.perf_counter() - phase_start
    phase_start = time.perf_counter()
    set_mmap_threshold(MMAP_THRESHOLD)
    for variant, key, mode, dtype_name, pass_, inputs, expected, impls, dim in cases():
        solo = timed[(variant, key)]
        peaks = {}
        for impl in impls:
            if impl not in solo:
                continue
            fn = impl_fn(impl, pass_, inputs, mode, dim)  # on every rank (distribute_tensor may communicate)
            dist.barrier()
            if solo[impl] and rank != 0:
                continue
            fn()  # warm (plans, caches)
            peaks[impl] = peak_extra_mb(fn)
            del fn
        if rank == 0:
            entry = variants[variant][key]
            entry["peak_extra_mb"] = peaks
            f, c = ("fused", "composed") if dim is None else ("hypershard_fused", "hypershard_composed")
            entry["peak_fused_vs_composed"] = ratio(peaks.get(f), peaks.get(c))
    seconds["memory"] = time.perf_counter() - phase_start
    if rank != 0:
        return {}
    local = {
        v: list(shape) if dim is None else [s // world if i == dim else s for i, s in enumerate(shape)]
        for v, dim in ROTARY_VARIANTS.items()
    }
    return {"variants": variants, "x_local_shape": local, "peak_reset_supported": reset_peak_rss(), "seconds": seconds}


def run_rotary(args: argparse.Namespace, log: Callable) -> dict:
    shape = ROTARY_QUICK_SHAPE if args.quick else ROTARY_SHAPE
    extra: dict = {}
    worker_args = {"shape": shape, "modes": ROTARY_MODES, "dtypes": ROTARY_DTYPES}
    r0 = rank0_per_world("rotary", rotary_worker, (2,), args, log, extra, worker_args=worker_args).get(2)
    out: dict = {
        "x_shape": list(shape),
        "cos_sin_shape": [1, 1, shape[2], shape[3]],
        "modes": list(ROTARY_MODES),
        "dtypes": list(ROTARY_DTYPES),
        "info": extra,
    }
    if r0 is None:
        return out
    out.update(variants=r0["variants"], x_local_shape=r0["x_local_shape"])
    out["info"].update(peak_reset_supported=r0["peak_reset_supported"], rank0_seconds=r0["seconds"])
    summaries = {}
    for variant, entries in r0["variants"].items():
        g: dict = {}
        for pass_ in ROTARY_PASSES:
            rows = [e for e in entries.values() if e["pass"] == pass_]
            g[pass_] = {
                k: geomean([e.get(k) for e in rows])
                for k in (
                    "fused_vs_composed",
                    "fused_vs_composed_best",
                    "peak_fused_vs_composed",
                    "fused_vs_torch_dtensor_composed",
                    "composed_vs_torch_dtensor_composed",
                    "fused_vs_plain_fused",
                )
                if any(k in e for e in rows)
            }
        summaries[variant] = g
    out["summary"] = summaries
    return out


def _fmt(x, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def _pass_text(pass_: str) -> str:
    return "fwd" if pass_ == "forward" else "fwd+bwd"


def _flags(e: dict) -> str:
    """⚠ for each implementation whose result missed the reference or that raised."""
    bad = [
        f"{IMPL_TEXT[i]} {'≠ reference' if c is False else 'raised: ' + str(c)[:80]}"
        for i, c in e.get("matches_reference", {}).items()
        if c is not True
    ]
    return "".join(f" ⚠ {b}" for b in bad)


def rotary_lines(r) -> list:
    """The rotary section's tables for RESULTS.md (report.markdown)."""
    if not r:
        return []
    x, cs = r["x_shape"], r["cos_sin_shape"]
    lines = [
        f"## Rotary position embedding: fused op vs composed form (ms per call; x {x}, cos/sin {cs})",
        "",
        "fused = `hypershard.ops.rotary_position_embedding` (one C++ pass, its own backward); composed = "
        "`rotary_position_embedding_composed` (cat/neg/mul/stack). fwd: x without grad; fwd+bwd: the "
        "forward, then `torch.autograd.grad` for dx (cos/sin without grad, as buffers in training). "
        "Peak = growth of the RSS high-water mark over one call, MB (result included). "
        "Ratios < 1: the fused op is faster / smaller.",
        "",
    ]
    v = r.get("variants", {})
    one = v.get("1device", {})
    if one:
        lines += [
            "One device, plain tensors:",
            "",
            "| mode | dtype | pass | fused | composed | fused / composed | peak MB fused / composed |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for e in one.values():
            p = e.get("peak_extra_mb", {})
            lines.append(
                f"| {e['mode']} {e['mode_name']}{_flags(e)} | {e['dtype']} | {_pass_text(e['pass'])} "
                f"| {_fmt(e.get('fused_ms'))} | {_fmt(e.get('composed_ms'))} "
                f"| {_fmt(e.get('fused_vs_composed'), '{:.2f}x')} "
                f"| {_fmt(p.get('fused'), '{:.1f}')} / {_fmt(p.get('composed'), '{:.1f}')} |"
            )
        lines.append("")
    sharded = {k: es for k, es in v.items() if k != "1device" and es}
    if sharded:
        local = r.get("x_local_shape", {})
        lines += [
            "2-rank CPU mesh, strict mode, cos/sin Replicate; tp = x Shard(1) (heads), dp = x Shard(0) "
            "(batch); local x " + ", ".join(f"{k.split('_')[1]} {local.get(k)}" for k in sharded) + ". "
            "hypershard runs both forms on its DTensors, torch DTensor the composed form (it has no fused "
            "rotary op), plain eager both on this rank's local shard.",
            "",
            "| mesh | mode | dtype | pass | hypershard fused | hypershard composed | torch DTensor composed "
            "| plain fused | plain composed | fused / composed | fused / torch DTensor "
            "| composed / torch DTensor | hypershard fused / plain fused | peak MB fused / composed / torch |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for key, es in sharded.items():
            for e in es.values():
                p = e.get("peak_extra_mb", {})
                lines.append(
                    f"| 2 ranks, {key.split('_')[1]} | {e['mode']} {e['mode_name']}{_flags(e)} | {e['dtype']} "
                    f"| {_pass_text(e['pass'])} | {_fmt(e.get('hypershard_fused_ms'))} "
                    f"| {_fmt(e.get('hypershard_composed_ms'))} | {_fmt(e.get('torch_dtensor_composed_ms'))} "
                    f"| {_fmt(e.get('plain_fused_ms'))} | {_fmt(e.get('plain_composed_ms'))} "
                    f"| {_fmt(e.get('fused_vs_composed'), '{:.2f}x')} "
                    f"| {_fmt(e.get('fused_vs_torch_dtensor_composed'), '{:.2f}x')} "
                    f"| {_fmt(e.get('composed_vs_torch_dtensor_composed'), '{:.2f}x')} "
                    f"| {_fmt(e.get('fused_vs_plain_fused'), '{:.2f}x')} "
                    f"| {_fmt(p.get('hypershard_fused'), '{:.1f}')} / {_fmt(p.get('hypershard_composed'), '{:.1f}')}"
                    f" / {_fmt(p.get('torch_dtensor_composed'), '{:.1f}')} |"
                )
        lines.append("")
    if r.get("summary"):
        lines += [
            "Geometric means over modes and dtypes (fused / composed also from each implementation's fastest sample):",
            "",
            "| variant | pass | fused / composed | (fastest) | fused / torch DTensor composed "
            "| composed / torch DTensor composed | hypershard fused / plain fused | peak fused / composed |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for key, g in r["summary"].items():
            for pass_, s in g.items():
                lines.append(
                    f"| {key.replace('1device', '1 device').replace('2rank_', '2 ranks, ')} "
                    f"| {_pass_text(pass_)} | {_fmt(s.get('fused_vs_composed'), '{:.2f}x')} "
                    f"| {_fmt(s.get('fused_vs_composed_best'), '{:.2f}x')} "
                    f"| {_fmt(s.get('fused_vs_torch_dtensor_composed'), '{:.2f}x')} "
                    f"| {_fmt(s.get('composed_vs_torch_dtensor_composed'), '{:.2f}x')} "
                    f"| {_fmt(s.get('fused_vs_plain_fused'), '{:.2f}x')} "
                    f"| {_fmt(s.get('peak_fused_vs_composed'), '{:.2f}x')} |"
                )
        lines.append("")
    for key, err in r.get("info", {}).items():
        if key.endswith("_error"):
            lines.append(f"⚠ {key}: {err[:300]}\n")
    return lines
