"""The Python face of the layout core: bindings, error translation, notation round-trips,
the Python helpers in hypershard.layout, and the demo."""

import subprocess
import sys

import pytest

import hypershard as hs

SHAPE = [6, 5]  # uneven on a 2x2 mesh on purpose


@pytest.fixture
def mesh():
    return hs.mesh({"dp": 2, "tp": 2})


def some_layouts(mesh):
    return [
        hs.Layout.replicate(mesh, SHAPE),
        hs.from_alias(mesh, SHAPE, ("dp", "None")),
        hs.from_alias(mesh, SHAPE, ("dp", "tp")),
        hs.from_alias(mesh, SHAPE, ("tp", "dp")),
        hs.from_alias(mesh, SHAPE, (("dp", "tp"), "None")),
        hs.from_alias(mesh, SHAPE, ("None", ("tp", "dp"))),
        hs.from_alias(mesh, SHAPE, ("None", "tp"), partial={"dp": "sum"}),
        hs.from_alias(mesh, SHAPE, ("None", "None"), partial={"dp": "max", "tp": "max"}),
    ]


# --- meshes -------------------------------------------------------------------------------


def test_mesh_properties(mesh):
    assert mesh.shape == [2, 2]
    assert mesh.axis_names == ["dp", "tp"]
    assert mesh.ranks == [0, 1, 2, 3]
    assert (mesh.ndim, mesh.size) == (2, 4)
    assert mesh.axis_index("tp") == 1
    assert mesh.coordinate(2) == [1, 0]
    assert mesh.axis_group(0, 1) == [1, 3]
    assert mesh.axis_groups(1) == [[0, 1], [2, 3]]
    assert mesh.submesh(["tp"], 3).ranks == [2, 3]
    assert mesh == hs.Mesh.create([2, 2], ["dp", "tp"])
    assert mesh != hs.Mesh.create([2, 2], ["dp", "tp"], [3, 2, 1, 0])
    assert repr(mesh) == "Mesh(dp=2, tp=2)"


def test_layout_geometry(mesh):
    layout = hs.from_alias(mesh, SHAPE, ("dp", "tp"))
    assert [layout.local_shape(r) for r in range(4)] == [[3, 3], [3, 2], [3, 3], [3, 2]]
    assert [layout.global_offset(r) for r in range(4)] == [[0, 0], [0, 3], [3, 0], [3, 3]]
    assert layout.dim_axes == [[0], [1]]
    assert layout.sharded_dim(1) == 1
    assert not layout.is_partial(0)
    assert layout.mesh == mesh
    assert str(layout) == layout.to_string()


# --- errors -------------------------------------------------------------------------------


def test_layout_error_is_a_value_error():
    assert issubclass(hs.LayoutError, ValueError)
    assert hs.LayoutError.__module__ == "hypershard"


def test_error_translation_keeps_the_message():
    with pytest.raises(hs.LayoutError, match=r"^hypershard: .*'dp'") as info:
        hs.Mesh.create([2, 2], ["dp", "dp"])
    assert isinstance(info.value, ValueError)


def test_error_from_layout_checks(mesh):
    with pytest.raises(hs.LayoutError, match=r"^hypershard: "):
        hs.Layout.create(mesh, SHAPE, [[0], [0]])  # one axis sharding two dims
    with pytest.raises(hs.LayoutError, match=r"^hypershard: "):
        hs.from_alias(mesh, SHAPE, ("pp", "None"))  # no such axis


# --- notations ----------------------------------------------------------------------------


def test_round_trip_through_placements(mesh):
    for layout in some_layouts(mesh):
        assert hs.from_placements(mesh, SHAPE, hs.to_placements(layout)) == layout


def test_round_trip_through_alias(mesh):
    for layout in some_layouts(mesh):
        alias = hs.to_alias(layout)
        assert hs.from_alias(mesh, SHAPE, alias) == layout
        assert hs.parse_alias(alias.to_string()) == alias


def test_round_trip_through_tensor_map(mesh):
    for layout in some_layouts(mesh):
        tensor_map = hs.to_tensor_map(layout)
        assert hs._C.from_tensor_map(mesh, SHAPE, tensor_map, layout.partial) == layout


def test_placement_spellings(mesh):
    shard0 = hs.Placement.shard(0)
    assert hs.placement("Shard(0)") == shard0
    assert hs.placement("S(0)") == shard0
    assert hs.placement("R") == hs.Placement.replicate()
    assert hs.placement("Replicate()") == hs.Placement.replicate()
    assert hs.placement("Partial()") == hs.Placement.partial()
    assert hs.placement("P(max)") == hs.Placement.partial(hs.ReduceOp.Max)
    with pytest.raises(hs.LayoutError):
        hs.placement("Sharded(0)")


def test_torch_placement_objects(mesh):
    from torch.distributed.tensor import Partial, Replicate, Shard

    layout = hs.make_layout(mesh, SHAPE, [Shard(0), Partial("avg")])
    assert layout == hs.make_layout(mesh, SHAPE, ["S(0)", "P(avg)"])
    assert hs.to_placements(layout).per_axis == [
        hs.Placement.shard(0), hs.Placement.partial(hs.ReduceOp.Avg)]
    assert hs.make_layout(mesh, SHAPE, [Replicate(), Shard(-1)]) == hs.make_layout(
        mesh, SHAPE, ("None", "tp"))


def test_alias_spellings(mesh):
    expected = hs.Layout.create(mesh, SHAPE, [[0, 1], []])
    assert hs.make_layout(mesh, SHAPE, (("dp", "tp"), "None")) == expected
    assert hs.make_layout(mesh, SHAPE, (("dp", "tp"), None)) == expected
    assert hs.make_layout(mesh, SHAPE, '(("dp", "tp"), "None")') == expected
    partial = hs.make_layout(mesh, SHAPE, ("None", "tp"), partial=["dp"])
    assert partial.partial == [hs.ReduceOp.Sum, None]
    assert partial == hs.make_layout(mesh, SHAPE, '("None", "tp") partial(sum: dp)')


def test_multi_axis_shard_order_round_trips(mesh):
    minor_first = hs.from_alias(mesh, SHAPE, (("tp", "dp"), "None"))
    placements = hs.to_placements(minor_first)
    assert placements.shard_order == [(0, [1, 0])]
    assert hs.from_placements(mesh, SHAPE, placements.per_axis, {0: [1, 0]}) == minor_first


def test_tensor_map_helper(mesh):
    assert hs.from_tensor_map(mesh, SHAPE, [1, -1]) == hs.from_alias(mesh, SHAPE, ("dp", "None"))
    assert hs.from_tensor_map(mesh, SHAPE, [-1, 0], partial={"dp": "sum"}) == hs.from_alias(
        mesh, SHAPE, ("None", "tp"), partial={"dp": "sum"})


# --- planner ------------------------------------------------------------------------------


def test_shard_to_replicate_is_one_all_gather():
    mesh = hs.mesh({"dp": 2})
    shard = hs.from_alias(mesh, [5, 4], ("dp", "None"))
    plan = hs.plan_redistribute(shard, hs.Layout.replicate(mesh, [5, 4]))
    assert len(plan.steps) == 1
    step = plan.steps[0]
    assert step.kind == hs.StepKind.AllGather
    assert (step.axis, step.src_dim, step.dst_dim) == (0, 0, -1)
    assert step.from_ == shard and step.to == hs.Layout.replicate(mesh, [5, 4])
    assert step.elements_sent == [12, 8]  # each rank's rows 3 and 2, sent to its one peer
    assert plan.total_elements() == 20


def test_equal_layouts_need_no_steps(mesh):
    layout = hs.from_alias(mesh, SHAPE, ("dp", "tp"))
    assert hs.plan_redistribute(layout, layout).steps == []


def test_plan_between_meshes_is_an_error(mesh):
    other = hs.mesh({"dp": 4})
    with pytest.raises(hs.LayoutError, match=r"^hypershard: "):
        hs.plan_redistribute(hs.Layout.replicate(mesh, SHAPE), hs.Layout.replicate(other, SHAPE))


# --- demo ---------------------------------------------------------------------------------


def test_demo_runs():
    result = subprocess.run([sys.executable, "-m", "hypershard.tools.layout_demo"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "all_gather" in result.stdout
    assert "(Shard(0), Shard(1))" in result.stdout


def test_demo_help():
    result = subprocess.run([sys.executable, "-m", "hypershard.tools.layout_demo", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    assert "--shape" in result.stdout
