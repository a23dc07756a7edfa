"""Level1: `python -m hypershard.sft` end to end on tiny models (random init, a tokenizer trained on the
fixtures' text; no hub). A Qwen3 on dp=2 x tp=2 trains 4 steps and writes losses.json, loss_curve.png,
complete checkpoints and an HF export; micro-batches of 2 give the per-step losses and parameters of
whole batches of 4; --stop-after 2 then --resume gives the uninterrupted run's losses bit for bit on
the same mesh and within rtol 1e-5 on tp=2; dp=2 x cp=2 (context parallelism) gives the reference's
losses and parameters in strict mode, with one and with two sequences per dp rank in a micro-batch; a rank killed in step 3 fails the run naming that rank,
and --resume continues from the step-2 checkpoint to the uninterrupted run's losses bit for bit; a
Qwen3.5-MoE trains on multi-turn sharegpt data on dp=2 under torchrun, in strict mode; a --model DIR (the
HF export) is read shard by shard by hs.from_pretrained, fully sharded and on tp=2 alike."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from hypershard.testing.sft_fixtures import write_fixtures

TIMEOUT = 300  # seconds per launch (a 4-rank launch takes ~30 s on 2 cores)
STEPS = 4


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return write_fixtures(tmp_path_factory.mktemp("sft_data"))


def sft(fixtures, output, *extra, model="qwen3", mesh="dp=2,tp=2", data="alpaca", env=None, torchrun=0):
    """Runs the CLI (4 steps of global batch 4 on a fixture dataset) and returns the completed process."""
    args = ["--model", model, "--mesh", mesh, "--tokenizer", str(fixtures["tokenizer"]),
            "--data", str(fixtures[data]), "--output", str(output), "--batch-size", "4",
            "--max-steps", str(STEPS), "--lr", "1e-3", "--warmup-steps", "1", "--min-lr-ratio", "0.1",
            "--weight-decay", "0.01", "--seed", "3", "--save-steps", "2", "--timeout", str(TIMEOUT), *extra]
    head = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun)] if torchrun
            else [sys.executable])
    return subprocess.run([*head, "-m", "hypershard.sft", *args], capture_output=True, text=True,
                          timeout=TIMEOUT + 60, env={**os.environ, **(env or {})})


def ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def losses(output):
    return [r["loss"] for r in json.loads((output / "losses.json").read_text())["steps"]]


def hf_params(output):
    from safetensors.torch import load_file

    params = {}
    for f in sorted((output / "hf").glob("*.safetensors")):
        params.update(load_file(f))
    return params


@pytest.fixture(scope="module")
def reference(fixtures, tmp_path_factory):
    """The uninterrupted run on dp=2 x tp=2 (checkpoints at steps 2 and 4, HF export)."""
    out = tmp_path_factory.mktemp("reference")
    ok(sft(fixtures, out, "--export-hf"))
    return out


@pytest.fixture(scope="module")
def stopped(fixtures, tmp_path_factory):
    """The same run ended by --stop-after 2 (a checkpoint at step 2); tests resume copies of it."""
    out = tmp_path_factory.mktemp("stopped")
    result = ok(sft(fixtures, out, "--stop-after", "2"))
    assert "stopped after step 2 of 4" in result.stdout, result.stdout[-2000:]
    return out


def test_qwen3_trains_and_writes_outputs(reference):
    from hypershard import checkpoint

    summary = json.loads((reference / "losses.json").read_text())
    steps = summary["steps"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and summary["mesh"] == "dp=2,tp=2"
    assert steps[-1]["loss"] < steps[0]["loss"], [r["loss"] for r in steps]
    # Warmup 1: lr 0 at step 1, then the cosine from 1e-3 towards the floor 1e-4.
    assert steps[0]["lr"] == 0.0 and steps[1]["lr"] == pytest.approx(1e-3) and 1e-4 < steps[3]["lr"] < 1e-3
    assert all(r["tokens"] > r["trained_tokens"] > 0 for r in steps)
    assert (reference / "loss_curve.png").stat().st_size > 0
    found = checkpoint.complete_checkpoints(reference / "checkpoints")
    assert [p.name for p in found] == ["step_00000002", "step_00000004"]
    assert (reference / "hf" / "config.json").is_file() and hf_params(reference)
    assert (reference / "hf" / "tokenizer_config.json").is_file()


def test_micro_batches_match_whole_batches(fixtures, reference, tmp_path):
    """Two micro-batches of 2 per step vs one batch of 4, same mesh: each micro-batch loss is divided
    by the whole batch's trained tokens, so the gradients agree up to summation order (per-micro-batch
    partial sums, another padding width): a few float32 ulps. Measured: losses within 4e-8 relative,
    parameters after 4 steps within 4e-8 per tensor in norm. rtol 1e-5 on the losses as in every level1
    comparison. Parameters are compared per tensor in norm, ||p - p_ref|| <= 1e-5 ||p_ref||, not
    elementwise: an element whose gradient is at the rounding-noise level may move by up to lr per
    AdamW step either way (Adam's step is sign-like there; the level1 README's argument); measured
    elementwise the worst near-zero element differs by 7e-3 relative."""
    ok(sft(fixtures, tmp_path, "--micro-batch-size", "2", "--save-steps", "0", "--export-hf"))
    torch.testing.assert_close(losses(tmp_path), losses(reference), rtol=1e-5, atol=0)
    got, expected = hf_params(tmp_path), hf_params(reference)
    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        assert torch.linalg.norm(got[name] - ref) <= 1e-5 * torch.linalg.norm(ref), name


@pytest.mark.parametrize("extra", [("--micro-batch-size", "2"), ("--micro-batch-size", "2", "--fully-shard"), ()],
                         ids=["cp", "cp_fully_shard", "cp_two_sequences_per_dp_rank"])
def test_context_parallel_matches_the_reference(fixtures, reference, tmp_path, extra):
    """dp=2 x cp=2 in strict mode, and with every layer fully sharded over dp (the gradients then
    summed over cp as well as reduce-scattered over dp): every sequence split over cp in head-tail order, padded on the right
    to a multiple of 2 x cp with labels -100 and trained without the padding mask (the model is causal:
    no trained token reads a later pad token), the loss over the global count of trained tokens.
    Micro-batches of one sequence per dp rank (two accumulated per step), or of the whole batch
    (the default: two sequences per dp rank, as the reference's): parallelize's loss keeps the batch
    and sequence dims apart, so no flatten cuts through the cp shards. Equal to the dp=2 x tp=2
    reference up to summation order (measured: within 1e-7 relative in all three), rtol 1e-5 as in every level1
    comparison; parameters per tensor in norm as in test_micro_batches_match_whole_batches."""
    ok(sft(fixtures, tmp_path, "--strict", "--save-steps", "0", "--export-hf", *extra, mesh="dp=2,cp=2"))
    summary = json.loads((tmp_path / "losses.json").read_text())
    expected = json.loads((reference / "losses.json").read_text())
    assert summary["mesh"] == "dp=2,cp=2"
    assert summary["micro_batch_size"] == (2 if extra else 4)
    counts = [(r["tokens"], r["trained_tokens"]) for r in summary["steps"]]
    assert counts == [(r["tokens"], r["trained_tokens"]) for r in expected["steps"]]  # padding not counted
    torch.testing.assert_close(losses(tmp_path), losses(reference), rtol=1e-5, atol=0)
    got, want = hf_params(tmp_path), hf_params(reference)
    assert got.keys() == want.keys()
    for name, ref in want.items():
        assert torch.linalg.norm(got[name] - ref) <= 1e-5 * torch.linalg.norm(ref), name


def test_resume_on_the_same_mesh_is_bit_identical(fixtures, reference, stopped, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    result = ok(sft(fixtures, out, "--resume"))
    assert "finished" in result.stdout
    assert losses(out) == losses(reference)  # bit for bit, the resumed steps 3 and 4 included


def test_resume_on_another_mesh(fixtures, reference, stopped, tmp_path):
    """dp=2 x tp=2 -> tp=2: the checkpoint is resharded; the losses differ only by the summation order
    of the other mesh (measured ~1e-7 relative), rtol 1e-5 as in the level1 comparisons."""
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    ok(sft(fixtures, out, "--resume", mesh="tp=2"))
    got, expected = losses(out), losses(reference)
    assert got[:2] == expected[:2]  # restored from the checkpoint's records
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_crashed_rank_is_named_and_the_run_resumes(fixtures, reference, tmp_path):
    from hypershard import checkpoint

    crashed = sft(fixtures, tmp_path, env={"HYPERSHARD_SFT_CRASH_AT_STEP": "3"})
    assert crashed.returncode == 1, crashed.stdout[-2000:] + crashed.stderr[-3000:]
    assert "hypershard: sft: rank 1 of 4 died (exit code 1)" in crashed.stderr, crashed.stderr[-3000:]
    assert checkpoint.latest(tmp_path / "checkpoints").name == "step_00000002"
    ok(sft(fixtures, tmp_path, "--resume"))
    assert losses(tmp_path) == losses(reference)


def test_qwen3_5_moe_under_torchrun(fixtures, tmp_path):
    """torchrun starts the ranks (the CLI runs its rank function directly); multi-turn sharegpt data
    (12 conversations: 3 steps an epoch, so step 4 starts epoch 1); strict mode: no op of the MoE model
    needs the fallback or an implicit redistribution."""
    result = ok(sft(fixtures, tmp_path, "--strict", "--micro-batch-size", "2", model="qwen3_5_moe_text",
                    mesh="dp=2", data="sharegpt", torchrun=2))
    assert "finished" in result.stdout, result.stdout[-2000:]
    steps = json.loads((tmp_path / "losses.json").read_text())["steps"]
    assert [r["epoch"] for r in steps] == [0, 0, 0, 1]
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in steps)
    assert (tmp_path / "loss_curve.png").stat().st_size > 0
    assert (tmp_path / "checkpoints" / "step_00000004").is_dir()


def test_fully_sharded_run_and_resume_without_it(fixtures, reference, tmp_path):
    """--fully-shard (hs.fully_shard on every decoder layer and the root over dp): the same losses as the
    reference run up to summation order (rtol 1e-5); its step-2 checkpoint (fully sharded layouts) then
    resumes into a plain dp=2 x tp=2 model (resharded on load) with the reference's losses too."""
    first = tmp_path / "fsdp"
    ok(sft(fixtures, first, "--fully-shard", "--stop-after", "2"))
    torch.testing.assert_close(losses(first), losses(reference)[:2], rtol=1e-5, atol=0)
    ok(sft(fixtures, first, "--resume"))
    torch.testing.assert_close(losses(first), losses(reference), rtol=1e-5, atol=0)


# make test-full: two 4-rank launches (212 s on the shared 2-core machine); the offloaded optimizer's
# checkpoint and resume are in make test through test_offload_checkpoint.py, with planted faults.
@pytest.mark.full
def test_offloaded_optimizer_run_and_resume(fixtures, reference, tmp_path):
    """--offload-optimizer (hs.offload_optimizer: AdamW's state and step on the host) with --fully-shard,
    stopped after step 2, then resumed with the offloaded optimizer on the plain dp=2 x tp=2 model (its
    host state read from the fully sharded checkpoint into the tp layouts): the reference's losses up
    to summation order (rtol 1e-5, as in every level1 comparison). Step 4's loss follows a step taken
    with the loaded AdamW state."""
    out = tmp_path / "offload"
    ok(sft(fixtures, out, "--fully-shard", "--offload-optimizer", "--stop-after", "2"))
    torch.testing.assert_close(losses(out), losses(reference)[:2], rtol=1e-5, atol=0)
    ok(sft(fixtures, out, "--offload-optimizer", "--resume"))
    torch.testing.assert_close(losses(out), losses(reference), rtol=1e-5, atol=0)


def test_model_directory_is_loaded_shard_by_shard(fixtures, reference, tmp_path):
    """--model DIR (the reference run's HF export: safetensors written by hypershard.checkpoint.export_hf)
    goes through hs.from_pretrained, each rank reading only its shards; fully sharded on dp=2 x tp=2 and
    plain on tp=2 the runs from it agree (rtol 1e-5: summation order only), and the first loss is below the
    reference run's first (the exported weights were trained 4 steps on the same data)."""
    hf = reference / "hf"
    ok(sft(fixtures, tmp_path / "fsdp", "--fully-shard", "--save-steps", "0", model=str(hf)))
    ok(sft(fixtures, tmp_path / "tp", "--save-steps", "0", model=str(hf), mesh="tp=2"))
    torch.testing.assert_close(losses(tmp_path / "fsdp"), losses(tmp_path / "tp"), rtol=1e-5, atol=0)
    assert losses(tmp_path / "fsdp")[0] < losses(reference)[0]


def test_recompute_gives_the_reference_losses_bit_for_bit(fixtures, reference, tmp_path):
    """--recompute selective (hs.recompute on every decoder layer, docs/recompute.md) on the reference's
    mesh: the same ops on the same values in the same order, so the same losses bit for bit."""
    out = tmp_path / "recompute"
    ok(sft(fixtures, out, "--recompute", "selective"))
    assert losses(out) == losses(reference)


def test_pipeline_with_fully_shard_matches_the_reference(fixtures, reference, tmp_path):
    """--mesh pp=2,dp=2 --fully-shard (hs.pipeline(..., fully_shard=True): each stage's decoder layers
    and root fully sharded over dp, gathered per microbatch, the gradients reduce-scattered once per
    step), two microbatches of one sequence per dp rank under 1F1B: the dp=2 x tp=2 reference's losses
    up to summation order (rtol 1e-5 as in every level1 comparison)."""
    ok(sft(fixtures, tmp_path, "--fully-shard", "--microbatches", "2", "--save-steps", "0", mesh="pp=2,dp=2"))
    assert json.loads((tmp_path / "losses.json").read_text())["mesh"] == "pp=2,dp=2"
    torch.testing.assert_close(losses(tmp_path), losses(reference), rtol=1e-5, atol=0)


@pytest.mark.full  # its feature's representative in make test: tests/python/level1/test_pipelining*.py
def test_pipeline_with_context_parallel_matches_the_reference(fixtures, reference, tmp_path):
    """--mesh pp=2,cp=2 in strict mode (hs.pipeline with a cp axis: each stage's sequence split over cp
    in head-tail order, every batch padded on the right to a multiple of 2 x cp, labels -100 on the
    pads, each rank's sequence shard crossing the stage
    boundary), two microbatches under 1F1B: the dp=2 x tp=2 reference's losses up to summation order
    (rtol 1e-5 as in every level1 comparison), the same token counts (padding not counted)."""
    ok(sft(fixtures, tmp_path, "--strict", "--microbatches", "2", "--save-steps", "0", mesh="pp=2,cp=2"))
    summary = json.loads((tmp_path / "losses.json").read_text())
    expected = json.loads((reference / "losses.json").read_text())
    assert summary["mesh"] == "pp=2,cp=2"
    counts = [(r["tokens"], r["trained_tokens"]) for r in summary["steps"]]
    assert counts == [(r["tokens"], r["trained_tokens"]) for r in expected["steps"]]
    torch.testing.assert_close(losses(tmp_path), losses(reference), rtol=1e-5, atol=0)


@pytest.mark.full  # its feature's representative in make test: tests/python/level1/test_pipelining*.py
def test_pipeline_with_recompute_and_bf16_matches_the_reference(fixtures, reference, tmp_path):
    """--mesh pp=2,dp=2 --fully-shard --recompute full --mixed-precision bf16: each stage fully
    sharded, its layers recomputed, computing in bf16 from fp32 masters (hs.pipeline's recompute and
    mixed_precision). Its losses are within bf16 rounding of the fp32 reference's (test_mixed_precision.py's
    LOSS_ATOL, argued there; recomputation changes no value, test_pipelining_recompute_precision.py
    checks it bit for bit) and NOT within the fp32 comparisons' rtol 1e-5, so bf16 ran: measured
    1.8e-5 relative at step 4 (1.1e-4 absolute); the same run with the flags ignored (fp32, what a pp
    run did before) is 4e-8 off."""
    from test_mixed_precision import LOSS_ATOL

    ok(sft(fixtures, tmp_path, "--fully-shard", "--recompute", "full", "--mixed-precision", "bf16",
           "--microbatches", "2", "--save-steps", "0", mesh="pp=2,dp=2"))
    got, want = (torch.tensor(losses(p), dtype=torch.float64) for p in (tmp_path, reference))
    assert not torch.allclose(got, want, rtol=1e-5, atol=0), (got, want)
    assert float((got - want).abs().max()) <= LOSS_ATOL, (got, want)


def test_pipeline_checkpoint_resumes_without_pp(fixtures, reference, tmp_path):
    """--mesh pp=2,dp=2 stopped after step 2 (a checkpoint of the pipeline's stages under the full
    model's names, hypershard.checkpoint on hs.pipeline), then --resume on the reference's dp=2 x tp=2:
    steps 1-2 are the pipeline's, 3-4 the resumed run's; all four equal the uninterrupted reference up
    to summation order (rtol 1e-5 as in every level1 comparison). A resume that missed a stage's
    parameters or optimizer state would be off by far more (tests/python/level1/
    test_pipelining_checkpoint.py's planted fault: 2.7e-3 at step 3)."""
    out = tmp_path / "run"
    first = ok(sft(fixtures, out, "--microbatches", "2", "--stop-after", "2", mesh="pp=2,dp=2"))
    assert "stopped after step 2 of 4" in first.stdout, first.stdout[-2000:]
    ok(sft(fixtures, out, "--resume"))
    summary = json.loads((out / "losses.json").read_text())
    assert summary["resumed_from"].endswith("step_00000002"), summary
    torch.testing.assert_close(losses(out), losses(reference), rtol=1e-5, atol=0)


# make test-full (make test's 40-minute budget; hs.from_pretrained with pp is in make test through
# test_pipelining_checkpoint.py)
@pytest.mark.full
def test_model_directory_on_a_pipeline_is_read_by_stage(fixtures, reference, tmp_path):
    """--model DIR on --mesh pp=2,dp=2: hs.from_pretrained with a pp axis, each rank reading only its
    stage's shards; the run equals the plain tp=2 run from the same folder (rtol 1e-5: summation order)."""
    hf = reference / "hf"
    ok(sft(fixtures, tmp_path / "pp", "--microbatches", "2", "--save-steps", "0", model=str(hf), mesh="pp=2,dp=2"))
    ok(sft(fixtures, tmp_path / "tp", "--save-steps", "0", model=str(hf), mesh="tp=2"))
    torch.testing.assert_close(losses(tmp_path / "pp"), losses(tmp_path / "tp"), rtol=1e-5, atol=0)
