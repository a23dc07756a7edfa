"""UT: every command-line tool refuses a mesh axis name it gives no meaning to, in one line, before any
rank starts (issue: `--mesh zz=2,dp=2` silently trained two replicas).

Each tool's rank launcher is replaced by one that fails the test, so that a tool which accepted the
axis (the planted fault: the check removed) fails here at once instead of training."""

from __future__ import annotations

import json

import pytest

import hypershard.planner.cli
import hypershard.planner.validate
import hypershard.sft.cli
import hypershard.tools.coverage
import hypershard.tools.demo
from hypershard.integrations.llamafactory.args import HyperParallelArguments, HyperParallelConfigError
from hypershard.tensor.axes import MESH_AXES, MeshAxisError, check_axis_names


@pytest.fixture(autouse=True)
def no_ranks(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a rank was started for a mesh with an unknown axis")

    for module in (hypershard.sft.cli, hypershard.tools.demo, hypershard.tools.coverage, hypershard.launch):
        monkeypatch.setattr(module, "spawn_local_ranks", started)
    monkeypatch.setattr(hypershard.planner.validate, "validate", started)
    monkeypatch.setattr(hypershard.planner.cli, "plan_step", started)


def _refused(capsys, main, argv, tool, axis, allowed):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, f"more than one line: {err!r}"
    assert err.startswith(f"hypershard: {tool}: mesh axis {axis!r} is not one of {', '.join(allowed)}; allowed: ")


def _sft_argv(tmp_path, mesh):
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"instruction": "a", "output": "b"}]))
    return ["--model", "qwen3", "--data", str(data), "--output", str(tmp_path / "out"), "--mesh", mesh]


@pytest.mark.parametrize("axis", ["zz", "xp", "DP"])
def test_sft_refuses(tmp_path, capsys, axis):
    _refused(capsys, hypershard.sft.cli.main, _sft_argv(tmp_path, f"{axis}=2,dp=2"), "sft", axis, list(MESH_AXES))


def test_demo_refuses(capsys):
    _refused(capsys, hypershard.tools.demo.main, ["--mesh", "dp=2,zz=2"], "demo", "zz", hypershard.tools.demo.DEMO_AXES)
    # the demo's model has no experts: ep means nothing to it
    _refused(capsys, hypershard.tools.demo.main, ["--mesh", "dp=2,ep=2"], "demo", "ep", hypershard.tools.demo.DEMO_AXES)


def test_coverage_refuses(capsys):
    allowed = hypershard.tools.coverage.COVERAGE_AXES
    _refused(capsys, hypershard.tools.coverage.main, ["--mesh", "zz=2,dp=2"], "coverage", "zz", allowed)
    # a coverage run holds one whole model per rank: pp (stages) means nothing to it
    _refused(capsys, hypershard.tools.coverage.main, ["--mesh", "pp=2,dp=2"], "coverage", "pp", allowed)


def test_plan_refuses(capsys):
    allowed = hypershard.planner.PLANNED_AXES
    _refused(capsys, hypershard.planner.cli.main, ["--model", "qwen3", "--mesh", "dp=2,zz=2"], "plan", "zz", allowed)


def test_plan_validate_refuses(capsys):
    allowed = hypershard.planner.PLANNED_AXES
    _refused(capsys, hypershard.planner.validate.main, ["--mesh", "zz=2,dp=2"], "plan.validate", "zz", allowed)


def test_malformed_and_repeated(capsys):
    for text, expected in (("dp=0", "sizes >= 1"), ("dp=2,=2", "NAME=SIZE"), ("dp", "NAME=SIZE")):
        with pytest.raises(SystemExit):
            hypershard.tools.demo.main(["--mesh", text])
        assert expected in capsys.readouterr().err
    with pytest.raises(MeshAxisError, match="'dp' is given twice"):
        check_axis_names("sft", ["dp", "dp"])


def test_known_axes_pass():
    check_axis_names("sft", ["dp", "tp", "ep", "cp"])
    check_axis_names("demo", ["cp", "dp"], hypershard.tools.demo.DEMO_AXES)


def test_llamafactory_json_refuses_unknown_axis_key():
    """The JSON names axes by keys (tp_size, ep_size, ...): an unknown key is refused, listing them."""
    with pytest.raises(HyperParallelConfigError, match=r"unknown key\(s\) \['zz_size'\].*'tp_size'"):
        HyperParallelArguments.from_dict({"zz_size": 2})
    # pp is a mesh axis HF's Trainer loop cannot run: refused with its own reason (docs/llamafactory.md)
    with pytest.raises(
        HyperParallelConfigError, match=r"pp_size: pipeline parallelism does not run under HF's Trainer"
    ):
        HyperParallelArguments.from_dict({"pp_size": 2})
