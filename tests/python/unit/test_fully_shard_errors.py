"""UT (no processes): hs.fully_shard refuses what it cannot shard, before touching the module, with
the house error format."""

import pytest
import torch.nn as nn

import hypershard as hs
from hypershard.testing.planning import PlanningMesh


def _linear(mesh, spec):
    module = nn.Linear(3, 4, bias=False)
    module.weight = nn.Parameter(mesh.dtensor([4, 3], spec))
    return module


def test_mesh_without_the_dp_axis():
    mesh = PlanningMesh({"tp": 2})
    with pytest.raises(ValueError, match=r"hypershard: fully_shard: the mesh .* has no axis 'dp'; allowed: one of \['tp'\]"):
        hs.fully_shard(_linear(mesh, ["R"]), mesh.device_mesh)


def test_parameter_already_sharded_on_dp():
    mesh = PlanningMesh({"dp": 2})
    module = _linear(mesh, ["S(0)"])
    with pytest.raises(ValueError, match=r"parameter Linear.weight has layout .* which is not Replicate on 'dp'"):
        hs.fully_shard(module, mesh.device_mesh)
    assert type(module) is nn.Linear and not hasattr(module, "_hs_fully_shard")  # untouched


def test_parameter_on_another_mesh():
    mesh, other = PlanningMesh({"dp": 2}), PlanningMesh({"dp": 2, "tp": 2})
    with pytest.raises(ValueError, match=r"parameter Linear.weight is on mesh .*; allowed: the mesh passed to fully_shard"):
        hs.fully_shard(_linear(mesh, ["R"]), other.device_mesh)


def test_module_without_parameters_of_its_own():
    mesh = PlanningMesh({"dp": 2})
    with pytest.raises(ValueError, match="has no parameters of its own to shard"):
        hs.fully_shard(nn.ReLU(), mesh.device_mesh)


def test_hsdp_replicate_axis_must_be_another_axis():
    mesh = PlanningMesh({"dp_replicate": 2, "dp": 2})
    for bad in ("dp", "nodes"):
        with pytest.raises(ValueError, match=rf"hypershard: fully_shard: replicate_axis '{bad}' is not an axis of .* "
                           r"other than dp_axis 'dp'; allowed: one of \['dp_replicate'\]"):
            hs.fully_shard(_linear(mesh, ["R", "R"]), mesh.device_mesh, replicate_axis=bad)


def test_hsdp_parameter_sharded_on_the_replicate_axis():
    mesh = PlanningMesh({"dp_replicate": 2, "dp": 2})
    module = _linear(mesh, ["S(0)", "R"])
    with pytest.raises(ValueError, match=r"parameter Linear.weight has layout .* not Replicate on the replicate axis "
                       r"'dp_replicate'; allowed: parameters Replicate on 'dp_replicate'"):
        hs.fully_shard(module, mesh.device_mesh, replicate_axis="dp_replicate")
    assert type(module) is nn.Linear and not hasattr(module, "_hs_fully_shard")


def test_offload_optimizer_refusals():
    import torch

    with pytest.raises(ValueError, match="hypershard: offload_optimizer: no parameters to optimize"):
        hs.offload_optimizer([])
    with pytest.raises(ValueError, match="a parameter of dtype torch.int64; allowed: floating parameters"):
        hs.offload_optimizer([torch.zeros(2, dtype=torch.long)])
    p = nn.Parameter(torch.ones(3))
    opt = hs.offload_optimizer([p], torch.optim.SGD, lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # schedules the host optimizer
    assert opt.inner.param_groups[0]["lr"] == 0.25
    p.grad = torch.ones(3)
    opt.step()
    scheduler.step()
    assert torch.equal(p.detach(), torch.full((3,), 0.75)) and opt.bytes_to_host == opt.bytes_to_device == 12
    with pytest.raises(ValueError, match="a closure"):
        opt.step(lambda: 0.0)
