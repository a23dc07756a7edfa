"""Section "llamafactory_true_size": LlamaFactory's own sft stage through hypershard's launcher on
Qwen3.5-0.8B at its true width (hidden 1024, vocabulary 248,320, the published config) with its
depth cut to LAYERS layers (one whole pattern: 3 linear-attention layers, 1 full attention), from a
bf16 safetensors folder of random weights, 4 CPU ranks.

Runs, each its own launch (one after the other, so each process's peak is its own run's):
- full fine-tuning on fully_shard dp4, and LoRA (rank 16, ``lora_target: all``) on dp2 x tp2,
  each loaded shard-wise (the default; LOADS may add "whole", the old way,
  ``HYPERSHARD_LLAMAFACTORY_LOAD=whole``: LlamaFactory's load_model of the whole model on every
  rank, then distributed -- docs/llamafactory.md "Loading" has its figures);
- STEPS training steps each, BATCH sequences per rank per micro-batch, ACCUMULATION micro-batches,
  CUTOFF tokens at most per sequence;
- and LlamaFactory's own single-process run of the same YAML without hypershard, dp times the
  micro-batch (the same global batches: the losses compare), the reference: its peak RSS from
  /proc/self/status VmHWM, printed by a wrapper at exit, its load_model time and its losses.

Precision: the JSON's ``param_dtype: null``, the single process's own: no autocast, LlamaFactory's
dtypes (the trainable weights upcast to float32, a LoRA base kept in the checkpoint's bfloat16: its
products take torch's reference bf16 gemm on this CPU, measured 0.3 GFLOP/s against 56 for float32,
hence the short sequences).
The default ("auto") would compute in bfloat16 from float32 masters, as on a GPU; on this CPU a
bfloat16 matrix product takes torch's reference gemm (no bf16 instructions), which made the dp4
full run take over 40 minutes for 2 steps, and the losses would differ from the single process's
by bfloat16 rounding.

Per rank, from the trainer's load line: the parameter bytes it holds or read, its RSS right after
the model is distributed and its peak RSS up to then (VmHWM); from HF's trainer_state.json: the
losses and the train runtime per step.

    .venv/bin/python -m hsbench.llamafactory_true_size --out bench   (from benchmarks/)
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Callable

LAYERS = 4
STEPS = 2
BATCH, ACCUMULATION, CUTOFF = 1, 1, 32  # kept small: a LoRA base computes in bf16, 0.3 GFLOP/s on this CPU
LOADS = ("sharded", "single")
LINE = re.compile(
    r"rank (\d) of (\d) (?:loaded its shards: (\d+) of the model's (\d+) parameter bytes|holds the model loaded "
    r"whole by LlamaFactory \((\d+) parameter bytes\)).*?; RSS ([\d.]+) MB, peak ([\d.]+) MB"
    r"(?:; load ([\d.]+) s)?"
)
RUNS = (
    # (name, hyper_parallel_args, YAML overrides, dp: the single process's batch multiple)
    ("full_fully_shard_dp4", {"fully_shard": True, "param_dtype": None}, {}, 4),
    (
        "lora_dp2_tp2",
        {"tp_size": 2, "param_dtype": None},
        dict(finetuning_type="lora", lora_target="all", lora_rank=16, lora_alpha=32),
        2,
    ),
)


def write_folder(folder: Path, layers: int = LAYERS) -> dict:
    """The bf16 checkpoint (transformers' own init, seed 0) and the fixtures' byte-level tokenizer."""
    import torch

    from hypershard.planner.step import _model_class, load_config
    from hypershard.testing.llamafactory_fixtures import _texts, write_tokenizer

    config = load_config("qwen3_5_0_8b", num_hidden_layers=layers)
    marker = folder / "hs_bench_config.json"
    key = config.to_json_string(use_diff=False)
    if marker.is_file() and json.loads(marker.read_text()).get("config") == key:
        return json.loads(marker.read_text())["info"]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    model = _model_class(config)._from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    model.save_pretrained(folder)
    info = {"params": sum(p.numel() for p in model.parameters()), "layers": layers}
    del model
    write_tokenizer(folder, _texts())
    info["file_bytes"] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    marker.write_text(json.dumps({"config": key, "info": info}))  # last: the folder is complete
    return info


def parse(stdout: str) -> dict:
    """{rank: {bytes, total, rss_mb, peak_mb, load_s, sharded}} from the ranks' load lines (load_s:
    from LlamaFactory's load_model entered to the model distributed and filled)."""
    ranks = {}
    for rank, _, local, total, whole, rss, peak, load in LINE.findall(stdout):
        ranks[int(rank)] = {
            "sharded": bool(local),
            "bytes": int(local or whole),
            "total": int(total or whole),
            "rss_mb": float(rss),
            "peak_mb": float(peak),
            "load_s": float(load) if load else None,
        }
    for rank, peak in TRAINED.findall(stdout):  # the whole run's peak, printed when training ended
        if int(rank) in ranks:
            ranks[int(rank)]["run_peak_mb"] = float(peak)
    return ranks


# Runs LlamaFactory in this process through hypershard's launcher (one process: no torchrun) and
# prints the process's peak RSS at exit and the seconds its load_model took (the single-process
# reference has no load line of ours).
_SINGLE = (
    "import atexit, re, runpy, sys, time\n"
    "import llamafactory.model as model_package\n"  # before the sft workflow imports its load_model
    "real_load = model_package.load_model\n"
    "def timed_load(*args, **kwargs):\n"
    "    start = time.perf_counter()\n"
    "    model = real_load(*args, **kwargs)\n"
    "    print('single process load', round(time.perf_counter() - start, 1), 's', flush=True)\n"
    "    return model\n"
    "model_package.load_model = timed_load\n"
    "def peak():\n"
    "    text = open('/proc/self/status').read()\n"
    "    print('single process peak RSS', int(re.search(r'VmHWM:\\s+(\\d+) kB', text).group(1)) / 1e3, 'MB', flush=True)\n"
    "atexit.register(peak)\n"
    "sys.argv = ['hypershard.integrations.llamafactory', 'train', sys.argv[1]]\n"
    "runpy.run_module('hypershard.integrations.llamafactory', run_name='__main__', alter_sys=True)\n"
)
TRAINED = re.compile(r"rank (\d) of \d trained; RSS [\d.]+ MB, peak ([\d.]+) MB")
SINGLE_PEAK = re.compile(r"single process peak RSS ([\d.]+) MB")
SINGLE_LOAD = re.compile(r"single process load ([\d.]+) s")


def _single_process(yaml_path: Path, timeout: float):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NPROC_PER_NODE", None)
    return subprocess.run(
        [sys.executable, "-c", _SINGLE, str(yaml_path)], capture_output=True, text=True, timeout=timeout, env=env
    )


def _losses_and_step(run_dir: Path) -> dict:
    state = run_dir / "out" / "trainer_state.json"
    if not state.is_file():
        return {}
    history = json.loads(state.read_text())["log_history"]
    runtime = [e["train_runtime"] for e in history if "train_runtime" in e]
    return {
        "losses": [e["loss"] for e in history if "loss" in e],
        "step_seconds": runtime[0] / STEPS if runtime else None,
    }


def run(out: Path, log: Callable = print, timeout: float = 2400) -> dict:
    from hypershard.testing.llamafactory_fixtures import launch, write_dataset_dir, write_run

    folder = out / "llamafactory_true_size" / "qwen3_5_0_8b_cut"
    log(f"  checkpoint {folder} ...")
    info = write_folder(folder)
    data = write_dataset_dir(out / "llamafactory_true_size" / "data")
    results = {"checkpoint": info, "runs": {}}
    for name, hp, overrides, dp in RUNS:
        for load in LOADS:
            label = f"{name}_{load}"
            run_dir = out / "llamafactory_true_size" / label
            shutil.rmtree(run_dir, ignore_errors=True)
            yaml_path = write_run(
                run_dir,
                folder,
                data,
                run_dir / "out",
                hp=None if load == "single" else hp,
                max_steps=STEPS,
                cutoff_len=CUTOFF,
                per_device_train_batch_size=BATCH * (dp if load == "single" else 1),
                gradient_accumulation_steps=ACCUMULATION,
                **overrides,
            )
            start = time.perf_counter()
            if load == "single":  # LlamaFactory alone, one process: the per-rank figures' reference
                result = _single_process(yaml_path, timeout)
                peak, load_s = SINGLE_PEAK.search(result.stdout), SINGLE_LOAD.search(result.stdout)
                ranks = {
                    0: {
                        "sharded": False,
                        "bytes": 0,
                        "total": 0,
                        "rss_mb": 0.0,
                        "peak_mb": float(peak.group(1)) if peak else 0.0,
                        "run_peak_mb": float(peak.group(1)) if peak else 0.0,
                        "load_s": float(load_s.group(1)) if load_s else None,
                    }
                }
                ranks = ranks if peak else {}
            else:
                result = launch(yaml_path, 4, {"HYPERSHARD_LLAMAFACTORY_LOAD": load}, int(timeout))
                ranks = parse(result.stdout)
            seconds = time.perf_counter() - start
            row = {"returncode": result.returncode, "seconds": seconds, "ranks": ranks, **_losses_and_step(run_dir)}
            if "losses" not in row:
                row["tail"] = (result.stdout + result.stderr)[-3000:]
            results["runs"][label] = row
            peaks = [r["peak_mb"] for r in row["ranks"].values()]
            log(f"  {label}: exit {result.returncode}, {seconds:.0f} s, peak RSS per rank {peaks} MB")
            shutil.rmtree(run_dir / "out", ignore_errors=True)  # the exported model: not needed
    return results


def run_llamafactory_true_size(args, log: Callable) -> dict:
    """benchmarks/run.py's section: the runs above, under --out."""
    return run(Path(args.out).resolve(), log)


def llamafactory_true_size_lines(results) -> list:
    if not results:
        return []
    info = results["checkpoint"]
    return [
        f"## LlamaFactory at true size (Qwen3.5-0.8B at true width, {info['layers']} layers, "
        f"{info['params'] / 1e6:.0f} M parameters, bf16 files; 4 CPU ranks, {STEPS} steps of "
        f"{BATCH} x {ACCUMULATION} sequences per rank, cutoff {CUTOFF}; param_dtype null)",
        "",
        "sharded = hypershard's shard-wise load (the default); whole = LlamaFactory's load_model on every "
        "rank, then distributed; single = LlamaFactory alone in one process with the same global batches "
        "(its peak RSS is the whole run's). Per-rank columns list ranks 0-3; RSS after load, peak to then "
        "and load s (load_model entered to the model distributed and filled) come from each rank's load line.",
        "",
        *lines(results),
        "",
    ]


def lines(results: dict) -> list:
    out = [
        "| run | load | rank bytes (MB) | RSS after load (MB) | peak RSS to then (MB) | peak RSS of the run (MB) "
        "| load s | s / step | losses |"
    ]
    out.append("|---|---|---|---|---|---|---|---|---|")
    for label, row in results["runs"].items():
        name, load = label.rsplit("_", 1)
        ranks = row["ranks"]
        fmt = lambda key, scale=1.0: " / ".join(f"{ranks[r].get(key, float('nan')) / scale:.0f}" for r in sorted(ranks))  # noqa: E731
        step = row.get("step_seconds")
        loads = " / ".join(
            "-" if ranks[r].get("load_s") is None else f"{ranks[r]['load_s']:.1f}" for r in sorted(ranks)
        )
        out.append(
            f"| {name} | {load} | {fmt('bytes', 1e6)} | {fmt('rss_mb')} | {fmt('peak_mb')} | {fmt('run_peak_mb')} "
            f"| {loads} | "
            f"{'-' if step is None else f'{step:.1f}'} | {' / '.join(f'{x:.4f}' for x in row.get('losses', []))} |"
        )
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    results = run(out)
    (out / "llamafactory_true_size.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines(results)))
