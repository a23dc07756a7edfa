"""Level0: the prepared GPU check (hypershard/testing/gpu_check.py) in its --dry-run form: the
same script on CPU with gloo, reduced (2 cases per level0 family on 1-rank meshes, 6 cases of
the 2-rank slice, two bench op classes, the attention rows on the math backend, the tiny Qwen3
in its three precisions, two compile cases), so that the script a GPU session runs cannot rot. Run as a file (the way `make test-gpu`
runs it, before hypershard could be imported). About 40 s.

It checks the report, not only the exit status: every phase ran; level0 reached at least 25
families and passed at least 80% of its cases (the rest fail on a CPU 1-rank mesh as well: cases
that assume more ranks, reported as such); the 2-rank slice passed; the bench timed plain,
hypershard and torch DTensor in microseconds; the attention rows matched plain torch exactly
(same kernel, same generator state, one rank); the tiny Qwen3 trained strict on a 1-rank mesh
in float32, bfloat16 autocast and float16 autocast + GradScaler with the losses of the plain run
within each bound; the two compile cases passed.
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check"
    run = subprocess.run([sys.executable, os.path.join(REPO, "hypershard", "testing", "gpu_check.py"), "--dry-run",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    phases = report["phases"]
    assert report["dry_run"] and list(phases) == [
        "env", "build", "attention", "level0", "multirank", "bench", "model", "compile"
    ]
    assert all(phase["status"] == "passed" for phase in phases.values()), {k: v["status"] for k, v in phases.items()}

    level0 = phases["level0"]["families"]
    run_count = sum(f["run"] for f in level0.values())
    passed = sum(f["passed"] for f in level0.values())
    assert len(level0) >= 25 and passed >= 0.8 * run_count, phases["level0"]["summary"]
    assert all(f["also_on_cpu"] for f in phases["level0"]["failures"]), phases["level0"]["failures"]

    multirank = phases["multirank"]["families"]
    assert sum(f["passed"] for f in multirank.values()) == sum(f["run"] for f in multirank.values()) >= 4

    rows = phases["bench"]["rows"]
    assert [row["op"] for row in rows] == ["pointwise", "matmul"]
    for row in rows:
        for key in ("plain_us", "hypershard_replicate_us", "hypershard_shard_us", "torch_dtensor_us"):
            assert isinstance(row[key], float) and 0 < row[key] < 10_000, (row["op"], key, row[key])
    assert "µs per op" in (out / "report.md").read_text()

    attention = phases["attention"]["rows"]  # each row in its own process, math backend on CPU
    assert len(attention) == 6 and all(row["status"] == "passed" and row["max_abs"] == 0.0 for row in attention)
    model = phases["model"]["runs"]
    assert [run["precision"] for run in model] == ["float32", "bfloat16 autocast", "float16 autocast + GradScaler"]
    assert all(run["status"] == "passed" and run["loss_rdiff"] <= run["rtol"] for run in model), model
    assert all(any("scaled_dot_product" in name for name in run["attention_ops"]) for run in model), model

    compile_cases = phases["compile"]["families"]["test_compile_traced"]
    assert compile_cases["passed"] == compile_cases["run"] == 2, compile_cases
