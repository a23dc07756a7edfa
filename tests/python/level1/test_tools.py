"""Level1: the command-line tools stay true to the code: the coverage tool reports zero missing
ops for Qwen3 on dp=2 x tp=2 and exits 0; the demo trains, matches one device and writes its
outputs."""

import json
import subprocess
import sys


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)


def test_coverage_qwen3_has_no_missing_op():
    result = run("hypershard.coverage", "--model", "qwen3", "--mesh", "dp=2,tp=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ", 0 missing" in result.stdout, result.stdout[-2000:]
    assert "MISSING" not in result.stdout


def test_demo_matches_one_device(tmp_path):
    result = run("hypershard.demo", "--steps", "3", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "MATCHES one device" in result.stdout
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses["hypershard"]) == 3 and (tmp_path / "loss_curve.png").stat().st_size > 0
