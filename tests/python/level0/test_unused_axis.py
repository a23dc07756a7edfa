"""Level0: a mesh axis that nothing lays anything out on warns once, at the model's first forward,
naming the axis and its size (parallelize, fully_shard); an axis a plan, the input hook or a
fully_shard group uses does not, nor one declared a replica axis. The outputs still equal one
device: the warning changes nothing.

Planted fault: without the check (warn_unused_axes_at_first_forward a no-op) the `zz` cases fail
("expected a warning naming 'zz'")."""

import warnings

import torch
from torch import nn

import hypershard as hs
from hypershard.tensor.axes import forget_noted_axes
from hypershard.testing import Case, assert_all_passed, current_mesh, run_cases

PLAN = {"0": "colwise", "2": "rowwise"}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def _batch():
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1))


def _forward(setup, expect_axis):
    """Builds the model, lets `setup(model, mesh)` distribute it in the distributed half, runs two
    forwards and checks the warnings: one naming `expect_axis` (None: none at all) on the first."""

    def fn():
        model, x = _model(), _batch()
        mesh = current_mesh()
        if mesh is None:
            return model(x) + model(x)
        forget_noted_axes()
        model = setup(model, mesh)
        with warnings.catch_warnings(record=True) as first:
            warnings.simplefilter("always")
            out = model(x)
        with warnings.catch_warnings(record=True) as second:
            warnings.simplefilter("always")
            out = out + model(x)
        ours = [str(w.message) for w in first if "is used by no plan" in str(w.message)]
        if expect_axis is None:
            assert not ours, f"unexpected warning: {ours}"
        else:
            size = dict(zip(mesh.mesh_dim_names, mesh.shape))[expect_axis]
            assert len(ours) == 1, f"expected a warning naming {expect_axis!r}, got {ours}"
            assert f"mesh axis {expect_axis!r} (size {size})" in ours[0], ours[0]
        assert not [w for w in second if "is used by no plan" in str(w.message)], "warned twice"
        return out

    return fn


def _parallelize(model, mesh):
    return hs.parallelize(model, mesh, PLAN)


def _fully_shard(model, mesh):
    return hs.fully_shard(model, mesh, dp_axis="dp")


def _replica(model, mesh):
    hs.declare_replica_axis(mesh, "zz")
    return hs.parallelize(model, mesh, PLAN, tp_axis="tp")


def cases():
    zz_dp = ((2, 2), ("zz", "dp"))
    dp_tp = ((2, 2), ("dp", "tp"))
    return [
        Case("parallelize_unused_zz", _forward(_parallelize, "zz"), mesh=zz_dp, check_grad=False),
        Case("parallelize_dp_tp_all_used", _forward(_parallelize, None), mesh=dp_tp, check_grad=False),
        Case("fully_shard_unused_zz", _forward(_fully_shard, "zz"), mesh=((2, 2), ("dp", "zz")), check_grad=False),
        Case("declared_replica_axis", _forward(_replica, None), mesh=zz_dp, check_grad=False),
        # without shard_inputs and any plan entry on it, dp itself is replicated
        Case(
            "parallelize_dp_without_input_hook",
            _forward(lambda m, mesh: hs.parallelize(m, mesh, PLAN, shard_inputs=False), "dp"),
            mesh=dp_tp,
            check_grad=False,
        ),
    ]


def test_unused_axis_warning():
    assert_all_passed(run_cases(cases(), world_size=4, timeout=240))
