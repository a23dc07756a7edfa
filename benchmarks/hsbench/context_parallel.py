"""Section "context_parallel": a small HF Qwen3 trained on one long sequence, with the sequence
sharded over a `cp` mesh axis (`parallelize(..., cp_axis="cp", cp_algorithm=...)`) on 2 and 4
gloo ranks, against the same model on one process (cp=1, a plain model).

For every algorithm of `hypershard.parallel.CP_ALGORITHMS` and cp size (one launch per cp size,
the algorithms one after another in it):

- peak activation memory per rank: the growth of peak RSS (VmHWM, reset right before) over one
  forward + backward, from the RSS before the forward, after a warm-up step; median over the timed
  steps; its ratio to cp=1 (the goal is about 1/cp); and the RSS growth over the forward alone
  (what it leaves for backward: the saved activations) with its ratio to cp=1;
- step time: forward + backward + AdamW step, median of --timed steps (the ranks share the
  machine's cores);
- bytes this rank sends per step (hypershard's traffic counters), forward and backward apart,
  against the formula from the model's shape: ATTENTION_BYTES per attention call (one table keyed
  by algorithm) plus the data-parallel-like gradient sum of the replicated parameters over cp
  (grad_sync's buckets) and the mean loss's packed (sum, count) all-reduce. The forward bytes
  spent inside the attention modules (forward hooks around every `self_attn`) are reported too."""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Callable, NamedTuple, Optional

from .common import error_text, ratio
from .memory import malloc_trim, reset_peak_rss, set_mmap_threshold, vm_kib

# A small Qwen3 whose activations at a long sequence dwarf its parameters (0.92 M, 3.5 MiB in float32):
# the logits of 8k tokens alone are 64 MB. 8 query heads over 4 KV heads (GQA), divisible by cp=4
# so that an algorithm sharding heads (Ulysses) fits.
CP_CONFIG = dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    tie_word_embeddings=False,
)
CP_SEQ, CP_QUICK_SEQ = 8192, 1024
CP_SIZES = (2, 4)
BATCH = 1
FLOAT32_BYTES = 4


class AttentionBlocks(NamedTuple):
    """Bytes of this rank's blocks of one attention call's tensors, the sequence sharded over n
    ranks: query and output [batch, heads, L/n, head_dim], key (= value) [batch, kv_heads, L/n,
    head_dim], logsumexp [batch, heads, L/n] in float32."""

    q: int
    kv: int
    out: int
    lse: int


def attention_blocks(config: dict, batch: int, seq: int, n: int, itemsize: int = FLOAT32_BYTES) -> AttentionBlocks:
    rows = batch * (seq // n)
    q = rows * config["num_attention_heads"] * config["head_dim"] * itemsize
    kv = rows * config["num_key_value_heads"] * config["head_dim"] * itemsize
    return AttentionBlocks(q=q, kv=kv, out=q, lse=rows * config["num_attention_heads"] * FLOAT32_BYTES)


def _ulysses_bytes(n: int, b: AttentionBlocks) -> tuple:
    # every all-to-all sends (n-1)/n of the tensor's local block
    share = (n - 1) / n
    forward = share * (b.q + 2 * b.kv + b.out + b.lse)  # q, k, v in; out, lse back
    backward_in = b.out + b.q + 2 * b.kv + b.out + b.lse  # grad_out, q, k, v, out, lse
    backward_out = b.q + 2 * b.kv  # dq, dk, dv
    backward = share * (backward_in + backward_out)
    return forward, forward + backward


# Bytes one rank sends per attention call: algorithm -> f(n, blocks) = (forward, forward + backward).
# The one place to correct a formula; an algorithm missing here is reported without one.
ATTENTION_BYTES: dict = {
    # K and V all-gathered (forward, and again in backward), dK and dV reduce-scattered back
    "all_gather_kv": lambda n, b: (2 * (n - 1) * b.kv, 6 * (n - 1) * b.kv),
    # K/V blocks passed round the ring; backward passes them again and the dK/dV accumulators
    # travel the whole ring back to their owner
    "ring": lambda n, b: (2 * (n - 1) * b.kv, 2 * (n - 1) * b.kv + (2 * (n - 1) * b.kv + 2 * n * b.kv)),
    "ulysses": _ulysses_bytes,
}


def all_reduce_bytes(numel: int, n: int, rank: int, itemsize: int) -> int:
    """What hypershard's traffic counter books for one all-reduce of `numel` elements over n ranks
    on `rank` (csrc/runtime/redistribute.cpp, count_all_reduce): a reduce-scatter of torch.chunk
    pieces then an all-gather of this rank's piece."""
    if n <= 1:
        return 0
    chunk = -(-numel // n)
    piece = max(0, min(chunk, numel - rank * chunk))
    return ((numel - piece) + piece * (n - 1)) * itemsize


def grad_sync_bytes(param_sizes: list, n: int, rank: int, cap: int, itemsize: int = FLOAT32_BYTES) -> int:
    """The gradient sum of the parameters (Replicate over cp, their gradients Partial(sum)) at the
    end of backward (csrc/runtime/grad_sync.cpp): packed into buckets of at most `cap` bytes in the
    order the gradients arrive (taken as the reverse of the parameters' order), one all-reduce per
    bucket. A model under one cap makes one bucket, whatever the order."""
    total, buckets, current = 0, [], []
    for numel in reversed(param_sizes):
        if current and (sum(current) + numel) * itemsize > cap:
            buckets.append(sum(current))
            current = []
        current.append(numel)
    if current:
        buckets.append(sum(current))
    for numel in buckets:
        total += all_reduce_bytes(numel, n, rank, itemsize)
    return total


def step_formula(
    algorithm: str, config: dict, batch: int, seq: int, n: int, rank: int, param_sizes: list, bucket_cap: int
) -> Optional[dict]:
    """The bytes `rank` sends per training step by the formula, forward and backward apart; None
    for an algorithm without an ATTENTION_BYTES entry."""
    formula = ATTENTION_BYTES.get(algorithm)
    if formula is None:
        return None
    forward, both = formula(n, attention_blocks(config, batch, seq, n))
    layers = config["num_hidden_layers"]
    loss = all_reduce_bytes(2, n, rank, FLOAT32_BYTES)  # the mean loss: packed (sum, count) in float32
    grads = grad_sync_bytes(param_sizes, n, rank, bucket_cap)
    return {
        "attention_forward": layers * forward,
        "attention_backward": layers * (both - forward),
        "loss": loss,
        "grad_sync": grads,
        "forward": layers * forward + loss,
        "backward": layers * (both - forward) + grads,
        "total": layers * both + loss + grads,
    }


def _attention_byte_hooks(model, counter: dict) -> list:
    """Forward hooks around every attention module adding the bytes sent inside it to
    counter["bytes"] (the projections, norms and RoPE around the kernel send nothing under cp)."""
    import hypershard as hs

    handles = []
    for name, module in model.named_modules():
        if name.endswith("self_attn"):

            def before(module, args, kwargs):
                counter["start"] = hs._C.traffic()["bytes_sent"]

            def after(module, args, kwargs, output):
                counter["bytes"] += hs._C.traffic()["bytes_sent"] - counter["start"]

            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, with_kwargs=True))
    return handles


def _build(config, cp: int, algorithm: Optional[str]):
    """A fresh model (same seed every time), parallelized over a cp mesh when cp > 1."""
    import torch

    from hypershard.testing.models import tiny_model

    model = tiny_model(config)
    if cp > 1:
        import hypershard as hs
        from hypershard.parallel import parallelize

        mesh = hs.init_device_mesh("cpu", (cp,), ("cp",))
        model = parallelize(model, mesh, cp_axis="cp", cp_algorithm=algorithm)
    params = list(model.parameters())
    return model, params, torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _run_algorithm(rank: int, cp: int, algorithm: Optional[str], settings: dict) -> dict:
    import torch.distributed as dist

    import hypershard as hs
    from hypershard.testing.models import make_batches, tiny_config

    config = tiny_config("qwen3", **settings["config"], max_position_embeddings=settings["seq"])
    warmup, timed = settings["warmup"], settings["timed"]
    batches = make_batches(config.vocab_size, warmup + timed, batch=BATCH, seq=settings["seq"])
    model, params, optimizer = _build(config, cp, algorithm)
    attention = {"bytes": 0, "start": 0}
    hooks = _attention_byte_hooks(model, attention) if cp > 1 else []
    times, peaks, held_after_forward, losses = [], [], [], []
    sent: dict = {"forward": [], "backward": [], "total": [], "attention_forward": []}
    grad_sync: list = []
    for step, (ids, labels) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        malloc_trim()
        if cp > 1:
            dist.barrier()
            hs._C.reset_traffic()
            hs._C.reset_grad_sync_stats()
        attention["bytes"] = 0
        base = vm_kib("VmRSS")
        exact = reset_peak_rss()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=labels).loss  # transformers' defaults (a KV cache)
        forward = hs._C.traffic()["bytes_sent"]
        held = vm_kib("VmRSS")  # what forward leaves for backward: the saved activations
        loss.backward()
        peak = vm_kib("VmHWM")
        backward = hs._C.traffic()["bytes_sent"] - forward
        optimizer.step()
        elapsed = time.perf_counter() - start
        losses.append(float(loss.detach().item()))
        if step < warmup:
            continue
        times.append(elapsed)
        peaks.append((peak - base) * 1024 if exact else None)
        held_after_forward.append((held - base) * 1024)
        if cp > 1:
            total = hs._C.traffic()["bytes_sent"]
            for key, value in (
                ("forward", forward),
                ("backward", backward),
                ("total", total),
                ("attention_forward", attention["bytes"]),
            ):
                sent[key].append(value)
            grad_sync.append(hs._C.grad_sync_stats())
    for handle in hooks:
        handle.remove()
    param_sizes = [p.numel() for p in params]  # a DTensor's numel is the global one
    out = {
        "step_s": statistics.median(times),
        "step_minmax_s": [min(times), max(times)],
        "peak_growth_bytes": statistics.median(peaks) if None not in peaks else None,
        "peak_growth_bytes_all": peaks,
        "held_after_forward_bytes": statistics.median(held_after_forward),
        "losses": losses,
        "param_bytes": sum(param_sizes) * FLOAT32_BYTES,
        "params": sum(param_sizes),
    }
    if cp > 1:
        out["bytes"] = {key: statistics.median(values) for key, values in sent.items()}
        out["bytes_constant_over_steps"] = all(len(set(values)) == 1 for values in sent.values())
        out["grad_sync_stats"] = grad_sync[-1]
        out["formula"] = step_formula(
            algorithm,
            settings["config"],
            BATCH,
            settings["seq"],
            cp,
            rank,
            param_sizes,
            hs._C.grad_bucket_bytes(),
        )
    del model, params, optimizer
    return out


def _worker(rank: int, world: int, settings: dict) -> dict:
    """One launch: cp = world; every algorithm in turn (cp=1: the plain model once)."""
    import torch.distributed as dist

    set_mmap_threshold(64 * 1024)  # freed activations go back to the OS: RSS follows what is live
    algorithms = settings["algorithms"] if world > 1 else [None]
    out: dict = {}
    for algorithm in algorithms:
        key = algorithm or "one_device"
        try:
            out[key] = _run_algorithm(rank, world, algorithm, settings)
        except Exception as exc:  # noqa: BLE001 -- reported; every rank raises alike, the next still runs
            out[key] = {"error": error_text(exc)}
        gc.collect()
        malloc_trim()
        dist.barrier()
    return out


def run_context_parallel(args, log: Callable) -> dict:
    from hypershard.launch import spawn_local_ranks
    from hypershard.parallel import CP_ALGORITHMS

    seq = args.cp_seq or (CP_QUICK_SEQ if args.quick else CP_SEQ)
    settings = {
        "config": CP_CONFIG,
        "seq": seq,
        "warmup": 1,
        # each step at 8192 tokens takes seconds: fewer than the step section's --timed
        "timed": 2 if args.quick else 3,
        "algorithms": list(CP_ALGORITHMS),
    }
    out: dict = {"config": CP_CONFIG, "batch": BATCH, "seq": seq, "algorithms": list(CP_ALGORITHMS), "runs": {}}
    for cp in (1, *CP_SIZES):
        log(f"context_parallel: cp={cp}, {seq} tokens ...")
        start = time.perf_counter()
        try:
            ranks = spawn_local_ranks(_worker, cp, settings, timeout=args.timeout)
        except Exception as exc:  # noqa: BLE001 -- reported, the other cp sizes still run
            out["runs"][str(cp)] = {"error": error_text(exc)}
            log(f"  failed: {error_text(exc)}")
            continue
        out["runs"][str(cp)] = _summarise(ranks)
        out["runs"][str(cp)]["seconds"] = time.perf_counter() - start
        log(f"  done in {time.perf_counter() - start:.0f} s")
    _compare(out)
    return out


def _summarise(ranks: list) -> dict:
    """Per algorithm: rank 0's figures, the max peak over ranks, every rank's bytes against its formula."""
    summary: dict = {}
    for key, r0 in ranks[0].items():
        if "error" in r0:
            summary[key] = r0
            continue
        peaks = [r[key].get("peak_growth_bytes") for r in ranks]
        held = [r[key]["held_after_forward_bytes"] for r in ranks]
        entry = {
            **r0,
            "peak_growth_bytes_per_rank": peaks,
            "peak_growth_bytes_max": max(peaks) if None not in peaks else None,
            "held_after_forward_bytes_per_rank": held,
            "held_after_forward_bytes_max": max(held),
            "step_s_per_rank": [r[key]["step_s"] for r in ranks],
        }
        if "bytes" in r0:
            entry["bytes_per_rank"] = [r[key]["bytes"] for r in ranks]
            entry["formula_per_rank"] = [r[key]["formula"] for r in ranks]
            if r0["formula"] is not None:
                ratios = [ratio(r[key]["bytes"]["total"], r[key]["formula"]["total"]) for r in ranks]
                entry["measured_vs_formula"] = ratio(r0["bytes"]["total"], r0["formula"]["total"])
                entry["measured_vs_formula_forward"] = ratio(r0["bytes"]["forward"], r0["formula"]["forward"])
                entry["measured_vs_formula_backward"] = ratio(r0["bytes"]["backward"], r0["formula"]["backward"])
                entry["measured_vs_formula_attention_forward"] = ratio(
                    r0["bytes"]["attention_forward"], r0["formula"]["attention_forward"]
                )
                entry["measured_vs_formula_worst_rank"] = max(ratios, key=lambda x: abs(math.log(x)) if x else 0)
        summary[key] = entry
    return summary


def _compare(out: dict) -> None:
    """Ratios to cp=1: peak memory per rank (max over ranks) and step time; losses against cp=1."""
    single = out["runs"].get("1", {}).get("one_device", {})
    base_peak, base_step = single.get("peak_growth_bytes"), single.get("step_s")
    base_held = single.get("held_after_forward_bytes")
    for cp in CP_SIZES:
        for entry in out["runs"].get(str(cp), {}).values():
            if not isinstance(entry, dict) or "error" in entry:
                continue
            entry["peak_vs_cp1"] = ratio(entry.get("peak_growth_bytes_max"), base_peak)
            entry["held_after_forward_vs_cp1"] = ratio(entry.get("held_after_forward_bytes_max"), base_held)
            entry["step_vs_cp1"] = ratio(entry.get("step_s"), base_step)
            if single.get("losses"):
                entry["loss_max_rel_diff_vs_cp1"] = max(
                    abs(a - b) / max(abs(b), 1e-12) for a, b in zip(entry["losses"], single["losses"])
                )


def context_parallel_lines(r) -> list:
    if not r:
        return []
    mb = 2**20
    lines = [
        f"## Context parallelism (Qwen3, {r['config']['num_hidden_layers']} layers, hidden "
        f"{r['config']['hidden_size']}, {r['config']['num_attention_heads']} heads / "
        f"{r['config']['num_key_value_heads']} KV heads, one sequence of {r['seq']} tokens, float32)",
        "",
        "peak = growth of peak RSS over one forward + backward after a warm-up step, max over ranks "
        "(median of the timed steps); goal ≈ 1/cp of cp=1's. Saved = RSS growth over the forward "
        "alone (what it leaves for backward: the saved activations), max over ranks. Step = forward + backward + AdamW, "
        "median, the ranks sharing the machine's cores. Bytes = sent by rank 0 per step (traffic "
        "counters) vs the formula (attention per ATTENTION_BYTES + the parameters' gradient sum over "
        "cp + the mean loss's all-reduce); attn fwd = bytes sent inside the attention modules in forward.",
        "",
        "| cp | algorithm | peak MB | peak / cp=1 | saved MB | saved / cp=1 | 1/cp | step s | step / cp=1 | MB sent / step "
        "| formula MB | measured / formula (fwd, bwd) | attn fwd / formula | loss vs cp=1 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cp, run in r["runs"].items():
        if "error" in run:
            lines.append(f"| {cp} | failed: {run['error'][:160]} |||||||||||||")
            continue
        for algorithm, e in run.items():
            if not isinstance(e, dict):
                continue
            if "error" in e:
                lines.append(f"| {cp} | {algorithm} failed: {e['error'][:160]} |||||||||||||")
                continue
            peak = e.get("peak_growth_bytes_max", e.get("peak_growth_bytes"))
            held = e.get("held_after_forward_bytes_max", e.get("held_after_forward_bytes"))
            sent, formula = e.get("bytes", {}), e.get("formula") or {}

            def f(x, fmt):
                return "—" if x is None else fmt.format(x)

            diff = e.get("loss_max_rel_diff_vs_cp1")
            lines.append(
                f"| {cp} | {algorithm.replace('_', ' ') if cp != '1' else 'one device'} "
                f"| {f(peak / mb if peak is not None else None, '{:.1f}')} | {f(e.get('peak_vs_cp1'), '{:.2f}')} "
                f"| {f(held / mb if held is not None else None, '{:.1f}')} "
                f"| {f(e.get('held_after_forward_vs_cp1'), '{:.2f}')} | {f(1 / int(cp), '{:.2f}')} | {e['step_s']:.2f} | {f(e.get('step_vs_cp1'), '{:.2f}')} "
                f"| {f(sent['total'] / mb if sent else None, '{:.2f}')} "
                f"| {f(formula['total'] / mb if formula else None, '{:.2f}')} "
                f"| {f(e.get('measured_vs_formula'), '{:.3f}')} ({f(e.get('measured_vs_formula_forward'), '{:.3f}')}, "
                f"{f(e.get('measured_vs_formula_backward'), '{:.3f}')}) "
                f"| {f(e.get('measured_vs_formula_attention_forward'), '{:.3f}')} "
                f"| {f(diff, '{:.1e}')} |"
            )
    lines.append("")
    return lines
