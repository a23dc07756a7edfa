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
