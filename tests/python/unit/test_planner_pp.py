"""The planner's pp axis (hypershard/planner/pipeline.py, docs/planner.md "Pipeline parallelism"),
without processes: the stage split, the schedules' in-flight microbatches against torch's own
warm-up counts, the bubble and P2P formulas, a tiny model's stages planned, and the bad inputs."""

import pytest

from hypershard.planner.cli import main
from hypershard.planner.pipeline import (
    bubble,
    check_pipeline,
    in_flight,
    p2p_bytes,
    plan_pipeline,
    stage_config,
    stage_layers,
)
from hypershard.planner.run import plan_step
from hypershard.planner.step import load_config
from hypershard.testing.models import TINY_CONFIGS


def _tiny(layers=4):
    return load_config("qwen3", **{**TINY_CONFIGS["qwen3"], "num_hidden_layers": layers})


def test_bubble_formula():
    # (pp - 1) / (v m + pp - 1): Narayanan et al. SC'21 section 2.2, as a fraction of the step.
    assert bubble("gpipe", 4, 8) == bubble("1f1b", 4, 8) == 3 / 11
    assert bubble("interleaved_1f1b", 4, 8, virtual=2) == 3 / 19
    assert bubble("1f1b", 1, 8) == 0
    assert bubble("1f1b", 8, 32) == pytest.approx(7 / 39)


def test_in_flight_follows_torch_schedules():
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    pp, m = 4, 8
    assert [in_flight("gpipe", pp, m, s) for s in range(pp)] == [8] * 4
    assert [in_flight("1f1b", pp, m, s) for s in range(pp)] == [4, 3, 2, 1]  # Schedule1F1B's warm-up
    for v in (2, 3):
        for s in range(pp):
            warm = _get_warmup_ops(s, v, m // max(1, m // pp), pp, m)
            assert in_flight("interleaved_1f1b", pp, m, s, v) == min(warm + 1, m * v) / v
        # The first rank: pp + (pp - 1) / v stage passes, 1F1B's pp times (1 + (pp - 1) / (pp v)).
        assert in_flight("interleaved_1f1b", pp, m, 0, v) == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))


def test_stage_layers_even_first_chunks_longer():
    assert stage_layers(61, 16)[0] == [0, 1, 2, 3] and stage_layers(61, 16)[15] == [58, 59, 60]
    assert [len(s) for s in stage_layers(61, 16)] == [4] * 13 + [3] * 3
    assert stage_layers(8, 2, virtual=2) == [[0, 1, 4, 5], [2, 3, 6, 7]]  # chunk c on rank c mod pp
    assert sorted(i for s in stage_layers(10, 3, 2) for i in s) == list(range(10))


def test_stage_config_keeps_layer_kinds():
    config = load_config("deepseek_v32")
    first = stage_config(config, [0, 1, 2, 3])
    assert first.num_hidden_layers == 4 and first.first_k_dense_replace == 3
    assert first.mlp_layer_types == ["dense", "dense", "dense", "sparse"]
    middle = stage_config(config, [4, 5])
    assert middle.first_k_dense_replace == 0 and middle.mlp_layer_types == ["sparse", "sparse"]
    assert config.num_hidden_layers == 61  # the model's config is not changed
    qwen = stage_config(load_config("qwen3_5_0_8b"), [2, 3, 4])
    assert qwen.layer_types == ["linear_attention", "full_attention", "linear_attention"]


def test_p2p_bytes_per_boundary():
    hidden, seq, micro, nbytes, m = 7168, 4096, 1, 2, 32
    one = hidden * seq * micro * nbytes
    pp = 4
    sent = [p2p_bytes(hidden, seq, micro, nbytes, m, r, pp) for r in range(pp)]
    assert sent == [m * one, 2 * m * one, 2 * m * one, m * one]
    assert sum(sent) == (pp - 1) * 2 * m * one  # per boundary: activation forward + gradient backward, m times
    # interleaved: every chunk boundary (pp v - 1 of them) crossed
    assert sum(p2p_bytes(hidden, seq, micro, nbytes, m, r, pp, 2) for r in range(pp)) == (2 * pp - 1) * 2 * m * one


def test_pp_halves_layer_parameter_bytes():
    config = _tiny(4)
    whole = plan_step(config, {"dp": 2}, batch=2, seq=16)
    root = {c: sum(whole.root_state[p][c] for p in ("embed", "head", "both")) for c in ("parameters", "optimizer")}
    layer_bytes = whole.parameters - root["parameters"]
    staged = plan_pipeline(config, {"pp": 2, "dp": 2}, microbatches=2, seq=16, rank=0)
    assert staged.parameters == layer_bytes // 2 + whole.root_state["embed"]["parameters"]
    last = plan_pipeline(config, {"pp": 2, "dp": 2}, microbatches=2, seq=16, rank=2)  # pp=1, dp=0
    assert last.pp["stage"] == 1
    assert last.parameters == layer_bytes // 2 + whole.root_state["head"]["parameters"]
    assert staged.parameters + last.parameters == whole.parameters
    # P2P: the boundary's hidden state forward and its gradient backward, per microbatch
    assert staged.axis_bytes["pp"] == 32 * 16 * 1 * 4 * 2  # hidden x seq x micro-batch x fp32 x m (one direction)
    # dp's reductions once per step, its other collectives per microbatch
    assert staged.collectives["dp all_reduce"] == whole.collectives["dp all_reduce"]
    assert staged.pp["in_flight"] == 2 and last.pp["in_flight"] == 1
    assert staged.peak > 0 and 0 < staged.pp["bubble"] < 1


def test_bad_input_is_one_clear_line():
    with pytest.raises(ValueError, match=r"^hypershard: plan: pp=8 is more stages than the model's 4 layers; allowed"):
        check_pipeline(4, 8, 8, 8, "1f1b")
    with pytest.raises(
        ValueError,
        match=r"--microbatches 3 does not divide the batch of 4 sequences per dp rank; allowed: a divisor of 4: \[1, 2, 4\]",
    ):
        check_pipeline(8, 2, 3, 4, "gpipe")
    with pytest.raises(ValueError, match=r"1f1b needs at least pp=4 microbatches, got 2; allowed: >= 4"):
        check_pipeline(8, 4, 2, 2, "1f1b")
    with pytest.raises(ValueError, match=r"pp=4 x 2 virtual stages is more stages than the model's 6 layers"):
        check_pipeline(6, 4, 4, 4, "interleaved_1f1b", 2)


def test_cli_refuses_before_planning(capsys):
    with pytest.raises(SystemExit, match=r"^hypershard: plan: pp=4 is more stages than the model's 2 layers"):
        main(["--model", "qwen3_5_0_8b", "--layers", "2", "--mesh", "pp=4,dp=2", "--seq", "64"])
    with pytest.raises(SystemExit, match=r"--microbatches 3 does not divide the batch of 4 sequences per dp rank"):
        main(
            [
                "--model",
                "qwen3_5_0_8b",
                "--layers",
                "4",
                "--mesh",
                "pp=2,dp=2",
                "--batch",
                "8",
                "--microbatches",
                "3",
                "--seq",
                "64",
            ]
        )
