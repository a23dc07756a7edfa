"""Section "pipelining": pipeline parallelism (`hs.pipeline`, torch's 1F1B schedule) on pp2 x dp2
against fully sharded data parallelism (`hs.fully_shard` on every decoder layer and the root) on
dp4, 4 CPU ranks, Qwen3.5-0.8B at its true width (hidden 1024, vocab 248,320) with its depth cut to
PP_LAYERS decoder layers (3 linear-attention + 1 full-attention, the model's own pattern), the
embeddings untied (hs.pipeline refuses tied embeddings: they would live on two stages). The same
global batch, the same SGD step (no optimizer state: the comparison is the forward + backward and
its traffic, and the 24 GB machine holds the untied 0.5 B embedding + LM head twice on pp2 x dp2).

Per configuration and rank: the step time (median of the timed steps after --warmup untimed ones),
the peak RSS over the steps, the bytes sent per step on each axis -- dp: hypershard's traffic
counters (the gradient all-reduce on pp2 x dp2, all-gathers + reduce-scatters under fully_shard);
pp: the boundary hidden states stage 0 sends forward and the gradients stage 1 sends back, counted
from the tensors that cross (torch's P2P is not in hypershard's counters) -- and on pp2 x dp2 the
measured bubble of each stage: 1 - (time in its forward/backward microbatch actions) / (time in
the schedule's step), next to the time the stage spent waiting on P2P, against the 1F1B formula
(pp-1)/(m+pp-1) (which assumes equal stages; here the last stage also runs the LM head and the
loss over the 248k vocabulary)."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

from .common import error_text
from .memory import malloc_trim, reset_peak_rss, set_mmap_threshold, vm_kib

MODEL = "qwen3_5_0_8b"  # hypershard.planner.step.PUBLISHED
PP_LAYERS = 4
PP, DP, MICROBATCHES = 2, 2, 4
BATCH = 8  # global sequences per step: 4 microbatches of 2, each split over dp2
SEQ, QUICK_SEQ = 128, 32
CONFIGS = (
    ("pp2xdp2_1f1b", (PP, DP), ("pp", "dp")),
    ("dp4_fully_shard", (4,), ("dp",)),
)
LR = 1e-4


def _config():
    from hypershard.planner.step import load_config

    return load_config(MODEL, num_hidden_layers=PP_LAYERS, tie_word_embeddings=False)


def _worker(rank: int, world: int, s: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    import hypershard as hs
    from hypershard.planner.step import build_model, make_batch

    set_mmap_threshold(64 * 1024)
    config = _config()
    model = build_model(config, device="cpu", seed=0)
    params_total = sum(p.numel() for p in model.parameters())
    mesh = hs.init_device_mesh("cpu", tuple(s["shape"]), tuple(s["names"]))
    pp = "pp" in s["names"]
    timers = {"compute": 0.0, "wait": 0.0, "schedule": 0.0}
    p2p = {"bytes": 0}
    if pp:
        pipe = hs.pipeline(model, mesh, n_microbatches=MICROBATCHES, schedule="1f1b")
        del model
        params = pipe.parameters()

        def timed(key, fn):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    timers[key] += time.perf_counter() - t0

            return wrapper

        stage = pipe.stages[0]
        stage.forward_one_chunk = timed("compute", stage.forward_one_chunk)
        stage.backward_one_chunk = timed("compute", stage.backward_one_chunk)
        schedules._wait_batch_p2p = timed("wait", schedules._wait_batch_p2p)
        pipe.schedule.step = timed("schedule", pipe.schedule.step)
        module = pipe.modules[0]
        forward = module.forward

        def counted(x):
            out = forward(x)
            if not module.spec.last:  # sent to the next stage; its gradient comes back the same size
                p2p["bytes"] += out.numel() * out.element_size()
            if not module.spec.first:  # the gradient of the received hidden states goes back
                p2p["bytes"] += x.numel() * x.element_size()
            return out

        module.forward = counted
    else:
        from hypershard.parallel import parallelize

        model = parallelize(model, mesh)
        # the embedding and the LM head (254 M parameters each) their own groups: the root's group
        # would gather both at once (2 GB a rank, 4 ranks on a 24 GB machine)
        hs.fully_shard(model.model.embed_tokens, mesh)
        hs.fully_shard(model.lm_head, mesh)
        for layer in model.model.layers:
            hs.fully_shard(layer, mesh)
        hs.fully_shard(model, mesh)
        params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    seq = s["seq"]
    steps = s["warmup"] + s["timed"]
    times, sent, losses, p2p_steps, bubbles, waits = [], [], [], [], [], []
    gc.collect()
    malloc_trim()
    base = vm_kib("VmRSS")
    reset_peak_rss()
    for step in range(steps):
        ids, labels = make_batch(config, BATCH, seq, "cpu", seed=1 + step)
        dist.barrier()
        for k in timers:
            timers[k] = 0.0
        p2p["bytes"] = 0
        before = hs._C.traffic()["bytes_sent"]
        t0 = time.perf_counter()
        optimizer.zero_grad()
        if pp:
            loss = pipe.step(ids, labels)
        else:
            loss_t = model(input_ids=ids, labels=labels).loss
            loss_t.backward()
            loss = float(loss_t.detach())
        optimizer.step()
        elapsed = time.perf_counter() - t0
        losses.append(loss)
        if step < s["warmup"]:
            continue
        times.append(elapsed)
        sent.append(hs._C.traffic()["bytes_sent"] - before)
        if pp:
            # forward sends the hidden states; backward sends their gradient (the same size)
            p2p_steps.append(p2p["bytes"])
            bubbles.append(1 - timers["compute"] / timers["schedule"])
            waits.append(timers["wait"] / timers["schedule"])
    out = {
        "step_s": statistics.median(times),
        "step_s_all": times,
        "peak_rss_mb": vm_kib("VmHWM") / 1024,
        "peak_growth_mb": (vm_kib("VmHWM") - base) / 1024,
        "dp_bytes_per_step": statistics.median(sent),
        "params_total": params_total,
        "params_local_bytes": sum((p.to_local() if hs._C.is_dtensor(p) else p).numel() * 4 for p in params),
    }
    if pp:
        out.update(
            stage=pipe.pp_rank,
            pp_bytes_per_step=statistics.median(p2p_steps),
            bubble=statistics.median(bubbles),
            p2p_wait=statistics.median(waits),
        )
    return out


def run_pipelining(args, log: Callable) -> dict:
    from hypershard.launch import spawn_local_ranks

    seq = QUICK_SEQ if args.quick else SEQ
    config = _config()
    hidden = config.hidden_size
    out: dict = {
        "model": f"{MODEL} cut to {PP_LAYERS} layers, untied embeddings",
        "batch": [BATCH, seq],
        "microbatches": MICROBATCHES,
        "bubble_formula": (PP - 1) / (MICROBATCHES + PP - 1),
        # per rank of a stage: m microbatches of (BATCH/m/dp) x seq x hidden fp32, each way
        "pp_bytes_formula": MICROBATCHES * (BATCH // MICROBATCHES // DP) * seq * hidden * 4,
        "configs": {},
    }
    for name, shape, names in CONFIGS:
        log(f"pipelining: {name} on 4 ranks ({out['model']}, batch {BATCH} x {seq}) ...")
        settings = {"shape": shape, "names": names, "seq": seq, "warmup": args.warmup, "timed": args.timed}
        try:
            ranks = spawn_local_ranks(_worker, 4, settings, timeout=args.timeout)
        except Exception as exc:  # noqa: BLE001 -- reported, the other configuration still runs
            log(f"  failed: {error_text(exc)}")
            out["configs"][name] = {"error": error_text(exc)}
            continue
        out["configs"][name] = {"ranks": ranks}
        out["params"] = ranks[0]["params_total"]
    return out


def pipelining_lines(r) -> list:
    if not r:
        return []
    if "error" in r:
        return ["## Pipeline parallelism", "", f"failed: {r['error']}", ""]
    lines = [
        f"## Pipeline parallelism ({r['model']}, {r.get('params', 0) / 1e6:.0f} M parameters, "
        f"batch {r['batch'][0]} x {r['batch'][1]}, 4 CPU ranks, SGD)",
        "",
        f"pp2 x dp2: hs.pipeline, 1F1B, {r['microbatches']} microbatches; dp4: hs.fully_shard (embedding, "
        "LM head, each layer, root). Step = median "
        "of the timed steps (per rank). dp MB = hypershard's traffic counters; pp MB = boundary hidden "
        "states sent forward + their gradients sent back (counted from the tensors that cross; formula "
        f"m x (b/m/dp) x seq x hidden x 4 B = {r['pp_bytes_formula'] / 2**20:.2f} MB per rank). "
        "Bubble = 1 - forward/backward action time / schedule time; wait = time in P2P waits / "
        f"schedule time; 1F1B formula (pp-1)/(m+pp-1) = {r['bubble_formula']:.2f}.",
        "",
        "| configuration | rank | stage | step s | peak RSS MB | dp MB / step | pp MB / step "
        "| bubble measured | P2P wait | bubble formula |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in r["configs"].items():
        if "error" in c:
            lines.append(f"| {name} | failed: {c['error'][:160]} |||||||||")
            continue
        for i, e in enumerate(c["ranks"]):
            pp = "stage" in e
            lines.append(
                f"| {name} | {i} | {e['stage'] if pp else '—'} | {e['step_s']:.2f} | {e['peak_rss_mb']:.0f} "
                f"| {e['dp_bytes_per_step'] / 2**20:.1f} "
                f"| {e['pp_bytes_per_step'] / 2**20:.2f} | {e['bubble']:.2f} | {e['p2p_wait']:.2f} "
                f"| {r['bubble_formula']:.2f} |"
                if pp
                else f"| {name} | {i} | — | {e['step_s']:.2f} | {e['peak_rss_mb']:.0f} "
                f"| {e['dp_bytes_per_step'] / 2**20:.1f} | 0 | — | — | — |"
            )
    lines.append("")
    return lines
