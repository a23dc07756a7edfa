"""UT: the DTensor-only methods hypershard adds to torch.Tensor exist only on hypershard DTensors,
so code that detects DTensors with hasattr (as some libraries do) is not misled by plain tensors,
and torch's own DTensor class keeps its own methods."""

import torch
import torch.distributed.tensor as torch_dtensor

import hypershard  # noqa: F401  (installs the methods)
from hypershard.testing.planning import PlanningMesh

DTENSOR_ONLY = ("to_local", "full_tensor", "redistribute", "placements", "device_mesh", "sharding")


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


def test_torch_attributes_keep_torch_meaning():
    """Tensor.layout stays torch's memory layout on DTensors (torch.masked, assert_close and
    torch.compile read it); hypershard's Layout is .sharding / hypershard.layout_of."""
    mesh = PlanningMesh({"tp": 2})
    x = mesh.dtensor([4, 3], ["S(0)"])
    assert x.layout is torch.strided
    assert x.sharding == hypershard.layout_of(x)
    assert tuple(x.sharding.global_shape) == (4, 3)


def test_layouts_and_meshes_are_hashable():
    mesh = PlanningMesh({"dp": 2, "tp": 2})
    a, b = mesh.dtensor([4, 6], ["S(0)", "R"]), mesh.dtensor([4, 6], ["S(0)", "R"])
    c = mesh.dtensor([4, 6], ["R", "S(1)"])
    assert a.sharding == b.sharding and hash(a.sharding) == hash(b.sharding)
    assert len({a.sharding, b.sharding, c.sharding}) == 2
    assert hash(a.sharding.mesh) == hash(c.sharding.mesh)
    assert len({a.sharding.mesh, c.sharding.mesh}) == 1


def test_torch_overrides_can_index_the_methods():
    """torch.compile indexes __get__ and __set__ of every non-callable torch.Tensor attribute
    (torch.overrides); the DTensor-only methods must have both (they are read-only)."""
    index = getattr(torch.overrides._get_overridable_functions, "__wrapped__",
                    torch.overrides._get_overridable_functions)()[1]
    for name in ("to_local", "full_tensor", "redistribute"):
        assert f"torch.Tensor.{name}.__set__" in index.values(), name
    plain = torch.ones(2)
    try:
        torch.Tensor.to_local.__set__(plain, None)
    except AttributeError as error:
        assert "read-only" in str(error)
    else:
        raise AssertionError("setting to_local did not raise")


def test_fakeifying_a_dtensor_is_a_graph_break_not_an_error():
    """Dynamo fakes every tensor it traces; a hypershard DTensor has no storage to fake, and must
    give the exception Dynamo turns into a graph break (hypershard/tensor/fake_guard.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedFakeTensorException

    from hypershard.tensor.fake_guard import GRAPH_BREAK_REASON
    x = PlanningMesh({"tp": 2}).dtensor([4, 3], ["S(0)"])
    try:
        FakeTensorMode().from_tensor(x)
    except UnsupportedFakeTensorException as error:
        assert GRAPH_BREAK_REASON in str(error)
    else:
        raise AssertionError("a DTensor was faked")
    assert FakeTensorMode().from_tensor(torch.ones(2)).shape == (2,)  # plain tensors unchanged
