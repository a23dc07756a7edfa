"""Level0: the DTensor API around the per-op path, on real meshes: global values from printing,
tolist, numpy, item, torch.save/load and deepcopy; nn.Parameter; from_local with uneven shards;
DeviceMesh.from_torch; autocast; inference mode; mixed plain operands; clear errors on every rank
(missing operator, different meshes); and no Python frame of hypershard in the per-op path."""

import copy
import io
import sys

import torch

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, current_mesh, in_distributed_run, randint, run_cases

MESH2 = ((2,), ("a",))
MESH4 = ((4,), ("a",))
MESH22 = ((2, 2), ("a", "b"))


def via_tolist(x):
    return torch.tensor(x.tolist())


def via_numpy(x):
    return torch.from_numpy(x.detach().numpy().copy())


def via_save_load(x):
    buffer = io.BytesIO()
    torch.save({"x": x.detach()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["x"]
    assert not isinstance(loaded, hs.DTensor)  # the GLOBAL value, as a plain tensor
    return loaded


def via_deepcopy(x):
    y = copy.deepcopy(x.detach())
    if in_distributed_run():
        assert isinstance(y, hs.DTensor) and y.placements == x.placements
    return y * 1


def via_item(x):
    return torch.tensor([x[i, j].item() for i in range(x.shape[0]) for j in range(x.shape[1])])


def via_repr(x):
    text = repr(x)
    if in_distributed_run():
        assert repr(x.full_tensor().detach()) in text, text  # the global values are printed
        assert text.startswith("DTensor("), text
    return x * 1


def as_parameter(x):
    p = torch.nn.Parameter(x.detach().clone())
    if in_distributed_run():
        assert isinstance(p, torch.nn.Parameter) and isinstance(p, hs.DTensor)
    (p * p).backward(torch.ones_like(p))
    if in_distributed_run():
        assert isinstance(p.grad, hs.DTensor) and p.grad.placements == p.placements
    return p.grad * 1


def from_local_uneven(x):
    if not in_distributed_run():
        return x * 2
    local = x.to_local()                   # this rank's shard of an uneven split (differentiable)
    y = hs.DTensor.from_local(local * 2, x.device_mesh, x.placements)  # global shape inferred
    assert y.shape == x.shape, (y.shape, x.shape)
    return y


def from_torch_mesh(x):
    if not in_distributed_run():
        return (x + 1).detach()
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    tmesh = torch_mesh("cpu", (2,), mesh_dim_names=("t",))
    mesh = hs.DeviceMesh.from_torch(tmesh)
    assert mesh.shape == (2,) and mesh.mesh_dim_names == ("t",)
    y = hs.distribute_tensor(x.detach().full_tensor(), mesh, [hs.Shard(0)])
    return (y + 1).full_tensor()


def with_autocast(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = x @ w
    assert y.dtype == torch.bfloat16
    return y.float()


def in_inference_mode(x):
    with torch.inference_mode():
        y = x * 2 + 1
    assert y.is_inference()
    return y.clone()


def plain_operand(x):
    # A plain tensor next to a DTensor is taken as Replicate.
    return x * torch.arange(6.0) + torch.tensor(1.5)


def geqrf(x):
    return torch.geqrf(x)


def other_mesh(x):
    if not in_distributed_run():
        raise RuntimeError("operands live on different meshes")
    mesh = hs.init_device_mesh("cpu", (2,), ("z",))
    y = hs.distribute_tensor(torch.ones(4, 6), mesh, [hs.Replicate()])
    return x + y


def no_python_frames(x, w):
    """Runs a forward and backward with a profiler that records every Python call: none may
    come from hypershard's package (the per-op path is C++)."""
    calls = []

    def profiler(frame, event, arg):
        if event == "call" and "/hypershard/" in frame.f_code.co_filename and "/testing/" not in frame.f_code.co_filename:
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    y = torch.relu(x @ w) * 2 + x.sum(0, keepdim=True) if False else torch.relu(x @ w) * 2 + 1
    sys.setprofile(profiler)
    try:
        y = torch.relu(x @ w) * 2 + 1
        y.backward(torch.ones_like(y))
    finally:
        sys.setprofile(None)
    assert not calls, f"Python frames in the per-op path: {sorted(set(calls))}"
    return y.detach()


def storage_refuses(x):
    """A storage-less wrapper must fail loudly where a plain tensor exposes its memory: no caller
    may read a shard's bytes believing they are the whole tensor."""
    if in_distributed_run():
        for attempt in (lambda: x.data_ptr(), lambda: x.untyped_storage(), lambda: x.storage()):
            try:
                attempt()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            raise AssertionError("storage access on a DTensor did not raise")
    return x * 1


def one_hot(index):
    return torch.nn.functional.one_hot(index, num_classes=-1).float() + torch.nn.functional.one_hot(index, 7).sum()


def plain_destination_from_whole_inputs(index):
    """A plain tensor written from DTensors that hold the whole value (Replicate everywhere; transformers
    writes position ids computed from replicated image grids so): exact, nothing gathered, allowed in
    strict mode too, and not a fallback call."""
    out = torch.zeros(index.shape[0], 5)
    before = hs._C.dispatch_stats()["fallback_calls"] if in_distributed_run() else 0
    out.scatter_(1, index.unsqueeze(1), 1.0)
    out[1:3] = index[1:3].unsqueeze(1).float()
    if in_distributed_run():
        assert not isinstance(out, hs.DTensor) and hs._C.dispatch_stats()["fallback_calls"] == before
    return out


def plain_destination(index):
    if not in_distributed_run():
        raise RuntimeError("writes into the plain tensor argument")
    out = torch.zeros(index.shape[0], 5)
    return out.scatter_(1, index.unsqueeze(1), 1.0)


def on_submesh(x):
    """mesh["tp"]: the sub-mesh of this rank along tp, sharing the parent's process groups."""
    if not in_distributed_run():
        return (x * 3).detach()
    sub = current_mesh()["b"]
    assert sub.shape == (2,) and sub.mesh_dim_names == ("b",)
    y = hs.distribute_tensor(x.detach().full_tensor(), sub, [hs.Shard(1)])
    return (y * 3).full_tensor()


def _nan_part(x, rank):
    """Rank `rank`'s part of a Partial(max|min) value: x shifted, with NaN at rank-dependent spots
    (gloo's max/min drop a NaN depending on the rank order; torch's amax keeps it)."""
    flat = torch.arange(x.numel()).view(x.shape)
    return torch.where((flat + rank) % 5 == 0, torch.full_like(x, float("nan")), x - rank)


def partial_extremum_with_nan(op, world, target):
    def fn(x):
        if not in_distributed_run():
            stacked = torch.stack([_nan_part(x, r) for r in range(world)])
            return stacked.amax(0) if op == "max" else stacked.amin(0)
        mesh = current_mesh()
        part = _nan_part(x.to_local(), torch.distributed.get_rank())
        y = hs.DTensor.from_local(part, mesh, [hs.Partial(op)])
        return y.redistribute(mesh, [target])
    return fn


def api_cases():
    cases = []
    for mesh, placements in ((MESH2, ["S(0)"]), (MESH4, ["S(1)"]), (MESH22, ["S(0)", "P"]), (MESH2, ["P"])):
        tag = f"{mesh[0]}{placements}"
        x = Input((5, 3), placements=placements)
        cases += [
            Case(f"tolist{tag}", via_tolist, [x], mesh, check_grad=False),
            Case(f"numpy{tag}", via_numpy, [x], mesh, check_grad=False),
            Case(f"save_load{tag}", via_save_load, [x], mesh, check_grad=False),
            Case(f"deepcopy{tag}", via_deepcopy, [x], mesh, check_grad=False),
            Case(f"item{tag}", via_item, [x], mesh, check_grad=False),
            # cpu() / to() / type_as keep the DTensor and its values (the requirement's cpu, to, type_as)
            Case(f"cpu_to_type_as{tag}", lambda t: t.cpu().to(torch.float64).type_as(t) * 2, [x], mesh),
            Case(f"repr{tag}", via_repr, [x], mesh, check_grad=False),
        ]
    cases += [
        Case("parameter", as_parameter, [Input((5, 3), placements=["S(0)"])], MESH2, check_grad=False),
        Case("from_local_uneven", from_local_uneven, [Input((5, 3), placements=["S(0)"])], MESH4),
        Case("from_local_uneven_2d", from_local_uneven, [Input((5, 7), placements=["S(0)", "S(1)"])], MESH22),
        Case("from_torch_mesh", from_torch_mesh, [Input((4, 6), placements=["R"])], MESH2, check_grad=False),
        Case("autocast", with_autocast, [Input((4, 6), placements=["S(0)"]), Input((6, 5), placements=["R"])], MESH2,
             rtol=1e-2, atol=1e-2),
        Case("inference_mode", in_inference_mode, [Input((4, 6), placements=["S(0)"])], MESH2, check_grad=False),
        Case("plain_operand", plain_operand, [Input((4, 6), placements=["S(1)"])], MESH2),
        Case("no_python_frames", no_python_frames, [Input((4, 6), placements=["S(0)"]), Input((6, 5), placements=["R"])],
             MESH2, check_grad=False),
        Case("storage_refuses", storage_refuses, [Input((4, 6), placements=["S(0)"])], MESH2, check_grad=False),
        Case("one_hot", one_hot, [Input((5, 3), torch.int64, placements=["S(0)", "S(1)"], init=randint(0, 6))], MESH22),
        Case("one_hot_uneven", one_hot, [Input((3,), torch.int64, placements=["S(0)"], init=randint(0, 6))], MESH4),
        Case("plain_destination_from_whole_inputs", plain_destination_from_whole_inputs,
             [Input((4,), torch.int64, placements=["R"], init=randint(0, 5))], MESH2, check_grad=False),
        Case("plain_destination_refused", plain_destination, [Input((4,), torch.int64, placements=["S(0)"], init=randint(0, 5))],
             MESH2, expect_error="writes into the plain tensor argument"),
        Case("submesh", on_submesh, [Input((4, 6), placements=["R", "R"])], MESH22, check_grad=False),
        *(Case(f"partial_{op}_nan_to_{target}_{w}", partial_extremum_with_nan(op, w, target),
               [Input((5, 3), placements=["R"])], mesh, check_grad=False)
          for op in ("max", "min") for target in (hs.Replicate(), hs.Shard(0))
          for w, mesh in ((2, MESH2), (4, MESH4))),
        Case("missing_operator", geqrf, [Input((4, 6), placements=["S(0)"])], MESH2,
             expect_error="Missing operator aten::geqrf"),
        Case("different_meshes", other_mesh, [Input((4, 6), placements=["R"])], MESH2,
             expect_error="operands live on different meshes"),
    ]
    return cases


def test_api():
    assert_all_passed(run_cases(api_cases(), backend="hypershard", timeout=300))
