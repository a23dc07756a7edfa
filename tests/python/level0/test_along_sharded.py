"""Level0: scans, sorts, flip, roll and slices along a SHARDED dim (csrc/ops/along_sharded.cpp, views.cpp's
exchanged slices) on real meshes
against one device, strict mode, forward and gradients: the dim stays sharded (the output's
placements are the input's) and each case's second call moves at most the bytes its exchange
needs -- a fraction of what gathering the dim would send -- so a rule that gathered would fail.

Meshes (2), (4), (2, 2) (the dim over one axis, and over both) and (2, 2, 2); sizes uneven and
with empty shards (3 positions over 4 ranks); ties and NaN for cummax/cummin (torch picks the
last index of an equal extreme and propagates NaN) and for sort (stable: GLOBAL index order);
a Partial input through the linear ones. Planted faults (each rank's local scan or sort, no
exchange) are caught."""

import torch

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, run_cases, traffic_checked
from hypershard.testing.spec import randint

M2 = ((2,), ("dp",))
M4 = ((4,), ("tp",))
M22 = ((2, 2), ("dp", "tp"))
M222 = ((2, 2, 2), ("dp", "tp", "sp"))


def ties(shape, dtype, generator):
    """Few distinct values: every cummax/cummin step meets ties."""
    return torch.randint(0, 3, shape, generator=generator).to(dtype)


def with_nan(shape, dtype, generator):
    t = torch.randn(shape, generator=generator, dtype=dtype)
    t[torch.rand(shape, generator=generator) > 0.8] = float("nan")
    return t


def checked(fn, max_bytes, keep=True):
    """The distributed call, checked on its second run: the first output keeps the input's
    placements (the dim was not gathered; `keep`) and this rank sent at most `max_bytes(x)` bytes
    (x: the first input)."""

    def check(inputs, out, sent):
        x, first = inputs[0], out[0] if isinstance(out, (tuple, list)) else out
        problems = []
        if keep and tuple(first.placements) != tuple(x.placements):
            problems.append(f"placements {first.placements}, expected the input's {x.placements}")
        if sent > max_bytes(x):
            problems.append(f"sent {sent} bytes, at most {max_bytes(x)} expected")
        return problems
    return traffic_checked(fn, check)


def chunks(x, dim):
    """How many chunks `dim` of x is split into."""
    sizes = dict(zip(x.device_mesh.mesh_dim_names, x.device_mesh.shape))
    n = 1
    for name, p in zip(x.device_mesh.mesh_dim_names, x.placements):
        if isinstance(p, hs.Shard) and p.dim == dim:
            n *= sizes[name]
    return n


def scan_bytes(dim, value_bytes=4, indexed=False):
    """A scan sends each other member of the dim's group one slice of its result across `dim`
    (an all-gather per axis: chunks - 1 slices in all), of `value_bytes` per element, plus the
    int64 indices for cummax/cummin."""
    def limit(x):
        local = x.to_local()
        slice_elements = 1
        for d, size in enumerate(local.shape):
            slice_elements *= size if d != dim else 1
        return slice_elements * (chunks(x, dim) - 1) * (value_bytes + (8 if indexed else 0))
    return limit


def block_bytes(x):
    """flip/roll: at most this rank's block leaves it (every position goes to one rank)."""
    return x.to_local().numel() * x.to_local().element_size()


def sort_bytes(x):
    """A sort along dim 1 sends each element of this rank's block (value and int32 index) at most
    twice (to its bucket's rank, then to its rank's block), plus k-1 samples and k counts per row
    to each of the k-1 others and a tie verdict."""
    local, k = x.to_local(), chunks(x, 1)
    rows, size = local.shape[0], local.element_size()
    return 2 * local.numel() * (size + 4) + rows * k * (k - 1) * (size + 8) + 8 * k


def cases():
    out = []

    def add(name, fn, shape, placements, mesh, limit, dtype=torch.float32, init=None, check_grad=True, keep=True):
        out.append(Case(name, fn, [Input(shape, dtype, placements=placements, init=init)], mesh,
                        dist_fn=checked(fn, limit, keep), check_grad=check_grad and dtype.is_floating_point))

    layouts = ((M2, ["S(1)"], "2"), (M4, ["S(1)"], "4"), (M22, ["S(0)", "S(1)"], "2x2"),
               (M22, ["S(1)", "S(1)"], "2x2_two_axes"), (M222, ["S(0)", "S(1)", "S(1)"], "2x2x2"))
    for mesh, place, tag in layouts:
        two_axes = tag in ("2x2_two_axes", "2x2x2")
        for shape, size_tag in (((5, 11), "uneven"), ((4, 3), "empty_shards")):
            t = f"{size_tag}_{tag}"
            add(f"cumsum_{t}", lambda x: torch.cumsum(x, 1), shape, place, mesh, scan_bytes(1))
            add(f"cumsum_float64_{t}", lambda x: torch.cumsum(x, 1, dtype=torch.float64), shape, place, mesh,
                scan_bytes(1, value_bytes=8))
            add(f"cumsum_int_{t}", lambda x: torch.cumsum(x, 1), shape, place, mesh, scan_bytes(1, value_bytes=8),
                dtype=torch.int32, init=randint(-5, 5))
            # cumprod of values near 1: the products stay in range; its backward (no zeros) is
            # reversed cumsums, which flip along the sharded dim
            add(f"cumprod_{t}", lambda x: torch.cumprod(x * 0.1 + 1, 1), shape, place, mesh, scan_bytes(1))
            add(f"logcumsumexp_{t}", lambda x: torch.logcumsumexp(x, 1), shape, place, mesh, scan_bytes(1))
            add(f"cummax_{t}", lambda x: torch.cummax(x, 1), shape, place, mesh, scan_bytes(1, indexed=True))
            add(f"cummin_ties_{t}", lambda x: torch.cummin(x, 1), shape, place, mesh, scan_bytes(1, indexed=True), init=ties,
                check_grad=False)
            add(f"cummax_ties_{t}", lambda x: torch.cummax(x, 1), shape, place, mesh, scan_bytes(1, indexed=True), init=ties,
                check_grad=False)
            add(f"cummax_nan_{t}", lambda x: torch.cummax(x, 1), shape, place, mesh, scan_bytes(1, indexed=True),
                init=with_nan, check_grad=False)
            add(f"cummin_nan_{t}", lambda x: torch.cummin(x, 1), shape, place, mesh, scan_bytes(1, indexed=True),
                init=with_nan, check_grad=False)
            if not two_axes:  # moves exchange over one axis; over two the dim is made whole
                add(f"flip_{t}", lambda x: torch.flip(x, [1]), shape, place, mesh, block_bytes)
                add(f"flip_both_{t}", lambda x: torch.flip(x, [0, 1]), shape, place, mesh,
                    lambda x: 2 * block_bytes(x))
                for shift in (1, -4, 13):
                    add(f"roll_{shift}_{t}", lambda x, s=shift: torch.roll(x, s, 1), shape, place, mesh, block_bytes)
                add(f"roll_two_dims_{t}", lambda x: torch.roll(x, (2, -3), (0, 1)), shape, place, mesh,
                    lambda x: 2 * block_bytes(x))
    # a small roll moves only the positions that cross a boundary: 1 column of 5 rows per rank
    add("roll_1_moves_one_column_4", lambda x: torch.roll(x, 1, 1), (5, 16), ["S(1)"], M4,
        lambda x: 5 * 4)
    # topk along the sharded dim: k best per rank, one all-gather of candidates, values and
    # indices whole along dim; k larger than some chunks (3 over 4 ranks: empty chunks)
    for mesh, place, tag in layouts:
        for k, shape in ((3, (5, 11)), (4, (4, 5))):
            for largest in (True, False):
                add(f"topk_{k}_{'largest' if largest else 'smallest'}_{shape[1]}_{tag}",
                    lambda x, k=k, largest=largest: torch.topk(x, k, 1, largest=largest), shape, place, mesh,
                    lambda x, k=k: x.to_local().shape[0] * k * (4 + 8) * (chunks(x, 1) - 1), keep=False)
    # ties (torch's own order among equal values: the dim is gathered then) and sorted=False
    for mesh, place, tag in layouts[:3]:
        # the candidates (k <= 6 values and int64 indices per row and chunk) plus the dim gathered
        gathered = lambda x: x.numel() * x.element_size() + x.shape[0] * 6 * 12 * chunks(x, 1)  # noqa: E731
        add(f"topk_ties_{tag}", lambda x: torch.topk(x, 3, 1), (5, 11), place, mesh, gathered, init=ties,
            check_grad=False, keep=False)
        add(f"topk_masked_rows_{tag}", lambda x: torch.topk(x.masked_fill(x > 0.5, float("-inf")), 6, 1), (5, 11),
            place, mesh, gathered, check_grad=False, keep=False)
        add(f"topk_unsorted_values_{tag}", lambda x: torch.topk(x, 3, 1, sorted=False)[0].sort(1)[0], (5, 11),
            place, mesh, gathered, keep=False)
    # sort along the sharded dim: a sample sort, the results keep the input's sharding (uneven,
    # empty chunks, 40 positions); equal values in a stable sort keep GLOBAL index order, a
    # non-stable sort with equal values gathers the dim (torch's own order); NaN last / first
    for mesh, place, tag in layouts[:3]:
        for shape in ((5, 11), (4, 3), (3, 40)):
            t = f"{shape[1]}_{tag}"
            for desc in (False, True):
                d = "desc" if desc else "asc"
                add(f"sort_{d}_{t}", lambda x, desc=desc: torch.sort(x, 1, descending=desc), shape, place, mesh,
                    sort_bytes)
                add(f"sort_stable_ties_{d}_{t}", lambda x, desc=desc: torch.sort(x, dim=1, descending=desc, stable=True),
                    shape, place, mesh, sort_bytes, init=ties, check_grad=False)
                add(f"sort_stable_nan_{d}_{t}", lambda x, desc=desc: torch.sort(x, dim=1, descending=desc, stable=True),
                    shape, place, mesh, sort_bytes, init=with_nan, check_grad=False)
                add(f"sort_ties_{d}_{t}", lambda x, desc=desc: torch.sort(x, 1, descending=desc), shape, place, mesh,
                    lambda x: sort_bytes(x) + block_bytes(x) * (chunks(x, 1) - 1), init=ties, check_grad=False)
                add(f"argsort_{d}_{t}", lambda x, desc=desc: torch.argsort(x, 1, descending=desc), shape, place, mesh,
                    sort_bytes, check_grad=False)
            add(f"msort_{t}", lambda x: torch.msort(x.t()).t(), shape, place, mesh, sort_bytes)
            add(f"sort_float64_{t}", lambda x: torch.sort(x, 1), shape, place, mesh, sort_bytes, dtype=torch.float64)
            add(f"sort_int64_ties_{t}", lambda x: torch.sort(x, dim=1, stable=True), shape, place, mesh, sort_bytes,
                dtype=torch.int64, init=randint(-3, 3))
            add(f"sort_bool_{t}", lambda x: torch.sort(x > 0, dim=1, stable=True), shape, place, mesh, sort_bytes,
                check_grad=False)
    # a non-stable sort of integers (MoE's expert ids): the dim is made whole up front
    add("sort_int64_nonstable_whole_4", lambda x: torch.sort(x, 1), (5, 11), ["S(1)"], M4,
        lambda x: block_bytes(x) * chunks(x, 1), dtype=torch.int64, init=randint(-3, 3), keep=False)
    for mesh, place, tag in layouts[3:]:  # over two axes: the dim is made whole, the result correct
        add(f"sort_two_axes_{tag}", lambda x: torch.sort(x, 1), (5, 11), place, mesh,
            lambda x: block_bytes(x) * chunks(x, 1), keep=False)
    # slices of the sharded dim (steps, negative bounds, a short slice leaving chunks empty) and
    # their backward (slice_backward by the reverse exchange): at most the rank's block leaves it
    for mesh, place, tag in layouts[:3]:
        for name, fn in (("head", lambda x: x[:, :9]), ("tail", lambda x: x[:, -7:]),
                         ("step2", lambda x: x[:, 1::2]), ("step3_mid", lambda x: x[:, 2:10:3]),
                         ("short", lambda x: x[:, 4:6]), ("narrow", lambda x: x.narrow(1, 3, 5))):
            add(f"slice_{name}_{tag}", fn, (5, 11), place, mesh, block_bytes)
    # Qwen3.5's causal conv: conv1d padded by k - 1 on both sides (a halo exchange), then [..., :L]
    add("causal_conv_then_slice_4", lambda x: torch.nn.functional.conv1d(
        x, torch.linspace(-1, 1, 12).view(3, 1, 4), padding=3, groups=3)[..., :17], (2, 3, 17), ["S(2)"], M4,
        lambda x: block_bytes(x))
    # Partial inputs through the linear ones (cumsum, flip, roll), the dim sharded on the other axis
    for name, fn in (("cumsum", lambda x: torch.cumsum(x, 1)), ("flip", lambda x: torch.flip(x, [1])),
                     ("roll", lambda x: torch.roll(x, 2, 1))):
        out.append(Case(f"{name}_partial_2x2", fn, [Input((5, 11), placements=["P", "S(1)"])], M22))
    return out


def test_along_sharded_matches_one_device():
    assert_all_passed(run_cases(cases(), timeout=900))


def _write_through_exchanged_slice(x):
    y = x.detach().clone()
    y[:, 2:9].mul_(2)  # the slice was fetched from other ranks: it does not alias y
    return y


def test_a_write_through_an_exchanged_slice_is_refused():
    """A slice built by an exchange is a new tensor: writing into it would be lost, so it raises
    on every rank (as for a slice of a gathered dim)."""
    case = Case("write_through_exchanged_slice", _write_through_exchanged_slice,
                [Input((5, 11), placements=["S(1)"])], M4, check_grad=False, expect_error="does not alias its base")
    assert_all_passed(run_cases([case], timeout=300))


def _local_cumsum(x):
    """A planted fault: each rank's local cumsum, no totals exchanged."""
    return hs.DTensor.from_local(torch.cumsum(x.to_local(), 1), x.device_mesh, x.placements, shape=x.shape)


def _local_sort(x):
    """A planted fault: each rank sorts its own block, nothing exchanged."""
    values = torch.sort(x.to_local(), 1).values
    return hs.DTensor.from_local(values, x.device_mesh, x.placements, shape=x.shape)


def test_a_local_sort_would_be_caught():
    case = Case("planted_local_sort", lambda x: torch.sort(x, 1).values, [Input((5, 11), placements=["S(1)"])], M4,
                dist_fn=_local_sort, check_grad=False)
    assert not run_cases([case], timeout=300).ok, "the planted local sort passed"


def test_a_local_scan_would_be_caught():
    case = Case("planted_local_cumsum", lambda x: torch.cumsum(x, 1), [Input((5, 11), placements=["S(1)"])], M4,
                dist_fn=_local_cumsum, check_grad=False)
    assert not run_cases([case], timeout=300).ok, "the planted local cumsum passed"
