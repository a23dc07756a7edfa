"""LlamaFactory's load_model on hypershard's path builds the model on the meta device and each rank
reads only its shards (hypershard/integrations/llamafactory/loading.py, docs/llamafactory.md,
"Loading").

- In one process (a subprocess: the launcher's stand-ins must be installed before LlamaFactory is
  imported): for full, freeze and LoRA (``additional_target`` too) on an fp32 and a bf16 Qwen3
  folder, and LoRA on Qwen3.5-MoE (per-expert keys), the meta build has exactly the parameters of
  LlamaFactory's own load -- names, shapes, dtypes (its fp32 casts of the trainable weights, peft's
  cast of the adapters to the base dtype), requires_grad -- the LoRA adapters (drawn by peft on CPU)
  equal bit for bit, and the global generator is left in the same state (later draws, the
  dropout masks, are the same); filled then as the trainer fills it (``loading.materialize``), every
  parameter and buffer -- the computed ones, rotary ``inv_freq`` -- equals that load bit for bit
  (a meta build runs transformers' init pass once already; load_meta's must not be skipped by its
  flags, or those buffers keep uninitialised memory and every run's losses differ). The cases that must load whole do, with their reason logged.
- 4 ranks: the bytes each rank allocates for the weights it reads (its shards; counted from the
  local tensors, not RSS, so machine-independent) are 1/4 of the model under fully_shard dp4 (and
  the 4 ranks' sum the model's exactly); under LoRA on dp2 x tp2 fully sharded, between 1/4 (what
  tp splits) and 1/2 (what tp replicates: norms, Qwen3's embedding) of it. The losses of the sharded load equal LlamaFactory's single process
  in test_llamafactory.py / test_llamafactory_lora.py, which now run through it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import llamafactory  # noqa: F401  (make setup installs it: a missing install fails, never skips)
import pytest

from hypershard.testing.llamafactory_fixtures import launch, write_dataset_dir, write_model, write_run

TIMEOUT = 480

COMPARE = r"""
import json, shutil, sys
from pathlib import Path

from hypershard.integrations.llamafactory import launcher

launcher.prepare()
import torch
from llamafactory.hparams import get_train_args
from llamafactory.model import load_model, load_tokenizer

from hypershard.integrations.llamafactory import loading
from hypershard.integrations.llamafactory.adapters import unwrap_peft

cases = json.loads(sys.argv[1])
out = {}


def load(cfg, sharded):
    model_args, _, _, finetuning_args, _ = get_train_args(dict(cfg))
    tokenizer = load_tokenizer(model_args)["tokenizer"]
    torch.manual_seed(0)
    fn = loading.sharded_load_model(load_model) if sharded else load_model
    model = fn(tokenizer, model_args, finetuning_args, True)
    return model, torch.get_rng_state()


for name, cfg in cases.items():
    whole, whole_rng = load(cfg, False)
    meta, meta_rng = load(cfg, True)
    w = dict(whole.named_parameters())
    m = dict(meta.named_parameters())
    row = {
        "names": list(w) == list(m),
        "differs": [
            n for n in w if n in m and (w[n].dtype, w[n].shape, w[n].requires_grad) != (m[n].dtype, m[n].shape, m[n].requires_grad)
        ],
        "real": sorted(n for n, p in m.items() if not p.is_meta),
        "real_equal": all(torch.equal(w[n], p) for n, p in m.items() if not p.is_meta),
        "meta": sum(p.is_meta for p in m.values()),
        "rng": torch.equal(whole_rng, meta_rng),
        "buffers": [
            n for n, b in whole.named_buffers() if dict(meta.named_buffers())[n].dtype != b.dtype
        ],
    }
    # then the trainer's fill (no layout: one rank holds every box): every parameter and buffer
    # (the computed ones, rotary inv_freq, too) equals LlamaFactory's load bit for bit
    report = loading.materialize(unwrap_peft(meta)[0], None)  # the HF model inside, as the trainer
    row["filled"] = report is not None
    row["values"] = [
        n
        for kind in ("named_parameters", "named_buffers")
        for n, t in getattr(whole, kind)(remove_duplicate=False)
        if not (
            (u := dict(getattr(meta, kind)(remove_duplicate=False)).get(n)) is not None
            and not u.is_meta
            and (u.dtype, u.shape) == (t.dtype, t.shape)
            and torch.equal(u, t)
        )
    ]
    out[name] = row
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("llamafactory_loading")
    qwen3 = write_model(root / "qwen3", "qwen3")
    bf16 = root / "qwen3_bf16"  # a bf16 checkpoint, as published ones are
    AutoModelForCausalLM.from_pretrained(qwen3).to(torch.bfloat16).save_pretrained(bf16)
    for f in qwen3.iterdir():
        if f.name.startswith("tokenizer"):
            (bf16 / f.name).write_bytes(f.read_bytes())
    return {
        "root": root,
        "data": write_dataset_dir(root / "data"),
        "qwen3": qwen3,
        "qwen3_bf16": bf16,
        "moe": write_model(root / "moe", "qwen3_5_moe_text"),
    }


def _config(work, model: str, **overrides) -> dict:
    import yaml

    yaml_path = write_run(work["root"] / f"cfg_{model}", work[model], work["data"], work["root"] / "unused_out")
    config = yaml.safe_load(Path(yaml_path).read_text())
    for key in ("use_hyper_parallel", "hyper_parallel_args"):
        config.pop(key, None)
    return {**config, **overrides}


LORA = dict(finetuning_type="lora", lora_target="all", lora_rank=4, lora_alpha=8, lora_dropout=0.1)


def test_meta_build_equals_llamafactory_load(work):
    cases = {
        "full": _config(work, "qwen3"),
        "full_bf16": _config(work, "qwen3_bf16"),
        "freeze_bf16": _config(work, "qwen3_bf16", finetuning_type="freeze", freeze_trainable_layers=1),
        "lora_head": _config(work, "qwen3", additional_target="lm_head", **LORA),
        "lora_bf16": _config(work, "qwen3_bf16", **LORA),
        "lora_moe": _config(work, "moe", **LORA),
        "resize_vocab": _config(work, "qwen3", resize_vocab=True),  # must load whole
    }
    result = subprocess.run(
        [sys.executable, "-c", COMPARE, json.dumps(cases, default=str)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    rows = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for name, row in rows.items():
        assert row["names"] and not row["differs"] and not row["buffers"], (name, row)
        assert not row["values"], f"{name}: after the fill these differ from LlamaFactory's load: {row['values']}"
        assert row["rng"], f"{name}: the meta build leaves the generator elsewhere than LlamaFactory's load"
    for name in ("full", "full_bf16", "freeze_bf16"):
        assert rows[name]["real"] == [] and rows[name]["meta"] > 0, (name, rows[name]["real"][:5])
    for name in ("lora_head", "lora_bf16", "lora_moe"):
        real = rows[name]["real"]
        assert real and all(".lora_A." in n or ".lora_B." in n for n in real), (name, real[:5])
        assert rows[name]["real_equal"], f"{name}: the LoRA adapters differ from LlamaFactory's draws"
    assert rows["resize_vocab"]["meta"] == 0 and not rows["resize_vocab"]["filled"]
    assert "every rank loads the whole model (LlamaFactory's load_model): resize_vocab" in result.stdout


LINE = re.compile(r"rank (\d) of 4 loaded its shards: (\d+) of the model's (\d+) parameter bytes")


def _loaded(stdout: str) -> dict:
    """{rank: (its loaded bytes, the model's parameter bytes)} from the ranks' load lines."""
    return {int(r): (int(local), int(total)) for r, local, total in LINE.findall(stdout)}


@pytest.mark.parametrize(
    "hp, overrides",
    [
        ({"fully_shard": True}, {}),  # full fine-tuning, fully_shard dp4
        # LoRA, dp2 x tp2 fully sharded: make test-full (make test's 40-minute budget; the full
        # fine-tuning case above is its representative, the LoRA meta build is in the test above)
        pytest.param({"tp_size": 2, "fully_shard": True}, LORA, marks=pytest.mark.full),
    ],
    ids=["full_fully_shard_dp4", "lora_dp2_tp2_fully_shard"],
)
def test_each_rank_loads_a_quarter_of_the_model(work, hp, overrides):
    name = "_".join(f"{k}{v}" for k, v in hp.items())
    out = work["root"] / f"out_{name}"
    yaml_path = write_run(work["root"] / name, work["qwen3"], work["data"], out, hp=hp, max_steps=1, **overrides)
    result = launch(yaml_path, 4, None, TIMEOUT)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    loaded = _loaded(result.stdout)
    assert sorted(loaded) == [0, 1, 2, 3], result.stdout[-3000:]
    import torch
    from safetensors import safe_open

    with safe_open(str(work["qwen3"] / "model.safetensors"), "pt") as f:  # fp32: 4 bytes an element
        model_bytes = sum(torch.Size(f.get_slice(k).get_shape()).numel() * 4 for k in f.keys())
    total_local = sum(local for local, _ in loaded.values())
    for rank, (local, total) in loaded.items():
        assert total >= model_bytes  # LoRA adds its adapters, which are not read
        if "tp_size" not in hp:  # fully_shard dp4: a quarter of every tensor
            assert abs(local - model_bytes / 4) <= 0.02 * model_bytes, (
                f"rank {rank} loaded {local} bytes, expected about {model_bytes / 4:.0f} (1/4 of {model_bytes})"
            )
        else:  # tp-sharded tensors 1/4 (tp x dp), tp-replicated ones (norms, the embedding) 1/2 (dp)
            assert model_bytes / 4 <= local < model_bytes / 2, (rank, local, model_bytes)
    if "tp_size" not in hp:
        assert total_local == model_bytes
    else:  # each tp-replicated tensor is held by both tp ranks of a pair, everything else once
        assert model_bytes < total_local < 2 * model_bytes
