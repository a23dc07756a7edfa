"""Section "true_size": real models at their true size on 4 CPU ranks (gloo), loaded straight into
each rank's shards by `hs.from_pretrained` from a HF safetensors checkpoint of random weights.

- **Qwen3.5-0.8B** (the planner's published config, `qwen3_5_0_8b`): loaded as fp32 masters from
  the bf16 files, `hs.mixed_precision` (bf16 compute), 2 AdamW steps with `clip_grad_norm_`, on
  dp2 x tp2 (the model's TP plan, plus fully_shard over dp) and on dp4 fully_shard; and the same
  2 steps on one device (transformers' `from_pretrained` + `hs.mixed_precision`), in its own
  process, run alone. Per rank: load time, bytes read, RSS after the load, peak RSS over the load
  and over the steps, state bytes, losses; each against the one-device run.
- **Qwen3.5-35B-A3B cut to its first 2 layers** (transformers' `qwen3_5_moe_text` defaults: 256
  experts, hidden 2048, vocab 248,320; 2.7 B parameters): loaded in bf16 on ep4 and one
  forward + backward; one device the same when it fits.

The checkpoints are written once (bf16, transformers' own init, seed 0) under
<out>/true_size_ckpt/<name>/ and reused while their config is unchanged (a marker file written
last). Every launch is its own set of processes, run one after the other, so each process's peak
RSS is its own run's and the machine never holds two runs at once."""

from __future__ import annotations

import gc
import json
import shutil
import time
from pathlib import Path
from typing import Callable

from .bf16_bound import loss_bounds
from .common import error_text, ratio
from .memory import malloc_trim, reset_peak_rss, set_mmap_threshold, vm_kib

DENSE = "qwen3_5_0_8b"  # hypershard.planner.step.PUBLISHED
MOE = "qwen3_5_moe_text"  # transformers' default = Qwen3.5-35B-A3B
MOE_LAYERS = 2
# --true-size-scale smoke (and --quick): the same model types and layer patterns, small widths,
# for checking the code path in seconds; the figures mean nothing at that size.
SMOKE = {
    DENSE: dict(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
    ),
    MOE: dict(
        vocab_size=4096,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
}
# meshes of the dense model: (name, shape, axis names, fully_shard over dp)
# dp2 x tp2 is fully sharded over dp too: tp2 alone leaves each rank half of 0.75 B parameters'
# fp32 masters + grads + AdamW (~6 GB a rank, ~24 GB for the 4): more than a 24 GB machine holds.
DENSE_MESHES = (("dp2xtp2_fsdp", (2, 2), ("dp", "tp"), True), ("dp4_fsdp", (4,), ("dp",), True))
LR = 1e-4


def _config(name: str, smoke: bool):
    from hypershard.planner.step import load_config

    overrides = dict(SMOKE[name]) if smoke else {}
    if name == MOE:
        overrides["num_hidden_layers"] = MOE_LAYERS  # load_config keeps the first layers' pattern
    return load_config(name, **overrides)


def _write_checkpoint(rank: int, world: int, name: str, smoke: bool, directory: str) -> dict:
    """In its own process (the whole bf16 model lives here once, then the process ends)."""
    import torch

    from hypershard.planner.step import _model_class

    config = _config(name, smoke)
    torch.manual_seed(0)
    start = time.perf_counter()
    model = _model_class(config)._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="2GB")
    return {"params": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - start}


def checkpoint(name: str, smoke: bool, out: Path, log: Callable, timeout: float) -> tuple:
    """(folder, info): the bf16 random-weight checkpoint of `name`, written unless the cached one
    was written from the same config."""
    from hypershard.launch import spawn_local_ranks

    folder = out / "true_size_ckpt" / (name + ("_smoke" if smoke else ""))
    config = _config(name, smoke)
    key = config.to_json_string(use_diff=False)
    shape = {
        k: getattr(config, k, None)
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "vocab_size",
            "num_experts",
            "num_experts_per_tok",
            "tie_word_embeddings",
        )
    }
    marker = folder / "hs_bench_config.json"
    if marker.is_file() and json.loads(marker.read_text()).get("config") == key:
        info = json.loads(marker.read_text())["info"]
        log(f"  checkpoint {folder} cached")
        return folder, {**info, "config": shape, "cached": True}
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    log(f"  writing the bf16 checkpoint {folder} ...")
    info = spawn_local_ranks(_write_checkpoint, 1, name, smoke, str(folder), timeout=timeout)[0]
    info["file_bytes"] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    marker.write_text(json.dumps({"config": key, "info": info}))  # last: the checkpoint is complete
    return folder, {**info, "config": shape, "cached": False}


def _batch(config, batch: int, seq: int):
    from hypershard.planner.step import make_batch

    return make_batch(config, batch, seq, "cpu", seed=1)


def _mb(kib: int) -> float:
    return kib * 1024 / 1e6


def _ep_plan_same_axis(folder: str) -> dict:
    """The model's TP plan for everything but the experts, to be applied on the ep axis itself:
    the experts sharded over ep by the EP plan, attention / shared expert / embedding / lm_head
    tensor-parallel over the same 4 ranks. Without it every rank holds the non-expert 1.1 B
    parameters and their gradients whole (4 x 4.4 GB in bf16 at this size). The model's TP plan
    has no entry for embed_tokens: the input embedding (0.5 B) stays whole on every rank."""
    from transformers import AutoConfig

    from hypershard.parallel import tp_plan_of
    from hypershard.planner.step import build_model

    model = build_model(AutoConfig.from_pretrained(folder, local_files_only=True))
    return {k: v for k, v in tp_plan_of(model).items() if ".experts" not in k}


def _rank(rank: int, world: int, s: dict) -> dict:
    """One rank: load `s["folder"]` on the mesh, then 2 mixed-precision AdamW steps (dense) or
    one bf16 forward + backward (moe). world 1 = the one-device reference (transformers'
    from_pretrained, no mesh)."""
    import torch
    import torch.distributed as dist

    import hypershard as hs

    from .trainers import lr_at, state_bytes

    set_mmap_threshold(64 * 1024)  # freed blocks go back to the OS: RSS follows live memory
    moe = s["kind"] == "moe"
    dtype = torch.bfloat16 if moe else torch.float32
    # the model's Python modules imported before the clock starts, in both paths: the load time
    # is reading and placing the weights, not importing transformers' modeling code
    from transformers import AutoConfig

    from hypershard.planner.step import _model_class

    _model_class(AutoConfig.from_pretrained(s["folder"], local_files_only=True))
    gc.collect()
    malloc_trim()
    start_kib = vm_kib("VmRSS")
    reset_peak_rss()
    dist.barrier()
    t0 = time.perf_counter()
    if world == 1:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(s["folder"], dtype=dtype, attn_implementation="sdpa")
        bytes_read = sum(f.stat().st_size for f in Path(s["folder"]).glob("*.safetensors"))
    else:
        mesh = hs.init_device_mesh("cpu", tuple(s["shape"]), tuple(s["names"]))
        kw = dict(fully_shard=s["fully_shard"], dtype=dtype)
        if s.get("plan") is not None:
            kw.update(plan=s["plan"], tp_axis="ep")
        model = hs.from_pretrained(s["folder"], mesh, **kw)
        bytes_read = model.hs_load_report.bytes_read
    load_s = time.perf_counter() - t0
    dist.barrier()
    out = {
        "load_s": load_s,
        "bytes_read": bytes_read,
        "start_rss_mb": _mb(start_kib),
        "load_peak_growth_mb": _mb(vm_kib("VmHWM") - start_kib),
        "after_load_growth_mb": _mb(vm_kib("VmRSS") - start_kib),
    }
    config = model.config
    ids, labels = _batch(config, s["batch"], s["seq"])
    model.train()
    params = [p for p in model.parameters()]
    reset_peak_rss()
    if moe:
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=labels).loss
        t1 = time.perf_counter()
        loss.backward()
        dist.barrier()
        out.update(
            forward_s=t1 - t0,
            backward_s=time.perf_counter() - t1,
            losses=[float(loss.detach().item())],
            state=state_bytes(params, []),
        )
    else:
        model = hs.mixed_precision(model)  # bf16 compute from the fp32 masters
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
        losses, times, decreases = [], [], []
        for step in range(s["steps"]):
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            t_l1 = time.perf_counter()
            l1 = _grad_l1(params, s["shape"])  # outside the step's time: a collective of its own
            t0 += time.perf_counter() - t_l1
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, s["steps"], LR)
            decreases.append(optimizer.param_groups[0]["lr"] * l1)  # AdamW's sign step, to first order
            optimizer.step()
            losses.append(float(loss.detach().item()))
            dist.barrier()
            times.append(time.perf_counter() - t0)
        out.update(step_s=times, losses=losses, state=state_bytes(params, [optimizer]), first_order_decreases=decreases)
    out["step_peak_growth_mb"] = _mb(vm_kib("VmHWM") - start_kib)
    out["peak_growth_mb"] = max(out["load_peak_growth_mb"], out["step_peak_growth_mb"])
    out["sent_bytes"] = hs._C.traffic()["bytes_sent"]
    return out


def _grad_l1(params: list, shape) -> float:
    """||g||_1 of the whole model's gradient (before clipping), the same on every rank: each rank
    sums its local gradients' |elements|, a block held by several ranks (Replicate axes) counted
    once."""
    import torch
    import torch.distributed as dist

    import hypershard as hs

    total = 0.0
    for p in params:
        g = p.grad
        if g is None:
            continue
        if hs._C.is_dtensor(g):
            places = list(g.placements)
            assert not any(isinstance(x, hs.Partial) for x in places), "a gradient still Partial after backward"
            copies = 1
            for size, x in zip(shape or (), places):
                copies *= size if isinstance(x, hs.Replicate) else 1
            total += float(hs._C.local_of(g).abs().sum(dtype=torch.float64)) / copies
        else:
            total += float(g.abs().sum(dtype=torch.float64))
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t)
        total = float(t)
    return total


def _launch(world: int, settings: dict, log: Callable, label: str, timeout: float) -> dict:
    from hypershard.launch import spawn_local_ranks

    log(f"  {label} ...")
    t0 = time.perf_counter()
    try:
        # a collective's limit as long as the launch's: a rank may wait at the barrier after the
        # load, or inside a step, for minutes while the others copy and compute on 2 cores
        ranks = spawn_local_ranks(_rank, world, settings, timeout=timeout, pg_timeout=timeout)
    except Exception as exc:  # noqa: BLE001 -- reported, the other runs go on
        log(f"    failed: {error_text(exc)}")
        return {"error": error_text(exc)}
    r0 = ranks[0]
    log(
        f"    {time.perf_counter() - t0:.0f} s; rank 0: load {r0['load_s']:.1f} s, peak growth "
        f"{r0['peak_growth_mb']:.0f} MB, losses {['%.4f' % x for x in r0['losses']]}"
    )
    return {
        "ranks": ranks,
        "peak_growth_mb_max": max(r["peak_growth_mb"] for r in ranks),
        "load_s_max": max(r["load_s"] for r in ranks),
        "bytes_read_max": max(r["bytes_read"] for r in ranks),
        "losses": r0["losses"],
        "first_order_decreases": r0.get("first_order_decreases"),
    }


def _compare(run: dict, single: dict) -> None:
    """Adds the ratios against the one-device run in place."""
    if "error" in run or not single or "error" in single:
        return
    run["peak_vs_single"] = ratio(run["peak_growth_mb_max"], single["peak_growth_mb_max"])
    run["bytes_read_vs_single"] = ratio(run["bytes_read_max"], single["bytes_read_max"])
    run["load_s_vs_single"] = ratio(run["load_s_max"], single["load_s_max"])
    run["max_loss_diff_vs_single"] = max(abs(a - b) for a, b in zip(run["losses"], single["losses"]))


def _check_bf16_losses(run: dict, single: dict, config, tokens: int, log: Callable) -> None:
    """Each step's loss difference against the bound argued in bf16_bound.py (the dense runs)."""
    if "error" in run or not single or "error" in single or not single.get("first_order_decreases"):
        return
    bounds = loss_bounds(
        config.num_hidden_layers, config.hidden_size, config.initializer_range, tokens, single["first_order_decreases"]
    )
    diffs = [abs(a - b) for a, b in zip(run["losses"], single["losses"])]
    run["loss_diffs_vs_single"], run["loss_bounds"] = diffs, bounds
    run["losses_within_bound"] = all(d <= b for d, b in zip(diffs, bounds))
    if not run["losses_within_bound"]:
        log(f"    bf16 loss differences {['%.1e' % d for d in diffs]} exceed the bounds {['%.1e' % b for b in bounds]}")


def run_true_size(args, log: Callable) -> dict:
    # a true-size launch (load + 2 steps of 0.75 B parameters on 2 cores) takes minutes, more on a
    # loaded machine: the per-launch limit is at least an hour
    timeout = max(args.timeout, 3600.0)
    smoke = args.quick or args.true_size_scale == "smoke"
    out_dir = Path(args.out)
    result: dict = {"scale": "smoke" if smoke else "true", "batch": [args.true_size_batch, args.true_size_seq]}
    log(f"true_size ({result['scale']} configs) ...")
    base = dict(batch=args.true_size_batch, seq=args.true_size_seq, steps=2)

    # dense: Qwen3.5-0.8B
    try:
        folder, info = checkpoint(DENSE, smoke, out_dir, log, timeout)
    except Exception as exc:  # noqa: BLE001
        return {**result, "error": f"checkpoint: {error_text(exc)}"}
    dense = {"checkpoint": {**info, "folder": str(folder)}, "meshes": {}}
    common = dict(base, folder=str(folder), kind="dense")
    dense["single"] = _launch(
        1,
        dict(common, shape=None, names=None, fully_shard=False),
        log,
        "Qwen3.5-0.8B one device (transformers from_pretrained)",
        timeout,
    )
    for name, shape, names, fsdp in DENSE_MESHES:
        run = _launch(4, dict(common, shape=shape, names=names, fully_shard=fsdp), log, f"Qwen3.5-0.8B {name}", timeout)
        _compare(run, dense["single"])
        _check_bf16_losses(
            run, dense["single"], _config(DENSE, smoke), args.true_size_batch * (args.true_size_seq - 1), log
        )
        dense["meshes"][name] = run
    result["dense"] = dense

    # MoE: Qwen3.5-35B-A3B, first 2 layers
    if args.true_size_skip_moe:
        result["moe"] = {"skipped": "--true-size-skip-moe"}
        return result
    try:
        folder, info = checkpoint(MOE, smoke, out_dir, log, timeout)
    except Exception as exc:  # noqa: BLE001
        result["moe"] = {"error": f"checkpoint: {error_text(exc)}"}
        return result
    moe = {"checkpoint": {**info, "folder": str(folder)}, "layers": MOE_LAYERS}
    common = dict(base, batch=args.true_size_moe_batch, folder=str(folder), kind="moe")
    moe["batch"] = [args.true_size_moe_batch, args.true_size_seq]
    if args.true_size_moe_single:
        moe["single"] = _launch(
            1,
            dict(common, shape=None, names=None, fully_shard=False),
            log,
            "Qwen3.5-35B-A3B 2 layers one device",
            timeout,
        )
    else:
        moe["single"] = {"skipped": "--no-true-size-moe-single"}
    run = _launch(
        4,
        dict(common, shape=(4,), names=("ep",), fully_shard=False, plan=_ep_plan_same_axis(str(folder))),
        log,
        "Qwen3.5-35B-A3B 2 layers ep4",
        timeout,
    )
    _compare(run, moe["single"])
    moe["ep4"] = run
    result["moe"] = moe
    return result


def _span(r: dict) -> Callable:
    """A cell maker: a figure's min - max over the run's ranks (one number when equal as shown)."""

    def span(key, fmt, scale=1.0):
        vals = [x[key] * scale for x in r["ranks"]]
        lo, hi = fmt.format(min(vals)), fmt.format(max(vals))
        return lo if lo == hi else f"{lo} - {hi}"

    return span


def true_size_lines(r) -> list:
    if not r:
        return []
    title = "## True size: Qwen3.5-0.8B and Qwen3.5-35B-A3B (2 layers) loaded sharded"
    if "error" in r:
        return [title, "", f"failed: {r['error']}", ""]
    lines = [title + (" (SMOKE configs: the figures mean nothing)" if r["scale"] == "smoke" else ""), ""]
    d = r.get("dense", {})
    ck = d.get("checkpoint", {})
    lines += [
        f"Qwen3.5-0.8B, {ck.get('params', 0) / 1e9:.3f} B parameters, random weights, bf16 safetensors "
        f"({ck.get('file_bytes', 0) / 1e9:.2f} GB); loaded as fp32 masters, `hs.mixed_precision` (bf16 compute), "
        f"{len(d.get('single', {}).get('losses', [])) or 2} AdamW steps on batch {r['batch'][0]} x {r['batch'][1]}. "
        "4 ranks on gloo, each process measured on its own: peak = growth of VmHWM over the process's "
        "RSS before the load (load and steps); ranges are min - max over ranks. One device = transformers' "
        "`from_pretrained` + `hs.mixed_precision` in one process.",
        "",
        "| run | load s | GB read | RSS after load GB | peak GB | peak / one device | state GB "
        "| step s | losses | loss diff vs one device |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [("one device", d.get("single"))] + [
        (name.replace("_fsdp", " + fully_shard(dp)").replace("xtp", " x tp"), run)
        for name, run in d.get("meshes", {}).items()
    ]
    lines += [_row(label, run) for label, run in rows]
    m = r.get("moe", {})
    if m and "skipped" not in m:
        ck = m.get("checkpoint", {})
        c = ck.get("config") or {}
        lines += [
            "",
            f"Qwen3.5-35B-A3B cut to its first {m.get('layers')} layers ({ck.get('params', 0) / 1e9:.2f} B "
            f"parameters: {c.get('num_experts')} experts (top-{c.get('num_experts_per_tok')}), hidden "
            f"{c.get('hidden_size')}, vocab {c.get('vocab_size')}; bf16 files {ck.get('file_bytes', 0) / 1e9:.2f} GB), "
            f"loaded in bf16, one forward + backward on batch {m['batch'][0]} x {m['batch'][1]}. ep4: the experts "
            "over ep (the model's EP plan), linear attention, shared expert and lm_head tensor-parallel "
            "over the same 4 ranks (its TP plan, which leaves the 0.5 B input embedding whole on every rank).",
            "",
            "| run | load s | GB read | RSS after load GB | peak GB | peak / one device | params + grads GB "
            "| forward s | backward s | loss | loss diff vs one device |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for label, run in (("one device", m.get("single")), ("ep4", m.get("ep4"))):
            lines.append(_row(label, run, moe=True))
    lines.append("")
    return lines


def _row(label: str, run, moe: bool = False) -> str:
    cols = 11 if moe else 10
    if not run or "skipped" in run:
        return f"| {label} | not run: {(run or {}).get('skipped', '')} |" + " |" * (cols - 2)
    if "error" in run:
        return f"| {label} | failed: {run['error'][:160]} |" + " |" * (cols - 2)
    span = _span(run)
    ratio_cell = f"{run['peak_vs_single']:.2f}x" if run.get("peak_vs_single") else "—"
    diff = run.get("max_loss_diff_vs_single")
    diff_cell = "—" if diff is None else f"{diff:.1e}"
    if run.get("loss_bounds"):  # per step: difference <= its bound (bf16_bound.py), or over it
        diff_cell = ", ".join(
            f"{d:.1e} {'≤' if d <= b else '> BOUND'} {b:.1e}"
            for d, b in zip(run["loss_diffs_vs_single"], run["loss_bounds"])
        )
    losses = ", ".join(f"{x:.4f}" for x in run["losses"])
    cells = [
        label,
        span("load_s", "{:.1f}"),
        span("bytes_read", "{:.2f}", 1e-9),
        span("after_load_growth_mb", "{:.2f}", 1e-3),
        span("peak_growth_mb", "{:.2f}", 1e-3),
        ratio_cell,
        f"{max(x['state']['total_mb'] for x in run['ranks']) * 2**20 / 1e9:.2f}",
    ]
    if moe:
        cells += [span("forward_s", "{:.1f}"), span("backward_s", "{:.1f}"), losses, diff_cell]
    else:
        cells += [
            ", ".join(f"{max(x['step_s'][i] for x in run['ranks']):.1f}" for i in range(len(run["losses"]))),
            losses,
            diff_cell,
        ]
    return "| " + " | ".join(cells) + " |"
