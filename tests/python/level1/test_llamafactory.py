"""LlamaFactory 0.9.5's own sft stage (its YAML, dataset registry, qwen3 template, collator and HF
Trainer loop) training with hypershard as the distributed backend (docs/llamafactory.md).

Every distributed run is compared with LlamaFactory's own single-process run of the same YAML
without use_hyper_parallel, whose per_device_train_batch_size is the distributed run's x dp (a
"device" of HF's batch size is one data-parallel rank): both read the same global micro-batches in
the same order, so only the order of floating-point sums differs (tp partial products, the dp
all-reduce, clip_grad_norm_'s per-shard norms). Losses: relative LOSS_RTOL = 1e-5, the level1
bound (a mean of log-softmax terms, tens of u; measured <= 1e-7 here). Resuming on the same mesh
repeats the same program on the same data: bit for bit. Onto another mesh: LOSS_RTOL.

Launch count is kept low (each multi-process LlamaFactory start costs ~40 s on 2 cores): one
uninterrupted dp2 x tp2 run serves the loss comparison, the HF export and both resumes. Two more
dp2 x tp2 runs train with HF's torch_compile=True (~60 s each), one of them fully sharded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import llamafactory  # noqa: E402,F401  (make setup installs it: a missing install fails, never skips)
import pytest

from hypershard.testing.llamafactory_fixtures import (  # noqa: E402
    read_eval_losses,
    read_losses,
    write_dataset_dir,
    write_model,
    write_run,
    write_vl_dataset_dir,
    write_vl_model,
)
from hypershard.testing.training import LOSS_RTOL  # noqa: E402

TIMEOUT = 300  # seconds per launch; each rank's watchdog fires first and names itself
STEPS = 4
# The Qwen3 runs: a quarter of the data held out and evaluated every 2 steps (eval batch: 4 global
# sequences, like training's micro-batch), a checkpoint every 2 steps.
QWEN3 = dict(val_size=0.25, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2)


def launch(yaml_path, nproc: int, env=None) -> subprocess.CompletedProcess:
    """LlamaFactory through hypershard's launcher: under torchrun (each line tagged with its rank by
    --tee) for nproc > 1, one process otherwise."""
    head = [sys.executable]
    if nproc > 1:
        head += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--tee=3"]
    command = [*head, "-m", "hypershard.integrations.llamafactory", "train", str(yaml_path)]
    full_env = {**os.environ, "HYPERSHARD_LLAMAFACTORY_TIMEOUT": str(TIMEOUT), "OMP_NUM_THREADS": "1",
                **(env or {})}
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT + 60, env=full_env)
    except subprocess.TimeoutExpired as error:
        out = (error.stdout or b"")[-4000:]
        pytest.fail(f"{yaml_path}: launch of {nproc} ranks did not end within {TIMEOUT + 60} s; its output ends:\n{out}")


def ok(result: subprocess.CompletedProcess, what: str) -> None:
    assert result.returncode == 0, f"{what} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def assert_close(got: dict, expected: dict, steps, what: str) -> None:
    for step in steps:
        rel = abs(got[step] - expected[step]) / abs(expected[step])
        assert rel <= LOSS_RTOL, f"{what}: loss of step {step} {got[step]!r} vs {expected[step]!r} (relative {rel:.2e})"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamafactory")
    return {"root": root, "data": write_dataset_dir(root / "data"), "qwen3": write_model(root / "qwen3", "qwen3"),
            "moe": write_model(root / "moe", "qwen3_5_moe_text")}


def run(work, name, model, nproc=1, hp=None, env=None, output=None, **overrides):
    root = work["root"]
    output = output or root / f"out_{name}"
    yaml_path = write_run(root / name, work[model], work["data"], output, hp=hp, **overrides)
    return launch(yaml_path, nproc, env), Path(output)


@pytest.fixture(scope="module")
def qwen3_reference(work):
    """LlamaFactory alone, one process, 4 sequences per micro-batch (= 2 per rank x dp 2 = 1 x dp 4)."""
    result, out = run(work, "qwen3_ref", "qwen3", per_device_train_batch_size=4, per_device_eval_batch_size=4,
                      **QWEN3)
    ok(result, "LlamaFactory's single-process run")
    return out


@pytest.fixture(scope="module")
def qwen3_dp2_tp2(work):
    """Uninterrupted dp2 x tp2 run, a checkpoint every 2 steps."""
    result, out = run(work, "qwen3_dp2_tp2", "qwen3", nproc=4, hp={"tp_size": 2}, per_device_eval_batch_size=2,
                      **QWEN3)
    ok(result, "dp2 x tp2 run")
    return out


def test_qwen3_dp2_tp2_equals_llamafactory_and_exports_hf(work, qwen3_reference, qwen3_dp2_tp2):
    losses = read_losses(qwen3_dp2_tp2)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_close(losses, read_losses(qwen3_reference), range(1, STEPS + 1), "dp2 x tp2 vs LlamaFactory single process")
    evals = read_eval_losses(qwen3_dp2_tp2)
    assert sorted(evals) == [2, 4]
    assert_close(evals, read_eval_losses(qwen3_reference), [2, 4], "dp2 x tp2 eval_loss vs LlamaFactory")
    # save_steps checkpoints are shard-wise (DCP), next to HF's own state files
    ckpt = qwen3_dp2_tp2 / "checkpoint-2"
    assert (ckpt / "hypershard" / "step_00000002" / "COMPLETE").is_file()
    assert {f"rng_state_{r}.pth" for r in range(4)} <= {p.name for p in ckpt.iterdir()}
    assert (ckpt / "trainer_state.json").is_file() and (ckpt / "scheduler.pt").is_file()
    # save_model(): a HuggingFace folder that from_pretrained loads on one device, close to the
    # single-process run's final weights (same updates up to summation order)
    import torch
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(str(qwen3_dp2_tp2), dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(str(work["root"] / "out_qwen3_ref"), dtype=torch.float32)
    init = AutoModelForCausalLM.from_pretrained(str(work["qwen3"]), dtype=torch.float32)
    init_params = dict(init.named_parameters())
    with torch.no_grad():
        for name, p_ref in ref.named_parameters():
            p = got.get_parameter(name)
            moved = float((p_ref - init_params[name]).norm())
            assert float((p - p_ref).norm()) <= 1e-2 * moved + STEPS * 2 ** -24 * float(p_ref.norm()), name


@pytest.mark.parametrize("fully_shard", [False, True], ids=["tp", "fully_shard"])
def test_qwen3_dp2_tp2_torch_compile_equals_llamafactory(work, qwen3_reference, fully_shard):
    """HF Trainer's torch_compile=True (its default backend, inductor) on dp2 x tp2: the trainer's
    accelerator compiles the model through hypershard.compile (the local program with its
    collectives, docs/compile.md), not torch.compile's graph-break floor, and the training and eval
    losses equal LlamaFactory's single uncompiled process within LOSS_RTOL. With fully_shard (every
    decoder layer and the root) each layer's forward is compiled and the groups' gathers and
    reduce-scatters stay eager hooks around it, LlamaFactory's gradient checkpointing on. Default
    mode, as qwen3_dp2_tp2: strict mode stops this YAML, compiled or not, at `view` of a dp-sharded
    [1, 64] batch as [64] (a view that cuts a shard), which default mode redistributes first."""
    what = "fully_shard dp2 x tp2" if fully_shard else "dp2 x tp2"
    hp = {"tp_size": 2, "fully_shard": True} if fully_shard else {"tp_size": 2}
    result, out = run(work, f"qwen3_compiled_{fully_shard}", "qwen3", nproc=4, hp=hp,
                      per_device_eval_batch_size=2, torch_compile=True, **dict(QWEN3, save_strategy="no"))
    ok(result, f"{what} run with torch_compile")
    logs = result.stdout + result.stderr
    assert "compiles through hypershard.compile({'backend': 'inductor'})" in logs, logs[-3000:]
    assert "Dynamo cannot fake" not in logs, "a hypershard DTensor reached Dynamo untraced (the floor)"
    losses = read_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_close(losses, read_losses(qwen3_reference), range(1, STEPS + 1), f"compiled {what} vs LlamaFactory")
    assert_close(read_eval_losses(out), read_eval_losses(qwen3_reference), [2, 4], f"compiled {what} eval_loss")


def test_qwen3_killed_fully_shard_dp4_resumes_on_same_and_other_mesh(work, qwen3_reference, qwen3_dp2_tp2):
    uninterrupted = read_losses(qwen3_dp2_tp2)
    # 1. fully_shard on dp4 (1 sequence per rank), rank 1 killed as step 3 begins (after checkpoint-2)
    killed = work["root"] / "out_killed"
    result, _ = run(work, "fs_dp4", "qwen3", nproc=4, hp={"fully_shard": True, "reshard_after_forward": True},
                    per_device_train_batch_size=1, per_device_eval_batch_size=1, output=killed, **QWEN3,
                    env={"HYPERSHARD_LLAMAFACTORY_CRASH_AT_STEP": "3"})
    assert result.returncode != 0, "the killed run must fail"
    assert "local_rank: 1" in result.stderr or "rank1" in result.stderr, result.stderr[-3000:]
    assert not (killed / "checkpoint-4").exists()
    before = read_losses(killed)  # the checkpoint's log history
    assert sorted(before) == [1, 2]
    assert_close(before, read_losses(qwen3_reference), [1, 2], "fully_shard dp4 vs LlamaFactory single process")
    # 2. the killed fully_shard dp4 run resumed onto dp2 x tp2 (LlamaFactory picks checkpoint-2 itself)
    result, _ = run(work, "resume_other_mesh", "qwen3", nproc=4, hp={"tp_size": 2}, per_device_eval_batch_size=2,
                    output=killed, **QWEN3)
    ok(result, "resume of the fully_shard dp4 checkpoint on dp2 x tp2")
    assert "Resuming training from" in result.stdout + result.stderr
    resumed = read_losses(killed)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert_close(resumed, uninterrupted, [3, 4], "resumed onto another mesh vs the uninterrupted run")
    # 3. same mesh: the uninterrupted run's checkpoint-2 resumed on dp2 x tp2 is bit for bit
    same = work["root"] / "out_same_mesh"
    same.mkdir()
    shutil.copytree(qwen3_dp2_tp2 / "checkpoint-2", same / "checkpoint-2")
    result, _ = run(work, "resume_same_mesh", "qwen3", nproc=4, hp={"tp_size": 2}, per_device_eval_batch_size=2,
                    output=same, **QWEN3)
    ok(result, "resume on the same mesh")
    assert read_losses(same) == uninterrupted  # bit for bit
    assert read_eval_losses(same)[4] == read_eval_losses(qwen3_dp2_tp2)[4]
    from safetensors.torch import load_file

    a, b = load_file(str(same / "model.safetensors")), load_file(str(qwen3_dp2_tp2 / "model.safetensors"))
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_qwen3_5_moe_dp2_ep2_equals_llamafactory(work):
    result, out = run(work, "moe_ref", "moe", per_device_train_batch_size=4)
    ok(result, "LlamaFactory's single-process MoE run")
    reference = read_losses(out)
    result, out = run(work, "moe_dp2_ep2", "moe", nproc=4, hp={"ep_size": 2, "strict": True})
    ok(result, "Qwen3.5-MoE dp2 x ep2 run")
    losses = read_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_close(losses, reference, range(1, STEPS + 1), "Qwen3.5-MoE dp2 x ep2 vs LlamaFactory single process")


def test_qwen3_vl_moe_image_dp2_tp2_equals_llamafactory(work):
    """Qwen3-VL-MoE, every sample with an image, through LlamaFactory's qwen3_vl template, mm_plugin
    and collator (pixel_values, image_grid_thw, mrope position_ids), strict mode on dp2 x tp2, vs
    LlamaFactory's own single process. The processor is transformers' Qwen3VLProcessor with the PIL
    Qwen2-VL image processor; without a loadable torchvision its video processor is the launcher's
    stand-in (docs/llamafactory.md)."""
    root = work["root"]
    model, data = write_vl_model(root / "vl"), write_vl_dataset_dir(root / "vl_data")
    common = dict(dataset="mllm_demo", template="qwen3_vl", cutoff_len=128)
    ref_yaml = write_run(root / "vl_ref", model, data, root / "out_vl_ref", per_device_train_batch_size=4, **common)
    result = launch(ref_yaml, 1)
    ok(result, "LlamaFactory's single-process Qwen3-VL-MoE run")
    assert "<|image_pad|>" in result.stdout + result.stderr  # LlamaFactory's printed example holds the image
    reference = read_losses(root / "out_vl_ref")
    yaml_path = write_run(root / "vl_dp2_tp2", model, data, root / "out_vl_dp2_tp2",
                          hp={"tp_size": 2, "strict": True}, **common)
    result = launch(yaml_path, 4)
    ok(result, "Qwen3-VL-MoE dp2 x tp2 run")
    losses = read_losses(root / "out_vl_dp2_tp2")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_close(losses, reference, range(1, STEPS + 1), "Qwen3-VL-MoE dp2 x tp2 vs LlamaFactory single process")


# bf16: true (LlamaFactory keeps fp32 trainable weights for full fine-tuning and HF's accelerator
# autocasts the forward to bf16). bf16 rounds each activation to u = 2^-8 relative, and which way
# depends on the summation order, which tp changes; the loss, a mean over ~500 token terms of such
# perturbed log-softmax values, moves by about u / sqrt(500) ~ 2e-4: BF16_LOSS_RTOL = 1e-3
# (measured 7e-6 on this model).
BF16_LOSS_RTOL = 1e-3


def test_qwen3_bf16_yaml_dp2_tp2_equals_llamafactory(work):
    result, out = run(work, "bf16_ref", "qwen3", per_device_train_batch_size=4, bf16=True)
    ok(result, "LlamaFactory's single-process bf16 run")
    reference = read_losses(out)
    result, out = run(work, "bf16_dp2_tp2", "qwen3", nproc=4, hp={"tp_size": 2}, bf16=True)
    ok(result, "bf16 dp2 x tp2 run")
    losses = read_losses(out)
    for step in range(1, STEPS + 1):
        rel = abs(losses[step] - reference[step]) / reference[step]
        assert rel <= BF16_LOSS_RTOL, f"bf16 loss of step {step}: {losses[step]!r} vs {reference[step]!r} ({rel:.2e})"


def test_bad_json_fails_on_every_rank(work):
    """A bad hyper_parallel_args file, launched both documented ways. Through the launcher starting torchrun
    itself (FORCE_TORCHRUN=1, NPROC_PER_NODE=2): it is checked before torchrun starts, so the one line is
    printed once, exit 2, and no rank runs (no torchrun failure summary after it). Under torchrun
    directly: every rank reports the one line before LlamaFactory loads the model."""
    yaml_path = write_run(work["root"] / "bad_key", work["qwen3"], work["data"], work["root"] / "out_bad_key",
                          hp={"tp_size": 1, "tensor_parallel": 2})
    via_launcher = launch(yaml_path, 1, env={"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"})
    text = via_launcher.stdout + via_launcher.stderr
    assert via_launcher.returncode == 2, text[-4000:]
    assert text.count("unknown key(s) ['tensor_parallel']") == 1, text[-4000:]
    assert "[default" not in text and "ChildFailedError" not in text, text[-4000:]  # torchrun never started
    under_torchrun = launch(yaml_path, 2)
    assert under_torchrun.returncode != 0
    text = under_torchrun.stdout + under_torchrun.stderr
    for rank in range(2):
        lines = [line for line in text.splitlines() if line.startswith(f"[default{rank}]")
                 and "unknown key(s) ['tensor_parallel']" in line]
        assert lines, f"rank {rank} did not report the unknown key:\n{text[-4000:]}"


def test_bad_json_messages(tmp_path):
    """The checks each rank runs before distributing anything (the launch above shows they reach every rank)."""
    from hypershard.integrations.llamafactory import HyperParallelArguments, HyperParallelConfigError
    from hypershard.testing.models import tiny_config, tiny_model

    path = tmp_path / "hp.json"
    path.write_text(json.dumps({"tp_size": 3}))
    args = HyperParallelArguments.from_file(path)
    with pytest.raises(HyperParallelConfigError, match=r"tp_size=3 does not divide the 4 ranks"):
        args.mesh_spec(4)
    model = tiny_model(tiny_config("qwen3"))  # 4 attention heads
    with pytest.raises(HyperParallelConfigError, match=r"tp_size=8 is larger than the model's 4 attention heads"):
        HyperParallelArguments(tp_size=8).check_model(model)
    with pytest.raises(HyperParallelConfigError, match=r"ep_size=2 but the model has no experts"):
        HyperParallelArguments(ep_size=2).check_model(model)
    with pytest.raises(HyperParallelConfigError, match=r"param_dtype='bf8'; allowed: null, \"auto\", or one of"):
        HyperParallelArguments.from_dict({"param_dtype": "bf8"})
    with pytest.raises(HyperParallelConfigError, match=r"tp_size='2'; allowed: an integer"):
        HyperParallelArguments.from_dict({"tp_size": "2"})
    path.write_text("{not json")
    with pytest.raises(HyperParallelConfigError, match="not valid JSON"):
        HyperParallelArguments.from_file(path)


def test_launcher_registers_only_without_a_real_hyper_parallel(tmp_path):
    """Run in a child so that sys.meta_path / sys.modules changes stay out of the test process."""
    fake = tmp_path / "site" / "hyper_parallel"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    code = (
        "import importlib.util, sys\n"
        "from hypershard.integrations.llamafactory import launcher\n"
        "real = launcher.prepare()\n"
        "spec = importlib.util.find_spec('hyper_parallel')\n"
        "print('registered', real, 'origin', spec.origin)\n"
        "if real:\n"
        "    from hyper_parallel.integration.llamafactory import HyperParallelTrainer, HyperParallelArguments\n"
        "    from hypershard.integrations.llamafactory.trainer import HyperParallelTrainer as T\n"
        "    assert HyperParallelTrainer is T\n"
        "import torchaudio\n"
        "print('stub', getattr(torchaudio, '__hypershard_stub__', False))\n"
        "try:\n"
        "    torchaudio.load\n"
        "except ImportError as error:\n"
        "    print('audio', error)\n")
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "registered True" in plain.stdout
    assert "stub True" in plain.stdout and "audio inputs are not supported" in plain.stdout
    shadowed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert shadowed.returncode == 0, shadowed.stderr[-3000:]
    assert "registered False" in shadowed.stdout and str(fake) in shadowed.stdout
    assert "a real hyper_parallel package is installed" in shadowed.stderr
