"""Level1 fault injection (docs/faults.md): what a long run meets, on 2 CPU ranks, each with a timeout.

- The disk fills on ONE rank during a save (its DCP data write, then its RNG file, raise ENOSPC;
  the other rank's writes succeed): every rank raises the same error naming rank 1, at once; no
  COMPLETE marker and no step folder is left; the previous checkpoint stays the newest; the run
  then saves again normally.
- A rank killed mid-write of a save: the survivor fails naming the dead rank; only the hidden
  ``.step_N.partial`` folder is left; ``latest`` and ``load`` on the folder take the previous
  complete checkpoint, and loading the partial one by name is refused with the reason.
- hypershard.sft with a rank killed mid-write of step 4's save, then ``--auto-resume``: the partial
  checkpoint is skipped (and said so), the run continues from step 2 and its losses equal the
  uninterrupted run's bit for bit (same mesh, same program: level1 README).
- torchrun --max-restarts=1 with a rank SIGKILLed mid-step 3: the other rank exits naming the dead
  rank, torchrun restarts the job, which resumes from the newest complete checkpoint by itself
  (--auto-resume); losses equal the uninterrupted run's bit for bit.
- A rank that stops issuing collectives: the other reports, within the process group's timeout,
  which collective (kind, mesh axis, bytes) and ATen op it was waiting in, the model file and line,
  and that no rank is dead.
- LlamaFactory: a failed save of checkpoint-4 (disk full on rank 1) leaves checkpoint-4 without its
  COMPLETE marker; the same command again resumes from checkpoint-2 (LlamaFactory's automatic
  resume, which picks the highest number, goes through hypershard's newest-complete choice), logs
  the skipped folder, and an explicit resume_from_checkpoint of the partial one is refused.
"""

import errno
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from hypershard.launch import spawn_local_ranks
from hypershard.testing.sft_fixtures import write_fixtures

TIMEOUT = 240  # seconds per launch (a 2-rank tiny launch takes ~10-20 s on 2 cores)
STEPS = 4
MESH = ((2,), ("dp",))
UNEVEN = dict(vocab_size=126, intermediate_size=62)


# ------------------------------------------------------------------------- in-process saves


def _model():
    import hypershard as hs
    from hypershard.parallel import parallelize
    from hypershard.testing.models import tiny_config, tiny_model

    return parallelize(tiny_model(tiny_config("qwen3", **UNEVEN), seed=0), hs.init_device_mesh("cpu", *MESH))


def _train(model, steps=1):
    from hypershard.testing.models import make_batches

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for ids, labels in make_batches(UNEVEN["vocab_size"], steps, batch=4, seq=8):
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    return optimizer


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _full_disk_saves(rank, world, root):
    """Step 1 saved; step 2 with rank 1's DCP data write failing; step 3 with rank 1's RNG file
    failing; step 4 with nothing failing. Returns what each save did on this rank."""
    import torch.distributed.checkpoint.filesystem as fs

    from hypershard import checkpoint

    model = _model()
    optimizer = _train(model)
    checkpoint.save(root, model, optimizer, step=1)
    out = {}
    real_write, real_save = fs._write_item, torch.save

    def rng_disk_full(obj, f, *args, **kwargs):
        if "rng_rank" in str(f):
            _disk_full()
        return real_save(obj, f, *args, **kwargs)

    for step, fault in ((2, "data"), (3, "rng"), (4, None)):
        if rank == 1 and fault == "data":
            fs._write_item = _disk_full
        if rank == 1 and fault == "rng":
            torch.save = rng_disk_full
        tic = time.monotonic()
        try:
            checkpoint.save(root, model, optimizer, step=step)
            out[str(step)] = {"error": None}  # (JSON keys: the launcher returns JSON)
        except RuntimeError as error:
            out[str(step)] = {"error": str(error).splitlines()[0], "seconds": time.monotonic() - tic}
        fs._write_item, torch.save = real_write, real_save
    return out


def test_disk_full_on_one_rank_during_save(tmp_path):
    from hypershard import checkpoint

    results = spawn_local_ranks(_full_disk_saves, 2, str(tmp_path), timeout=TIMEOUT, pg_timeout=120)
    for step in (2, 3):
        first, second = results[0][str(step)]["error"], results[1][str(step)]["error"]
        assert first is not None and first == second, (step, results)  # the same error on every rank
        assert f"saving step {step}" in first and "failed on rank 1 of 2" in first, first
        assert "No space left on device" in first and "no COMPLETE marker was written" in first, first
        # at once (measured < 1 s), not after the collective timeout (120 s); loaded 2-core CI: 60 s
        assert max(r[str(step)]["seconds"] for r in results) < 60, results
        assert not checkpoint.step_dir(tmp_path, step).exists(), f"step {step}: a failed save left its folder"
    print(f"disk full: {results[0]['2']['error']} -- after {max(r['2']['seconds'] for r in results):.2f} s")
    assert results[0]["4"] == results[1]["4"] == {"error": None}  # the run saves again once the disk has room
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_00000001", "step_00000004"]
    markers = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("COMPLETE"))
    assert markers == ["step_00000001/COMPLETE", "step_00000004/COMPLETE"], markers


def _killed_mid_write(rank, world, root):
    import torch.distributed.checkpoint.filesystem as fs

    from hypershard import checkpoint

    model = _model()
    optimizer = _train(model)
    checkpoint.save(root, model, optimizer, step=1)
    if rank == 1:
        real_write = fs._write_item

        def write_then_die(*args, **kwargs):
            result = real_write(*args, **kwargs)
            os._exit(9)  # killed with part of its shards written
            return result

        fs._write_item = write_then_die
    tic = time.monotonic()
    try:
        checkpoint.save(root, model, optimizer, step=2)
    except Exception as error:  # noqa: BLE001 -- the survivor's report is the result
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - tic}
    return {"error": None}


def test_save_killed_mid_write(tmp_path):
    from hypershard import checkpoint

    with pytest.raises(Exception, match="exit") as info:  # the launcher reports the dead rank
        spawn_local_ranks(_killed_mid_write, 2, str(tmp_path), timeout=TIMEOUT, pg_timeout=60)
    assert "process 1 terminated with exit code 9" in str(info.value), str(info.value)
    partial = checkpoint.partial_dir(checkpoint.step_dir(tmp_path, 2))
    assert partial.is_dir() and any(partial.iterdir()), "the killed save never started writing"
    assert not checkpoint.step_dir(tmp_path, 2).exists() and not (partial / "COMPLETE").exists()
    newest, skipped = checkpoint.resume_point(tmp_path)
    assert newest == checkpoint.step_dir(tmp_path, 1)
    assert skipped == [(partial, "a save that did not finish (its temporary folder; no COMPLETE marker)")]
    with pytest.raises(RuntimeError, match="is not a complete checkpoint: a save that did not finish") as info:
        checkpoint.load(partial, torch.nn.Linear(2, 2))  # named explicitly: refused, before any collective
    assert "step_00000001" in str(info.value)


# ------------------------------------------------------------------------- hung collective


def _hung(rank, world, hang_seconds):
    from hypershard.launch import faults

    faults.register()
    model = _model()
    from hypershard.testing.models import make_batches

    ((ids, labels),) = make_batches(UNEVEN["vocab_size"], 1, batch=4, seq=8)
    import torch.distributed as dist

    dist.barrier()  # both ranks start the step together (model building takes unequal time under load)
    if rank == 1:  # caught an exception of its own and stopped issuing collectives
        time.sleep(hang_seconds)
        return {"error": None}
    tic = time.monotonic()
    try:
        with faults.reporting("in the test's step 1"):
            model(input_ids=ids, labels=labels).loss.backward()
    except Exception as error:  # noqa: BLE001
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - tic}
    return {"error": "no error: the collective did not wait for rank 1"}


def test_hung_collective_is_named():
    # rank 1 comes back at 1.5 x the timeout: after rank 0's collective timed out, and before rank
    # 0's wait in the launcher's final barrier (another timeout) ends -- a margin of 4 s either way
    pg_timeout = 8
    results = spawn_local_ranks(_hung, 2, pg_timeout * 1.5, timeout=TIMEOUT, pg_timeout=pg_timeout)
    report = results[0]["error"]
    print(f"hung collective: {report} -- after {results[0]['seconds']:.1f} s (timeout {pg_timeout} s)")
    assert report.startswith("CollectiveError: hypershard: rank 0 of 2: a collective timed out in the test's step 1,")
    # the collective that waited and the ATen op that issued it, as the C++ runtime recorded them
    # (dp: the loss's mean over the global batch is an all-reduce), then the op's line
    waiting = re.search(
        r"timed out in the test's step 1, waiting in (\w+) over (\w+) \((\d+) bytes\) of (\S+), ", report
    )
    assert waiting, report
    assert waiting.groups()[:2] == ("all_reduce", "dp") and int(waiting.group(3)) > 0, report
    assert re.fullmatch(r"aten::\w+\.\w+", waiting.group(4)), report
    assert "in torch functional.cross_entropy, called from loss_utils.py:" in report, report
    assert "no rank on this host is dead: a peer stopped issuing collectives" in report, report
    assert pg_timeout - 1 <= results[0]["seconds"] <= pg_timeout + 10, results  # the timeout, + a loaded CPU


def test_collective_timeout_setting(monkeypatch):
    from hypershard.launch import faults

    monkeypatch.delenv(faults.TIMEOUT_ENV, raising=False)
    assert faults.collective_timeout(3600) == 3600
    monkeypatch.setenv(faults.TIMEOUT_ENV, "90")
    assert faults.collective_timeout(3600) == 90
    monkeypatch.setenv(faults.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="HYPERSHARD_COLLECTIVE_TIMEOUT='soon'; allowed: a number of seconds"):
        faults.collective_timeout(3600)


# ------------------------------------------------------------------------- hypershard.sft


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return write_fixtures(tmp_path_factory.mktemp("faults_data"))


def sft(fixtures, output, *extra, env=None, torchrun=None):
    """The CLI on dp=2 (4 steps of global batch 4, a checkpoint every 2); torchrun: its extra args."""
    args = [
        "--model",
        "qwen3",
        "--mesh",
        "dp=2",
        "--tokenizer",
        str(fixtures["tokenizer"]),
        "--data",
        str(fixtures["alpaca"]),
        "--output",
        str(output),
        "--batch-size",
        "4",
        "--max-steps",
        str(STEPS),
        "--lr",
        "1e-3",
        "--warmup-steps",
        "1",
        "--seed",
        "3",
        "--save-steps",
        "2",
        "--timeout",
        str(TIMEOUT),
        *extra,
    ]
    head = [sys.executable]
    if torchrun is not None:
        head += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *torchrun]
    try:
        return subprocess.run(
            [*head, "-m", "hypershard.sft", *args],
            capture_output=True,
            text=True,
            timeout=TIMEOUT + 60,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"sft {extra} did not end within {TIMEOUT + 60} s: {(error.stderr or b'')[-3000:]}")


def ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def losses(output):
    return [r["loss"] for r in json.loads((output / "losses.json").read_text())["steps"]]


@pytest.fixture(scope="module")
def reference(fixtures, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    ok(sft(fixtures, out))
    return out


def test_sft_auto_resume_past_a_partial_checkpoint(fixtures, reference, tmp_path):
    from hypershard import checkpoint

    killed = sft(fixtures, tmp_path, env={"HYPERSHARD_SFT_CRASH_AT_STEP": "4", "HYPERSHARD_SFT_CRASH_IN": "save"})
    assert killed.returncode == 1 and "rank 1 of 2 died" in killed.stderr, killed.stderr[-3000:]
    ckpts = tmp_path / "checkpoints"
    partial = checkpoint.partial_dir(checkpoint.step_dir(ckpts, 4))
    assert partial.is_dir() and [p.name for p in checkpoint.complete_checkpoints(ckpts)] == ["step_00000002"]
    result = ok(sft(fixtures, tmp_path, "--auto-resume"))
    assert (
        f"hypershard: checkpoint: resuming from {ckpts / 'step_00000002'}; skipped {partial}: a save that "
        "did not finish"
    ) in result.stderr, result.stderr[-3000:]
    assert json.loads((tmp_path / "losses.json").read_text())["resumed_from"].endswith("step_00000002")
    assert losses(tmp_path) == losses(reference)  # bit for bit: same mesh, same program
    # the resumed run's own save of step 4 replaced the stale temporary folder, complete this time
    assert checkpoint.latest(ckpts) == checkpoint.step_dir(ckpts, 4) and not partial.exists()


def test_sft_sigkill_mid_step_torchrun_restarts(fixtures, reference, tmp_path):
    tic = time.monotonic()
    result = ok(
        sft(
            fixtures,
            tmp_path,
            "--auto-resume",
            torchrun=["--max-restarts", "1"],
            env={"HYPERSHARD_SFT_CRASH_AT_STEP": "3", "HYPERSHARD_SFT_CRASH_SIGNAL": "kill"},
        )
    )
    seconds = time.monotonic() - tic
    err = result.stderr
    # the survivor names the dead rank; torchrun restarts the job
    assert "hypershard: rank 0 of 2: a collective failed in step 3 of 4," in err, err[-4000:]
    assert "rank 1 is dead (its process is gone)" in err, err[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in err, err[-4000:]  # torchrun saw the SIGKILL, restarted
    assert err.count("hypershard: rank 0 of 2: a collective failed") == 1, err[-4000:]  # the restart ran clean
    summary = json.loads((tmp_path / "losses.json").read_text())
    print(
        "sigkill:",
        [ln for ln in err.splitlines() if "CollectiveError:" in ln or "exitcode: -9" in ln or "SIGTERM" in ln],
        f"whole job incl. restart {seconds:.0f} s",
    )
    assert summary["resumed_from"].endswith("step_00000002"), summary
    assert losses(tmp_path) == losses(reference), (seconds, err[-3000:])  # bit for bit


# ------------------------------------------------------------------------- LlamaFactory


def _printed_losses(stdout: str) -> dict:
    """{step: loss} of HF's printed log dicts (rank 0's, tagged [default0]: by torchrun --tee)."""
    import ast

    found = []
    for line in stdout.splitlines():
        text = line.split("]:", 1)[1] if line.startswith("[default0]") else line
        text = text.strip()
        if text.startswith("{") and "'loss'" in text:
            found.append(ast.literal_eval(text)["loss"])  # as HF prints it: 4 significant digits
    return {step: loss for step, loss in enumerate(found, 1)}


def _explicit_partial_is_refused(out):
    """resume_from_checkpoint naming the partial checkpoint-4 (what HyperParallelTrainer.train checks
    first): refused with the reason, before anything runs; True takes checkpoint-2."""
    from hypershard.integrations.llamafactory import HyperParallelConfigError, resume

    with pytest.raises(HyperParallelConfigError) as info:
        resume.resolve(str(out / "checkpoint-4"), str(out))
    expected = (
        f"hypershard: llamafactory: resume_from_checkpoint '{out / 'checkpoint-4'}' is a partial checkpoint (no "
        f"COMPLETE marker: its save did not finish on every rank; it lacks complete model/optimizer shards "
        f"(hypershard/step_N/COMPLETE) and trainer_state.json); allowed: a complete checkpoint (the newest next "
        f"to it: {out / 'checkpoint-2'})"
    )
    assert str(info.value).startswith(expected), str(info.value)
    assert resume.resolve(True, str(out)) == str(out / "checkpoint-2")


# make test-full only (make test's 40-minute budget): the same atomic save and automatic resume are
# in make test through hypershard.sft (test_sft_auto_resume_past_a_partial_checkpoint) and the UT of
# the LlamaFactory resume choice (test_checkpoint_protocol.py).
@pytest.mark.full
def test_llamafactory_disk_full_then_automatic_resume(tmp_path):
    import llamafactory  # noqa: F401  (make setup installs it: a missing install fails, never skips)

    from hypershard.integrations.llamafactory import resume
    from hypershard.testing.llamafactory_fixtures import launch, read_losses, write_dataset_dir, write_model, write_run

    model, data, out = write_model(tmp_path / "qwen3", "qwen3"), write_dataset_dir(tmp_path / "data"), tmp_path / "out"
    yaml_path = write_run(tmp_path / "run", model, data, out, hp={}, save_strategy="steps", save_steps=2)
    full = launch(yaml_path, 2, env={"HYPERSHARD_LLAMAFACTORY_FAIL_SAVE_AT_STEP": "4"}, timeout=TIMEOUT)
    assert full.returncode != 0, "the save of checkpoint-4 failed on rank 1: the run must stop"
    text = f"hypershard.checkpoint.SaveError: hypershard: checkpoint: saving {out / 'checkpoint-4'}"
    for rank in (0, 1):  # the same error on every rank, naming the rank whose disk is full
        lines = [ln for ln in full.stderr.splitlines() if ln.startswith(f"[default{rank}]") and text in ln]
        assert lines, (rank, full.stderr[-4000:])
    expected = "(no COMPLETE marker was written) failed on rank 1 of 2: OSError: [Errno 28] No space left on device"
    assert expected in full.stderr, full.stderr[-4000:]
    assert resume.incomplete_reason(out / "checkpoint-2") is None
    assert resume.incomplete_reason(out / "checkpoint-4").startswith("no COMPLETE marker")
    _explicit_partial_is_refused(out)
    uninterrupted = _printed_losses(full.stdout)  # steps 1-4 were trained; only the last save failed
    assert sorted(uninterrupted) == [1, 2, 3, 4], full.stdout[-3000:]
    # the same command again: LlamaFactory's automatic resume takes checkpoint-2, not the partial checkpoint-4
    again = launch(yaml_path, 2, timeout=TIMEOUT)
    assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
    skipped = (
        f"hypershard: llamafactory: resuming from {out / 'checkpoint-2'}; skipped {out / 'checkpoint-4'}: no COMPLETE"
    )
    assert skipped in again.stdout + again.stderr, (again.stdout + again.stderr)[-4000:]
    resumed = read_losses(out)
    assert sorted(resumed) == [1, 2, 3, 4]
    # HF prints losses to 4 significant digits (the exact ones of the failed run's steps 3-4 were in
    # its lost trainer_state.json); bit for bit on resume is test_llamafactory's same-mesh case
    assert {k: f"{v:.4g}" for k, v in resumed.items()} == uninterrupted, (resumed, uninterrupted)
    assert (out / "checkpoint-4" / "COMPLETE").is_file()  # rewritten whole by the resumed run


# make test-full only (two LlamaFactory launches and a restart, ~3 min on 2 cores): make test has the
# same restart through hypershard.sft (test_sft_sigkill_mid_step_torchrun_restarts), whose
# per-attempt process group (hypershard.launch.init_torchrun_process_group) the launcher shares.
@pytest.mark.full
def test_llamafactory_dead_rank_torchrun_restarts(tmp_path):
    """LlamaFactory through hypershard's launcher with MAX_RESTARTS=1 (LlamaFactory's own variable):
    rank 1 dies as step 3 begins; rank 0 names it; torchrun restarts the job, which resumes from
    checkpoint-2 by itself and trains losses equal to an uninterrupted run's, bit for bit. Planted
    fault: without the per-attempt process group (accelerate's own) the restarted job's first group
    reads the dead attempt's addresses and fails (docs/faults.md)."""
    import llamafactory  # noqa: F401  (make setup installs it: a missing install fails, never skips)

    from hypershard.testing.llamafactory_fixtures import launch, read_losses, write_dataset_dir, write_model, write_run

    model, data = write_model(tmp_path / "qwen3", "qwen3"), write_dataset_dir(tmp_path / "data")
    runs = {name: (tmp_path / f"{name}_run", tmp_path / f"{name}_out") for name in ("reference", "restarted")}
    yamls = {
        name: write_run(run, model, data, out, hp={}, save_strategy="steps", save_steps=2)
        for name, (run, out) in runs.items()
    }
    reference = launch(yamls["reference"], 2, timeout=TIMEOUT)
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-5000:]
    env = {
        **os.environ,
        "NPROC_PER_NODE": "2",
        "MAX_RESTARTS": "1",
        "HYPERSHARD_LLAMAFACTORY_CRASH_AT_STEP": "3",  # rank 1 exits as step 3 begins, first attempt only
        "HYPERSHARD_LLAMAFACTORY_TIMEOUT": str(2 * TIMEOUT),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "hypershard.integrations.llamafactory", "train", str(yamls["restarted"])]
    tic = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=3 * TIMEOUT, env=env)
    seconds = time.monotonic() - tic
    err = result.stdout + result.stderr
    assert result.returncode == 0, err[-5000:]
    # torchrun saw rank 1 exit and restarted the job. Rank 0 either names the dead rank (when it was
    # waiting in a collective) or was stopped first by torchrun's agent (which polls every 0.1 s)
    # while it still computed: which one comes first is a race (hypershard.sft's test, killing mid-
    # collective, checks the naming).
    assert "failed (exitcode: 1) local_rank: 1" in err, err[-5000:]
    survivor = [ln for ln in err.splitlines() if "rank 1 is dead" in ln or "closing signal SIGTERM" in ln]
    assert survivor, err[-5000:]
    print("llamafactory restart:", survivor[:2], f"whole job incl. restart {seconds:.0f} s")
    restarted, uninterrupted = read_losses(runs["restarted"][1]), read_losses(runs["reference"][1])
    assert sorted(restarted) == [1, 2, 3, 4], restarted
    assert restarted == uninterrupted, (restarted, uninterrupted)  # bit for bit: same mesh, resumed at step 2
