"""Level1: the command-line tools stay true to the code: the coverage tool reports zero missing
ops (none served by the fallback) for Qwen3 on dp=2 x tp=2 and for DeepSeek-V3.2 on dp=2 and exits 0, and
lists an op whose rule is switched off as FALLBACK (exit 1); the demo trains, matches one device and writes its
outputs."""

import json
import re
import subprocess
import sys


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)


def test_coverage_qwen3_has_no_missing_op():
    result = run("hypershard.coverage", "--model", "qwen3", "--mesh", "dp=2,tp=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ", 0 served by the fallback" in result.stdout, result.stdout[-2000:]
    assert "FALLBACK" not in result.stdout


def test_coverage_qwen3_tp_wider_than_kv_heads():
    """2 KV heads on tp=4 (real configs have fewer KV heads than a tp group): parallelize keeps the KV
    projections whole, the attention rule reads each rank's KV heads; no refusal, no fallback, the
    losses match one device."""
    result = run("hypershard.coverage", "--model", "qwen3", "--mesh", "tp=4", "--steps", "2",
                 "--config", "num_key_value_heads=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ", 0 served by the fallback" in result.stdout and "; 0 calls whose rule refused" in result.stdout, \
        result.stdout[-2000:]


def test_demo_matches_one_device(tmp_path):
    result = run("hypershard.demo", "--steps", "3", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "MATCHES one device" in result.stdout
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses["hypershard"]) == 3 and (tmp_path / "loss_curve.png").stat().st_size > 0


def test_coverage_deepseek_has_no_missing_op():
    """DeepSeek-V3.2 (its tiny config in hypershard.testing.models.TINY_CONFIGS: MLA, the sparse-attention indexer, MoE
    experts through aten::_grouped_mm) on dp=2: every op has a rule, none refused its layouts, and the loss
    matches one device."""
    result = run("hypershard.coverage", "--model", "deepseek_v32", "--mesh", "dp=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ", 0 served by the fallback" in result.stdout and "FALLBACK" not in result.stdout, result.stdout[-2000:]
    assert "; 0 calls whose rule refused" in result.stdout, result.stdout[-2000:]


def test_coverage_lists_fallback_ops_and_the_model_still_matches_one_device():
    """With the rule of DeepSeek's grouped expert product switched off, default mode runs it through the
    fallback: the tool lists it, exits 1, and training still matches one device."""
    result = run("hypershard.coverage", "--model", "deepseek_v32", "--mesh", "dp=2",
                 "--without-rule", "aten::_grouped_mm")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FALLBACK" in result.stdout and "the distributed run failed" not in result.stdout, result.stdout[-3000:]
    assert re.search(r"aten::_grouped_mm\s+\d+\s+FALLBACK", result.stdout), result.stdout[-3000:]
    served = re.search(r"(\d+) served by the fallback", result.stdout)
    assert served and int(served.group(1)) > 0, result.stdout[-2000:]
    worst = re.search(r"max relative difference ([0-9.e+-]+)", result.stdout)
    assert worst and float(worst.group(1)) <= 1e-5, result.stdout[-2000:]


def test_coverage_docs_are_current(tmp_path):
    """docs/coverage (make coverage-docs): every target model on tp=4, dp=2 x tp=2 and (MoE) dp=2 x ep=2 reaches
    no op without a rule, needs no implicit redistribution and matches one device; regenerated here, the
    reports must equal the checked-in ones (an op gaining or losing a rule, or a new call count, shows)."""
    from pathlib import Path

    result = run("hypershard.coverage", "--all", "--write", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    docs = Path(__file__).resolve().parents[3] / "docs" / "coverage"
    expected = sorted(p.name for p in docs.glob("*.md"))
    assert sorted(p.name for p in tmp_path.glob("*.md")) == expected
    stale = [name for name in expected if (tmp_path / name).read_text() != (docs / name).read_text()]
    assert not stale, f"docs/coverage is out of date ({stale}); run make coverage-docs"
