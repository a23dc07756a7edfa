"""UT: the DTensor-only methods hypershard adds to torch.Tensor exist only on hypershard DTensors,
so code that detects DTensors with hasattr (as some libraries do) is not misled by plain tensors,
and torch's own DTensor class keeps its own methods."""

import torch
import torch.distributed.tensor as torch_dtensor

import hypershard  # noqa: F401  (installs the methods)
from hypershard.testing.planning import PlanningMesh

DTENSOR_ONLY = ("to_local", "full_tensor", "redistribute", "placements", "device_mesh")


def test_plain_tensors_have_no_dtensor_attributes():
    plain = torch.ones(2, 3)
    for name in DTENSOR_ONLY:
        assert not hasattr(plain, name), name
    try:
        plain.to_local()
    except AttributeError as error:
        assert "(it is not a hypershard DTensor)" in str(error)
    else:
        raise AssertionError("to_local on a plain tensor did not raise")


def test_hypershard_dtensors_have_them():
    mesh = PlanningMesh({"tp": 2})
    x = mesh.dtensor([4, 3], ["S(0)"])
    for name in DTENSOR_ONLY:
        assert hasattr(x, name), name
    assert tuple(x.to_local().shape) == (2, 3)
    assert repr(x.placements[0]) == "Shard(dim=0)"


def test_torch_dtensor_keeps_its_own_methods():
    for name in ("to_local", "full_tensor", "redistribute"):
        assert getattr(torch_dtensor.DTensor, name) is not getattr(torch.Tensor, name), name
