"""HSDP planned, without processes: hs.fully_shard with its replicate axis runs on the planner's
simulated mesh (dp_replicate=R x dp=D: sharded over dp, Replicate over dp_replicate, the batch split
over both), and the search plans it between plain data parallelism and fully_shard.

What an HSDP rank must hold and send, against the plain fully sharded plan of dp=D with the same
sequences per rank (one each), from what hs.fully_shard does (docs/fully_shard.md, HSDP):
- the same parameter, gradient and optimizer bytes (each sharded over the D ranks of dp only) and
  the same peaks (the same local tensors alive at every op): equal, exactly;
- the same dp bytes per collective kind (the same groups gathered and reduce-scattered over D);
- on dp_replicate in backward: one ring all-reduce of the fp32 gradient shards over R replicas,
  2 (R - 1) / R of their bytes, exactly (the data-parallel buckets hold every gradient once).
"""

import functools

import pytest

from hypershard.planner.cli import main
from hypershard.planner.run import PlanReport, plan_step
from hypershard.planner.step import check_hsdp, hsdp_mesh, load_config
from hypershard.testing.models import TINY_CONFIGS


def _plan(shape, seq=16):
    config = load_config("qwen3", **TINY_CONFIGS["qwen3"])
    sequences = shape.get("dp", 1) * shape.get("dp_replicate", 1)
    return plan_step(config, shape, batch=sequences, seq=seq, fully_shard=True, device="cpu")


@functools.lru_cache(maxsize=None)
def _plain(shape: tuple) -> PlanReport:
    """The fully sharded plan of a mesh without replicas, planned once per module."""
    return _plan(dict(shape))


def _hsdp_problems(hsdp: PlanReport, plain: PlanReport, replicas: int) -> list:
    """What differs from the module docstring's expectations (empty: none)."""
    problems = []
    for figure in ("parameters", "gradients", "optimizer", "peak", "forward_backward_peak", "flops"):
        if getattr(hsdp, figure) != getattr(plain, figure):
            problems.append(f"{figure}: HSDP {getattr(hsdp, figure)}, fully sharded {getattr(plain, figure)}")
    for kind in ("dp all_gather", "dp reduce_scatter"):
        if hsdp.collective_bytes.get(kind) != plain.collective_bytes.get(kind):
            problems.append(
                f"{kind}: HSDP {hsdp.collective_bytes.get(kind)}, fully sharded {plain.collective_bytes.get(kind)}"
            )
    expected = 2 * (replicas - 1) * hsdp.gradients // replicas
    got = hsdp.phase_bytes.get("backward dp_replicate", 0)
    if got != expected:
        problems.append(f"backward dp_replicate: {got} bytes, expected 2 (R-1)/R x gradients = {expected}")
    return problems


@pytest.mark.parametrize(
    "replicas,shape", [(2, {"dp": 2}), (4, {"dp": 2}), (2, {"dp": 2, "tp": 2})], ids=["r2-dp2", "r4-dp2", "r2-dp2-tp2"]
)
def test_hsdp_is_planned_as_fully_shard_runs_it(replicas, shape):
    plain = _plain(tuple(shape.items()))
    hsdp = _plan(hsdp_mesh({a: n * replicas if a == "dp" else n for a, n in shape.items()}, replicas, True))
    assert hsdp.mesh == {"dp_replicate": replicas, **shape}
    assert hsdp.coordinates["dp_replicate"] == 0 and hsdp.uncounted == 0
    problems = _hsdp_problems(hsdp, plain, replicas)
    assert not problems, "\n".join(problems)


def test_planted_batch_not_split_over_the_replicas_is_caught(monkeypatch):
    """A plan whose inputs are split over dp only (each rank then runs R sequences and its gradients
    are not Partial over the replicas): the check must see it."""
    import hypershard.parallel.api as api

    real = api.parallelize
    monkeypatch.setattr(api, "parallelize", lambda model, mesh, **kw: real(model, mesh, **dict(kw, dp_axis="dp")))
    problems = _hsdp_problems(_plan({"dp_replicate": 2, "dp": 2}), _plain((("dp", 2),)), 2)
    assert any(p.startswith("peak") for p in problems), problems
    assert any("backward dp_replicate" in p for p in problems), problems


def test_hsdp_mesh_and_its_refusals():
    assert hsdp_mesh({"dp": 8, "ep": 2}, 2, True) == {"dp_replicate": 2, "dp": 4, "ep": 2}
    assert list(hsdp_mesh({"ep": 2, "dp": 8}, 4, True)) == ["dp_replicate", "ep", "dp"]  # outermost
    with pytest.raises(ValueError, match=r"^hypershard: plan: --hsdp 3 on dp=8: .*allowed: R >= 2 dividing dp"):
        hsdp_mesh({"dp": 8}, 3, True)
    with pytest.raises(ValueError, match="allowed: R >= 2"):
        hsdp_mesh({"dp": 8}, 8, True)  # dp/R = 1: nothing left to shard over
    with pytest.raises(ValueError, match="needs --fully-shard"):
        check_hsdp({"dp_replicate": 2, "dp": 2}, False)
    with pytest.raises(ValueError, match="comes first"):
        check_hsdp({"dp": 2, "dp_replicate": 2}, True)
    with pytest.raises(ValueError, match="a dp axis of size >= 2"):
        check_hsdp({"dp_replicate": 2, "tp": 2}, True)


def test_cli_plans_hsdp_and_refuses_bad_input_in_one_line(capsys):
    common = ["--model", "qwen3_5_0_8b", "--seq", "64", "--layers", "4", "--memory-per-rank", "1000"]
    with pytest.raises(SystemExit) as refused:
        main(common + ["--mesh", "dp=4", "--hsdp", "2"])  # without --fully-shard
    assert str(refused.value).startswith("hypershard: plan: mesh dp_replicate=2,dp=2: dp_replicate is fully_shard")
    assert main(common + ["--mesh", "dp=4", "--hsdp", "2", "--fully-shard"]) == 0
    out = capsys.readouterr().out
    assert "on mesh dp_replicate=2,dp=2; rank 0 (dp_replicate=0, dp=0)" in out, out
    assert "dp_replicate all_reduce" in out and "dp reduce_scatter" in out, out
    # the time model: both axes in one node of 8 (4 ranks), 4 sequences per step
    assert "estimated step (NVIDIA H100 SXM" in out and "4 sequences" in out and "dp_replicate 0.00 s (intra)" in out


def test_search_plans_hsdp_between_data_parallel_and_fully_shard():
    """Per mesh the search plans no fully_shard, then HSDP from the most replicas down, then fully_shard,
    and stops at the first that fits (a stand-in plan whose peak is 8 GB / the shard ranks)."""
    from hypershard.planner.search import HARDWARE, axis_links, candidates, hsdp_meshes, parameter_split, search

    assert hsdp_meshes({"dp": 8, "ep": 2}) == [
        {"dp_replicate": 4, "dp": 2, "ep": 2},
        {"dp_replicate": 2, "dp": 4, "ep": 2},
    ]
    assert hsdp_meshes({"dp": 2}) == [] and hsdp_meshes({"pp": 2, "dp": 4}) == []
    # replicas across nodes, the shard group inside one: HSDP's layout
    assert axis_links({"dp_replicate": 4, "dp": 8}, 8) == {"dp_replicate": "inter", "dp": "intra"}
    config = load_config("qwen3", **TINY_CONFIGS["qwen3"])
    names = [
        c.name
        for c in candidates(8, config, 16, 0, 8, parameter_split(config))
        if "cp" not in c.mesh and "tp" not in c.mesh
    ]
    assert names[:4] == ["dp=8", "dp_replicate=4,dp=2 fs", "dp_replicate=2,dp=4 fs", "dp=8 fs"], names
    planned = []

    def plan(mesh, fully_shard, recompute, layers):
        planned.append((",".join(f"{a}={n}" for a, n in mesh.items()), fully_shard))
        shard = mesh.get("dp", 1) if fully_shard else 1
        return PlanReport(mesh=dict(mesh), peak=int(8e9 / shard), flops=int(1e12), axis_bytes={"dp": int(1e9)})

    ranked = search(config, 8, 5e9, 16, plan, HARDWARE["h100"], 0.4, recompute_modes=("none",), verify=0)
    on_dp8 = [p for p in planned if p[0] in ("dp=8", "dp_replicate=4,dp=2", "dp_replicate=2,dp=4")]
    # (the tiny model's 2 layers: one cut depth, one plan per setting)
    assert on_dp8 == [("dp=8", False), ("dp_replicate=4,dp=2", True)], on_dp8
    best = next(c for c in ranked if c.name == "dp_replicate=4,dp=2 fs")
    assert best.report.peak == 4e9 and best.estimate["tokens_per_s"] == pytest.approx(8 * 16 / best.estimate["step_s"])
