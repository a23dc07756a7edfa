"""The launcher checks the JSON that a LlamaFactory YAML's hyper_parallel_args names before
LlamaFactory loads the model (hypershard/integrations/llamafactory/launcher.py,
check_hyper_parallel_args); each rank prints the one line and exits 2. No processes."""

from __future__ import annotations

import json

from hypershard.integrations.llamafactory.launcher import check_hyper_parallel_args


def _run(tmp_path, hp, heads=4, extra=""):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_attention_heads": heads}))
    (tmp_path / "hp.json").write_text(json.dumps(hp))
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text(
        f"model_name_or_path: {model}\nstage: sft\nuse_hyper_parallel: true\nhyper_parallel_args: {tmp_path / 'hp.json'}\n{extra}"
    )
    return yaml_path


def test_good_json_passes(tmp_path):
    assert check_hyper_parallel_args([str(_run(tmp_path, {"tp_size": 2}))], 4) == ""


def test_unknown_key_world_and_heads_refused_in_one_line(tmp_path):
    error = check_hyper_parallel_args([str(_run(tmp_path, {"tensor_parallel": 2}))], 4)
    assert (
        error.startswith("hypershard: llamafactory: hyper_parallel_args")
        and "unknown key(s) ['tensor_parallel']" in error
    )
    assert "\n" not in error
    assert "tp_size=3 does not divide the 4 ranks" in check_hyper_parallel_args(
        [str(_run(tmp_path, {"tp_size": 3}))], 4
    )
    assert "larger than the model's 4 attention heads" in check_hyper_parallel_args(
        [str(_run(tmp_path, {"tp_size": 8}))], 8
    )


def test_command_line_overrides_are_applied(tmp_path):
    yaml_path = _run(tmp_path, {"tp_size": 2})
    (tmp_path / "bad.json").write_text('{"tp_size": 3}')
    assert "tp_size=3" in check_hyper_parallel_args([str(yaml_path), f"hyper_parallel_args={tmp_path / 'bad.json'}"], 4)
    assert check_hyper_parallel_args([str(yaml_path), "use_hyper_parallel=false"], 3) == ""


def test_missing_file_and_bad_json(tmp_path):
    yaml_path = _run(tmp_path, {})
    (tmp_path / "hp.json").write_text("{not json")
    assert "not valid JSON" in check_hyper_parallel_args([str(yaml_path)], 4)
    (tmp_path / "hp.json").unlink()
    assert "is not a file" in check_hyper_parallel_args([str(yaml_path)], 4)


def test_the_launcher_refuses_before_starting_torchrun(tmp_path, monkeypatch, capsys):
    """NPROC_PER_NODE > 1: the parent checks the JSON against NPROC_PER_NODE x NNODES ranks and prints
    the one line once, with no torchrun started (so no failure summary of torchrun's follows it)."""
    from hypershard.integrations.llamafactory import launcher

    started = []
    monkeypatch.setattr(launcher, "_relaunch", lambda argv: started.append(argv) or 0)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    monkeypatch.setenv("NNODES", "2")
    yaml_path = _run(tmp_path, {"tp_size": 3})
    assert launcher.main(["train", str(yaml_path)]) == 2 and not started
    assert capsys.readouterr().err.count("tp_size=3 does not divide the 4 ranks") == 1
    assert launcher.main(["train", str(_run(tmp_path, {"tp_size": 2}))]) == 0 and len(started) == 1
