"""Peak RSS per rank of a Qwen3.5-0.8B-shaped model at its true width (hidden 1024, vocab 248,320,
8 heads / 2 KV heads, head_dim 256, intermediate 3584, the gated delta nets' 16 x 128 heads), depth
cut to --layers (the published 3 linear : 1 full attention pattern's first ones), one training step
(forward, backward, clip, AdamW) on 4 local gloo ranks, without and with hs.recompute.

    python benchmarks/recompute_memory.py --layers 4 --seq 1024 --batch 4

Per configuration and rank: the resident set after the model is built (params), the peak over
forward + backward (where the activations live; AdamW's state is made after it), the peak over the
whole step (VmHWM), and the step peak's growth (the activations, gradients and optimizer state
the step adds: its activations and gradients; AdamW's state is made at the step's end). The model
is built by hs.from_pretrained from a folder holding only its config.json (each rank materialises
its own shards). glibc's mmap threshold is fixed so that large tensors are their own mappings and
freeing them shrinks the resident set. A warm-up step on 32-token sequences first takes what a
process allocates once (thread pools, gloo buffers, plan caches); its gradients are dropped and the
measured step starts with a fresh AdamW."""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile

MESHES = {
    "dp2_tp2": ((2, 2), ("dp", "tp"), False),
    "fully_shard_dp4": ((4,), ("dp",), True),
}


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rank(rank: int, world: int, layers: int, seq: int, batch: int, configs: list) -> dict:
    import torch
    from safetensors.torch import save_file

    import hypershard as hs
    from hypershard.planner.step import load_config

    torch.manual_seed(0)
    config = load_config("qwen3_5_0_8b", num_hidden_layers=layers)
    config.use_cache = False
    out = {}
    for name, mode in configs:
        shape, names, fully = MESHES[name]
        mesh = hs.init_device_mesh("cpu", shape, names)

        def build():
            # read from a folder that holds only config.json: hs.from_pretrained lays the model out on
            # the meta device and materialises each rank's shards only (init_missing, from the seed)
            folder = tempfile.mkdtemp(prefix=f"hs_rss_{rank}_")
            config.save_pretrained(folder)
            save_file({}, os.path.join(folder, "model.safetensors"))  # no tensors: every one initialised
            model = hs.from_pretrained(folder, mesh, fully_shard=fully, seed=0).train()
            shutil.rmtree(folder)
            if mode != "none":
                hs.recompute(model, mode=mode)
            return model

        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)

        def step(model, ids=ids, marks=None):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
            if marks is not None:
                marks["fwd_bwd_peak"] = _kib("VmHWM")  # activations live here; AdamW's state not yet
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            return optimizer

        model = build()
        step(model, ids[:, :32])  # a short warm-up step: what a process allocates once, not the activations
        model.zero_grad(set_to_none=True)
        gc.collect()
        built = _kib("VmRSS")
        _reset_peak()
        marks: dict = {}
        optimizer = step(model, marks=marks)
        peak = _kib("VmHWM")
        out[f"{name} recompute={mode}"] = {
            "built_mb": built / 1024,
            "fwd_bwd_peak_mb": marks["fwd_bwd_peak"] / 1024,
            "peak_mb": peak / 1024,
            "growth_mb": (peak - built) / 1024,
        }
        del model, optimizer
        gc.collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--meshes", default="dp2_tp2,fully_shard_dp4")
    p.add_argument("--modes", default="none,selective,full")
    args = p.parse_args()
    from hypershard.launch import spawn_local_ranks

    configs = [(m, r) for m in args.meshes.split(",") for r in args.modes.split(",")]
    results = [{} for _ in range(4)]
    for config in configs:  # one launch each: fresh processes, nothing left from the configuration before
        got = spawn_local_ranks(
            _rank,
            4,
            args.layers,
            args.seq,
            args.batch,
            [config],
            timeout=3000,
            env={"MALLOC_MMAP_THRESHOLD_": "65536"},
        )
        for mine, theirs in zip(results, got):
            mine.update(theirs)
        key = f"{config[0]} recompute={config[1]}"
        print(
            f"{key:32s} forward+backward peak MB per rank: "
            + " ".join(f"{r[key]['fwd_bwd_peak_mb']:.0f}" for r in got)
            + "   step peak MB: "
            + " ".join(f"{r[key]['peak_mb']:.0f}" for r in got)
            + "   growth over the step MB: "
            + " ".join(f"{r[key]['growth_mb']:.0f}" for r in got),
            flush=True,
        )
    print(json.dumps({"layers": args.layers, "seq": args.seq, "batch": args.batch, "per_rank": results}, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
