"""UT (no processes): hs.offload_optimizer's state_dict has the device optimizer's form -- its
per-parameter state as DTensors in the parameters' layouts over the host tensors themselves, named by
the model's parameter names in hypershard.checkpoint -- and load_state_dict takes it back, re-reads
the host masters from the parameters and refuses a state in another layout."""

import pytest
import torch
import torch.nn as nn

import hypershard as hs
from hypershard import _C
from hypershard.checkpoint import api as checkpoint_api
from hypershard.testing.planning import PlanningMesh


def _model(mesh, values):
    """A module whose one parameter is rank 0's dp chunk (2 rows) of a [4, 3] tensor."""
    layout = mesh.layout([4, 3], ["S(0)"])
    model = nn.Module()
    model.weight = nn.Parameter(_C.from_local(values.clone(), mesh.device_mesh, layout))
    return model, layout


def _stepped(mesh, values):
    model, layout = _model(mesh, values)
    opt = hs.offload_optimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    model.weight.grad = _C.from_local(torch.ones(2, 3), mesh.device_mesh, layout)
    opt.step()
    return model, layout, opt


def test_state_dict_holds_dtensors_in_the_parameter_layout_over_the_host_state():
    mesh = PlanningMesh({"dp": 2})
    model, layout, opt = _stepped(mesh, torch.arange(6.0).reshape(2, 3))
    (master,) = opt.inner.param_groups[0]["params"]
    assert opt.parameter_of(master) is model.weight
    entry = opt.state_dict()["state"][0]
    for key in ("exp_avg", "exp_avg_sq"):
        assert _C.is_dtensor(entry[key]) and _C.layout_of(entry[key]) == layout, key
        assert _C.local_of(entry[key]).data_ptr() == opt.inner.state[master][key].data_ptr(), key  # no copy
    assert not _C.is_dtensor(entry["step"]) and float(entry["step"]) == 1.0
    named = checkpoint_api.optimizer_state_dict(model, opt)
    assert list(named["state"]) == ["weight"] and named["param_groups"][0]["params"] == ["weight"]


def test_load_state_dict_restores_the_state_and_rereads_the_masters():
    mesh = PlanningMesh({"dp": 2})
    _, _, saved = _stepped(mesh, torch.arange(6.0).reshape(2, 3))
    state = saved.state_dict()
    model, _ = _model(mesh, torch.full((2, 3), 7.0))  # the values a checkpoint load gave the parameter
    opt = hs.offload_optimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    with torch.no_grad():
        _C.local_of(model.weight).fill_(9.0)  # changed after the optimizer copied it
    opt.load_state_dict(state)
    (master,) = opt.inner.param_groups[0]["params"]
    assert torch.equal(master, torch.full((2, 3), 9.0))
    (saved_master,) = saved.inner.param_groups[0]["params"]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt.inner.state[master][key], saved.inner.state[saved_master][key]), key
        assert not _C.is_dtensor(opt.inner.state[master][key]), key


def test_load_state_dict_refuses_a_state_in_another_layout():
    mesh = PlanningMesh({"dp": 2})
    model, _, opt = _stepped(mesh, torch.arange(6.0).reshape(2, 3))
    state = opt.state_dict()
    replicated = _C.from_local(torch.zeros(4, 3), mesh.device_mesh, mesh.layout([4, 3], ["R"]))
    state["state"][0]["exp_avg"] = replicated
    with pytest.raises(ValueError, match=r"hypershard: offload_optimizer: state 'exp_avg' of a parameter is a DTensor "
                       r"of layout .*; allowed: the parameter's layout"):
        opt.load_state_dict(state)
