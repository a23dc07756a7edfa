"""LlamaFactory's LoRA, freeze and context parallelism through hypershard (docs/llamafactory.md,
"LoRA and freeze", "Context parallelism"), each against LlamaFactory's own single-process run of
the same YAML (per_device_train_batch_size x dp sequences per micro-batch: the same global batches).

Tolerances. Losses: LOSS_RTOL (1e-5, the level1 bound; only the order of float32 sums differs: tp
partial products, the dp all-reduce, clip_grad_norm_'s per-shard norms). lora_dropout 0.1 is on in
the LoRA runs: every rank draws the whole global mask from the same generator state and keeps its
slice (docs/operators.md, "random"), so the masks are one device's and the losses stay within
LOSS_RTOL. The masks matter little to the losses of 4 tiny steps (measured: the same run without
dropout moves step 3 by 1.2e-5 relative) but much to the adapters: B starts at zero and is what
training made it, and without dropout every B differs by up to 28% of its norm. So each B is
required within 1e-2 of its norm (level1's parameter rule, the update being B itself; measured
6.6e-7), which a different mask stream fails. The outputs of the two peft folders loaded by
PeftModel.from_pretrained on one device: within 1e-4 relative to the logits plus 1e-3 of the
adapters' own effect on them (two trainings that differ in summation order only, as the losses).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import llamafactory  # noqa: F401  (make setup installs it: a missing install fails, never skips)
import pytest
import torch

from hypershard.testing.llamafactory_fixtures import (
    launch,
    read_losses,
    write_dataset_dir,
    write_model,
    write_run,
    write_vl_dataset_dir,
    write_vl_model,
)
from hypershard.testing.training import LOSS_RTOL

TIMEOUT = 480  # seconds per launch (the machine is shared: a 4-rank launch took 60-400 s here)
STEPS = 4
LORA = dict(finetuning_type="lora", lora_target="all", lora_rank=4, lora_alpha=8, lora_dropout=0.1)


def ok(result: subprocess.CompletedProcess, what: str) -> None:
    assert result.returncode == 0, (
        f"{what} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )


def run(work, name, model, nproc=1, hp=None, env=None, output=None, **overrides):
    root = work["root"]
    output = output or root / f"out_{name}"
    yaml_path = write_run(root / name, work[model], work["data"], output, hp=hp, **overrides)
    try:
        return launch(yaml_path, nproc, env, TIMEOUT), Path(output)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{name}: launch of {nproc} ranks did not end in time; its output ends:\n{error.stdout}")


def assert_close(got: dict, expected: dict, steps, what: str) -> None:
    assert sorted(got) == sorted(set(got) | set(steps)), f"{what}: logged steps {sorted(got)}"
    for step in steps:
        rel = abs(got[step] - expected[step]) / abs(expected[step])
        assert rel <= LOSS_RTOL, f"{what}: loss of step {step} {got[step]!r} vs {expected[step]!r} (relative {rel:.2e})"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamafactory_lora")
    return {"root": root, "data": write_dataset_dir(root / "data"), "qwen3": write_model(root / "qwen3", "qwen3")}


def _adapters(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _peft_logits(model_dir: Path, adapter_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is None:
        model = base
    else:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_qwen3_lora_dp2_tp2_equals_llamafactory_peft_folder_and_resumes_on_fully_shard(work):
    """LoRA (all linear layers, rank 4, dropout 0.1, lm_head trained whole as additional_target) on
    dp2 x tp2 in strict mode: losses equal LlamaFactory's single process; checkpoint-2 and the output
    folder are peft adapter folders; PeftModel.from_pretrained of hypershard's folder on one device
    gives the single process's outputs; checkpoint-2 resumed on fully_shard dp4 continues with the
    uninterrupted run's losses."""
    lora = dict(LORA, additional_target="lm_head", save_strategy="steps", save_steps=2)
    result, ref = run(work, "lora_ref", "qwen3", per_device_train_batch_size=4, **lora)
    ok(result, "LlamaFactory's single-process LoRA run")
    reference = read_losses(ref)
    result, out = run(work, "lora_dp2_tp2", "qwen3", nproc=4, hp={"tp_size": 2, "strict": True, "recompute": "full"}, **lora)
    ok(result, "LoRA dp2 x tp2 run")
    # LlamaFactory's default gradient checkpointing, replaced by hs.recompute as the JSON asks
    assert "gradient checkpointing (LlamaFactory's) replaced by hs.recompute(mode='full')" in result.stdout
    assert_close(read_losses(out), reference, range(1, STEPS + 1), "LoRA dp2 x tp2 vs LlamaFactory")

    # the folders: peft's own layout, the same keys as LlamaFactory's, no base weights
    for folder in (out, out / "checkpoint-2"):
        assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists(), folder
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["lora_dropout"] == 0.1
    assert config["modules_to_save"] == ["lm_head"] or "lm_head" in config["modules_to_save"]
    got, expected = _adapters(out), _adapters(ref)
    assert got.keys() == expected.keys() and any("lm_head" in k for k in got), sorted(got)[:6]
    for key, value in expected.items():
        assert got[key].shape == value.shape, key
        if "lora_B" in key:  # moved from zero: the update is B itself (module docstring)
            gap = float((got[key] - value).norm())
            assert gap <= 1e-2 * float(value.norm()), f"{key}: {gap:.3e} from LlamaFactory's ({float(value.norm()):.3e})"
    # the checkpoint's shards hold the trainable parameters only, each laid out as its base layer's
    # style says (DCP's metadata lists the chunks the ranks wrote: a Replicate tensor one, a tp-sharded one two)
    import torch.distributed.checkpoint as dcp

    shards = out / "checkpoint-2" / "hypershard" / "step_00000002"
    assert (shards / "COMPLETE").is_file()
    saved = dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and not [k for k in model_keys if "base_layer" in k or "original_module" in k], model_keys
    prefix = "model.base_model.model.model.layers.0."

    def chunks(name):
        return sorted((tuple(c.offsets), tuple(c.sizes)) for c in saved[prefix + name].chunks)

    for proj, out_features in (("self_attn.q_proj", 32), ("mlp.up_proj", 64)):  # colwise: B on out, A whole
        assert chunks(f"{proj}.lora_B.default.weight") == [((0, 0), (out_features // 2, 4)), ((out_features // 2, 0), (out_features // 2, 4))]
        assert chunks(f"{proj}.lora_A.default.weight") == [((0, 0), (4, 32))]
    for proj, in_features in (("self_attn.o_proj", 32), ("mlp.down_proj", 64)):  # rowwise: A on in, B whole
        assert chunks(f"{proj}.lora_A.default.weight") == [((0, 0), (4, in_features // 2)), ((0, in_features // 2), (4, in_features // 2))]
        assert chunks(f"{proj}.lora_B.default.weight") == [((0, 0), (32, 4))]

    # one device, peft's own loader: hypershard's adapters give LlamaFactory's outputs
    ids = torch.arange(3, 3 + 24).reshape(2, 12)
    base = _peft_logits(work["qwen3"], None, ids)
    ours = _peft_logits(work["qwen3"], out, ids)
    theirs = _peft_logits(work["qwen3"], ref, ids)
    effect = float((theirs - base).abs().max())
    assert effect > 1e-2, f"the adapters barely changed the outputs ({effect:.2e}): the check would be vacuous"
    gap = float((ours - theirs).abs().max())
    assert gap <= 1e-4 * max(1.0, float(theirs.abs().max())) + 1e-3 * effect, f"peft outputs differ by {gap:.2e}"

    # resume checkpoint-2 onto another mesh: fully_shard dp4, one sequence per rank
    resumed = work["root"] / "out_lora_resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    result, _ = run(
        work,
        "lora_resume_fs_dp4",
        "qwen3",
        nproc=4,
        hp={"fully_shard": True, "recompute": "full"},
        per_device_train_batch_size=1,
        output=resumed,
        **lora,
    )
    ok(result, "LoRA resumed on fully_shard dp4")
    assert "Resuming training from" in result.stdout + result.stderr
    assert_close(read_losses(resumed), read_losses(out), [3, 4], "LoRA resumed on fully_shard dp4")


@pytest.mark.full
def test_qwen3_freeze_on_cp2_dp2_equals_llamafactory(work):
    """finetuning_type freeze (the last decoder layer and the norms trainable) on cp2 x dp2:
    the sequence split over cp (the collator pads to a multiple of 2 x cp, labels shifted over the
    whole sequence, head-tail order), losses equal LlamaFactory's single process, and the exported
    model's frozen weights are the pretrained ones bit for bit (no gradient, no update reached them)."""
    freeze = dict(finetuning_type="freeze", freeze_trainable_layers=1, freeze_extra_modules="norm")
    result, ref = run(work, "freeze_ref", "qwen3", per_device_train_batch_size=4, **freeze)
    ok(result, "LlamaFactory's single-process freeze run")
    result, out = run(work, "freeze_cp2_dp2", "qwen3", nproc=4, hp={"cp_size": 2}, **freeze)
    ok(result, "freeze cp2 x dp2 run")
    assert "freeze fine-tuning on the mesh dp2 x cp2" in result.stdout, result.stdout[-2000:]
    assert_close(read_losses(out), read_losses(ref), range(1, STEPS + 1), "freeze cp2 x dp2 vs LlamaFactory")
    from safetensors.torch import load_file

    got = load_file(str(out / "model.safetensors"))
    init = load_file(str(work["qwen3"] / "model.safetensors"))
    expected = load_file(str(ref / "model.safetensors"))
    # LlamaFactory's own partition: its single process moved exactly the trainable weights (layer 1
    # and every "*norm*" weight: freeze_extra_modules matches names by substring)
    trainable = {k for k in expected if not torch.equal(expected[k], init[k])}
    assert {k for k in expected if k.startswith("model.layers.1.")} <= trainable and len(trainable) < len(expected)
    assert all(not torch.equal(got[k], init[k]) for k in trainable), "a trainable weight did not move"
    assert all(torch.equal(got[k], init[k]) for k in expected if k not in trainable), "a frozen weight changed"


# make test-full only (make test stays under 40 minutes on CI's 2 cores; README, "Tests"): the
# Qwen3 LoRA, peft-folder and resume test above is make test's representative of this file.
@pytest.mark.full
@pytest.mark.parametrize(
    "model_type, hp, what",
    [
        ("qwen3_5_text", {"cp_size": 2}, "cp2 x dp2"),
        ("qwen3_5_moe_text", {"ep_size": 2, "strict": True}, "ep2 x dp2"),
        ("deepseek_v32", {"ep_size": 2, "strict": True}, "ep2 x dp2"),
    ],
    ids=["qwen3_5_cp2_dp2", "qwen3_5_moe_ep2_dp2", "deepseek_v32_ep2_dp2"],
)
def test_qwen3_5_lora_equals_llamafactory(work, model_type, hp, what):
    """LoRA on Qwen3.5 (gated delta-net linear attention: its recurrence passed rank to rank over cp,
    natural order) on cp2 x dp2, and on Qwen3.5-MoE (the router and the shared expert's linear
    layers get adapters; the packed experts are not nn.Linear and stay frozen) and DeepSeek-V3.2 (MLA:
    kv_a_proj_with_mqa's adapters Replicate, as its base) on ep2 x dp2 in strict mode: losses equal
    LlamaFactory's single-process LoRA run."""
    work.setdefault(model_type, write_model(work["root"] / model_type, model_type))
    result, ref = run(work, f"{model_type}_ref", model_type, per_device_train_batch_size=4, **LORA)
    ok(result, f"LlamaFactory's single-process LoRA run of {model_type}")
    result, out = run(work, f"{model_type}_lora", model_type, nproc=4, hp=hp, **LORA)
    ok(result, f"{model_type} LoRA {what}")
    assert f"lora fine-tuning on the mesh dp2 x {what.split(' x ')[0]}" in result.stdout, result.stdout[-2000:]
    assert_close(read_losses(out), read_losses(ref), range(1, STEPS + 1), f"{model_type} LoRA {what} vs LlamaFactory")


@pytest.mark.full
def test_qwen3_vl_moe_image_lora_dp2_tp2_equals_llamafactory(work):
    """LoRA on Qwen3-VL-MoE with an image in every sample (template qwen3_vl; LlamaFactory keeps the
    vision tower frozen and out of lora_target) on dp2 x tp2 in strict mode: losses equal
    LlamaFactory's single-process LoRA run."""
    root = work["root"]
    model, data = write_vl_model(root / "vl"), write_vl_dataset_dir(root / "vl_data")
    common = dict(dataset="mllm_demo", template="qwen3_vl", cutoff_len=128, **LORA)
    ref_yaml = write_run(root / "vl_ref", model, data, root / "out_vl_ref", per_device_train_batch_size=4, **common)
    result = launch(ref_yaml, 1, None, TIMEOUT)
    ok(result, "LlamaFactory's single-process Qwen3-VL-MoE LoRA run")
    yaml_path = write_run(root / "vl_tp", model, data, root / "out_vl_tp", hp={"tp_size": 2, "strict": True}, **common)
    result = launch(yaml_path, 4, None, TIMEOUT)
    ok(result, "Qwen3-VL-MoE LoRA dp2 x tp2 run")
    assert "lora fine-tuning on the mesh dp2 x tp2" in result.stdout
    losses = read_losses(root / "out_vl_tp")
    assert_close(losses, read_losses(root / "out_vl_ref"), range(1, STEPS + 1), "Qwen3-VL-MoE LoRA dp2 x tp2")


def test_adapter_plan_and_refusals_in_process():
    """The checks every rank runs before distributing anything, and the plan the LoRA model gets."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    from hypershard.integrations.llamafactory import HyperParallelArguments, HyperParallelConfigError
    from hypershard.integrations.llamafactory.adapters import adapter_plan, check_finetuning, unwrap_peft
    from hypershard.parallel import tp_plan_of
    from hypershard.testing.models import tiny_config, tiny_model

    args = HyperParallelArguments(cp_size=2, tp_size=2)
    assert args.mesh_spec(8) == ((2, 2, 2), ("dp", "cp", "tp"))
    with pytest.raises(HyperParallelConfigError, match=r"cp_size x tp_size x ep_size = 2 x 2 x 1 does not divide"):
        HyperParallelArguments(cp_size=2, tp_size=2).mesh_spec(6)
    with pytest.raises(HyperParallelConfigError, match=r"\['xp_size'\] name\(s\) no mesh axis; allowed sizes: .*cp_size"):
        HyperParallelArguments.from_dict({"xp_size": 2})
    # pp is a mesh axis, but not one HF's Trainer loop runs: its own refusal points to hypershard.sft
    with pytest.raises(HyperParallelConfigError, match=r"pp_size: pipeline parallelism does not run under HF's Trainer"):
        HyperParallelArguments.from_dict({"pp_size": 2})
    with pytest.raises(HyperParallelConfigError, match=r"recompute='partial'; allowed: one of"):
        HyperParallelArguments.from_dict({"recompute": "partial"})
    with pytest.raises(HyperParallelConfigError, match=r"cp_algorithm='ring2'"):
        HyperParallelArguments.from_dict({"cp_algorithm": "ring2"})
    # LlamaFactory's hyper_parallel_cp_size (newer versions) fills cp_size
    assert HyperParallelArguments.from_finetuning_args(SimpleNamespace(hyper_parallel_cp_size=4)).cp_size == 4
    # recompute: "auto" leaves LlamaFactory's gradient checkpointing as it is
    auto = HyperParallelArguments()
    assert auto.recompute_mode(True) is None and HyperParallelArguments(recompute="none").recompute_mode(True) is None
    assert HyperParallelArguments(recompute="selective").recompute_mode(True) == "selective"
    # precision: "auto" is bf16 from fp32 masters for a bf16 checkpoint without YAML bf16/fp16
    model = tiny_model(tiny_config("qwen3"))
    model.config.dtype = torch.bfloat16
    assert auto.precision(model, SimpleNamespace(bf16=False, fp16=False)) == (torch.bfloat16, torch.float32)
    assert auto.precision(model, SimpleNamespace(bf16=True, fp16=False)) == (None, None)
    model.config.dtype = torch.float32
    assert auto.precision(model, SimpleNamespace(bf16=False, fp16=False)) == (None, None)
    assert HyperParallelArguments(param_dtype=None).precision(model) == (None, None)

    def fail(why):
        raise HyperParallelConfigError(why)

    lora = SimpleNamespace(finetuning_type="lora", use_dora=False, pissa_init=False, use_llama_pro=False)
    assert check_finetuning(lora, None, fail) == "lora"
    with pytest.raises(HyperParallelConfigError, match="QLoRA"):
        check_finetuning(lora, "bitsandbytes 4-bit", fail)
    with pytest.raises(HyperParallelConfigError, match="use_dora=true"):
        check_finetuning(SimpleNamespace(**{**vars(lora), "use_dora": True}), None, fail)
    with pytest.raises(HyperParallelConfigError, match="finetuning_type='oft' is not supported"):
        check_finetuning(SimpleNamespace(finetuning_type="oft"), None, fail)

    # the plan: adapters after their base layer's style, hooks left on the wrapper
    config = LoraConfig(r=4, target_modules=["q_proj", "o_proj", "up_proj", "down_proj"], modules_to_save=["lm_head"])
    inner, peft_model = unwrap_peft(get_peft_model(model, config))
    assert inner is model and peft_model is not None
    plan = adapter_plan(inner, tp_plan_of(inner), fail)
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    # the module patterns stay (their hooks go on the LoRA wrapper); the parameters get exact keys
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan[f"{q}.base_layer.weight"] == "colwise" and plan[f"{q}.lora_B.default.weight"] == "colwise"
    assert f"{q}.lora_A.default.weight" not in plan
    assert plan[f"{o}.base_layer.weight"] == "rowwise" and plan[f"{o}.lora_A.default.weight"] == "rowwise"
    assert f"{o}.lora_B.default.weight" not in plan
    head = tp_plan_of(model)["lm_head"]
    assert plan["lm_head.original_module.weight"] == plan["lm_head.modules_to_save.default.weight"] == head
