"""Level0: the along-dims family (csrc/ops/along_dims.cpp) on real meshes against one device, in
strict mode: scans, sorts and selections, dim-wise reductions, flip/roll and batched linear
algebra, along a whole dim and along a sharded one (gathered first; the scans, flip/roll and topk
exchange instead: test_along_sharded.py checks their traffic), on (2), (4) and (2, 2)
meshes with even and uneven sizes, Partial inputs through the linear ops, forward and gradients.
Cases whose backward reaches an op with no rule yet say so and check the forward only."""

import torch
import torch.nn.functional as F

from hypershard.testing import Case, Input, assert_all_passed, in_distributed_run, run_cases
from hypershard.testing.spec import randint

M2 = ((2,), ("dp",))
M4 = ((4,), ("tp",))
M22 = ((2, 2), ("dp", "tp"))


def spd(shape, dtype, generator):
    """Symmetric positive definite matrices (cholesky, eigh)."""
    a = torch.randn(shape, generator=generator, dtype=torch.float64)
    return (a @ a.transpose(-1, -2) + shape[-1] * torch.eye(shape[-1], dtype=torch.float64)).to(dtype)


def setitem_dim1(a, i, v):
    """b[:, i] = v on a copy: index_put_ with a None index and a broadcast value."""
    b = a.clone()
    b[:, i] = v
    return b


def along_cases():
    cases = []
    S0, S1, S01 = ["S(0)"], ["S(1)"], ["S(0)", "S(1)"]

    def add(name, fn, shape, placements, mesh=M2, check_grad=True, init=None):
        cases.append(Case(name, fn, [Input(shape, placements=placements, init=init)], mesh, check_grad=check_grad))

    for mesh, place, batch, tag in ((M2, S0, S0, "2"), (M4, S1, S0, "4"), (M22, S01, ["S(0)", "S(0)"], "2x2")):
        # (5, 7): uneven on every mesh; dim 1 is whole on (2), sharded on (4) and (2, 2)
        add(f"cumsum_dim1_{tag}", lambda x: torch.cumsum(x, 1), (5, 7), place, mesh)
        add(f"cumsum_dim0_{tag}", lambda x: torch.cumsum(x, 0), (5, 7), place, mesh)
        add(f"cumprod_{tag}", lambda x: torch.cumprod(x, 1), (5, 7), place, mesh)
        add(f"logcumsumexp_{tag}", lambda x: torch.logcumsumexp(x, 1), (5, 7), place, mesh)
        add(f"flip_{tag}", lambda x: torch.flip(x, [0, 1]), (5, 7), place, mesh)
        add(f"roll_{tag}", lambda x: torch.roll(x, (2, -3), (0, 1)), (5, 7), place, mesh)
        add(f"roll_flat_{tag}", lambda x: torch.roll(x, 4), (5, 7), place, mesh)
        add(f"logsumexp_{tag}", lambda x: torch.logsumexp(x, 1), (5, 7), place, mesh)
        add(f"nansum_{tag}", lambda x: torch.nansum(x, 1), (5, 7), place, mesh)
        add(f"prod_dim_{tag}", lambda x: torch.prod(x, 1), (5, 7), place, mesh)
        # prod's backward over every element finds zeros with nonzero (data-dependent: no rule yet)
        add(f"prod_all_{tag}", lambda x: torch.prod(x), (5, 7), place, mesh, check_grad=False)
        add(f"var_mean_{tag}", lambda x: torch.var_mean(x, 1), (5, 7), place, mesh)
        add(f"std_mean_all_{tag}", lambda x: torch.std_mean(x), (5, 7), place, mesh)
        add(f"norm_dim_{tag}", lambda x: torch.norm(x, 3, dim=1), (5, 7), place, mesh)
        # value-selecting ops: their backward is value_selecting_reduction_backward's kernel
        add(f"sort_{tag}", lambda x: torch.sort(x, 1, descending=True), (5, 7), place, mesh)
        add(f"argsort_{tag}", lambda x: torch.argsort(x, 0), (5, 7), place, mesh, check_grad=False)
        add(f"topk_{tag}", lambda x: torch.topk(x, 3, 1), (5, 7), place, mesh)
        add(f"kthvalue_{tag}", lambda x: torch.kthvalue(x, 2, 1, keepdim=True), (5, 7), place, mesh, check_grad=False)
        add(f"median_dim_{tag}", lambda x: torch.median(x, 1), (5, 7), place, mesh, check_grad=False)
        add(f"mode_{tag}", lambda x: torch.mode(torch.round(x), 1), (5, 7), place, mesh, check_grad=False)
        add(f"cummax_{tag}", lambda x: torch.cummax(x, 1), (5, 7), place, mesh)
        add(f"aminmax_{tag}", lambda x: torch.aminmax(x, dim=0), (5, 7), place, mesh, check_grad=False)
        add(f"count_nonzero_{tag}", lambda x: torch.count_nonzero(torch.relu(x), dim=1), (5, 7), place, mesh,
            check_grad=False)
        # batched matrices: the batch dim sharded (5 over 4 and over 2 x 2: uneven), the matrix whole;
        # inv on 2 x 2 has a matrix dim sharded too (gathered first)
        add(f"inv_{tag}", lambda a: torch.linalg.inv(a), (5, 3, 3), place if tag == "2x2" else batch, mesh, init=spd)
        add(f"det_{tag}", lambda a: torch.linalg.det(a), (5, 3, 3), batch, mesh, init=spd)
        add(f"slogdet_{tag}", lambda a: torch.linalg.slogdet(a)[1], (5, 3, 3), batch, mesh, init=spd)
        add(f"cholesky_{tag}", lambda a: torch.linalg.cholesky(a), (5, 3, 3), batch, mesh, init=spd)
        cases.append(Case(f"solve_triangular_{tag}", lambda a, b: torch.linalg.solve_triangular(a, b, upper=False),
                          [Input((5, 3, 3), placements=batch, init=spd), Input((5, 3, 2), placements=batch)], mesh))
        add(f"diagonal_{tag}", lambda a: torch.diagonal(a, 1, 1, 2) * 2, (5, 4, 3), place if tag == "2x2" else batch,
            mesh)
        add(f"qr_{tag}", lambda a: torch.linalg.qr(a)[1].abs(), (5, 4, 3), batch, mesh)
        add(f"eigvalsh_{tag}", lambda a: torch.linalg.eigvalsh(a), (5, 3, 3), batch, mesh, init=spd)
        add(f"svdvals_{tag}", lambda a: torch.linalg.svdvals(a), (5, 4, 3), batch, mesh)
        # matrix_exp's backward is a composite that copies into a plain buffer it allocates
        add(f"matrix_exp_{tag}", lambda a: torch.linalg.matrix_exp(a * 0.3), (5, 3, 3), batch, mesh, check_grad=False)
        add(f"triu_{tag}", lambda a: torch.triu(a, 1) + torch.tril(a, -1) * 2, (5, 4, 3), batch, mesh)
        add(f"diag_embed_{tag}", lambda a: torch.diag_embed(a), (5, 3), batch, mesh)
    # tril / triu with the MATRIX dims sharded (rows, columns, both; uneven): each rank shifts the
    # diagonal by its block's GLOBAL row minus column offset; a Partial passes through; in place
    tri_layouts = ((M2, ["S(0)"], "rows2"), (M4, ["S(1)"], "cols4"), (M22, ["S(0)", "S(1)"], "both2x2"),
                   (M22, ["S(1)", "S(0)"], "both2x2_swapped"), (M2, ["P"], "partial"))
    for mesh, place, tag in tri_layouts:
        for k in (-2, 0, 3):
            add(f"tril_{k}_{tag}", lambda a, k=k: torch.tril(a, k) * 2, (7, 6), place, mesh)
            add(f"triu_{k}_{tag}", lambda a, k=k: torch.triu(a, k), (7, 6), place, mesh)
        cases.append(Case(f"tril_inplace_{tag}", lambda a: a.detach().clone().tril_(1),
                          [Input((7, 6), placements=place)], mesh, check_grad=False))
    add("triu_batched_2x2", lambda a: torch.triu(a, -1), (3, 5, 6), ["S(0)", "S(2)"], M22)
    # indexing along a dim: GLOBAL indices; sharded along that dim (gathered) and along another
    idx = lambda shape, high, place: Input(shape, torch.int64, placements=place, init=randint(0, high))  # noqa: E731
    for mesh, place, tag in ((M2, S0, "2"), (M4, S1, "4"), (M22, S01, "2x2")):
        for dim in (0, 1):
            cases += [
                Case(f"gather_dim{dim}_{tag}", lambda x, i, d=dim: torch.gather(x, d, i),
                     [Input((5, 7), placements=place), idx((5, 7), 5 if dim == 0 else 7, place)], mesh),
                Case(f"gather_short_index_dim{dim}_{tag}", lambda x, i, d=dim: torch.gather(x, d, i),
                     [Input((5, 7), placements=place), idx((3, 4), 5 if dim == 0 else 7, None)], mesh),
                Case(f"index_select_dim{dim}_{tag}", lambda x, i, d=dim: torch.index_select(x, d, i),
                     [Input((5, 7), placements=place), idx((6,), 5 if dim == 0 else 7, None)], mesh),
                Case(f"scatter_add_dim{dim}_{tag}", lambda x, i, y, d=dim: torch.scatter_add(x, d, i, y),
                     [Input((5, 7), placements=place), idx((5, 7), 5 if dim == 0 else 7, place),
                      Input((5, 7), placements=place)], mesh),
                Case(f"index_add_dim{dim}_{tag}", lambda x, i, y, d=dim: torch.index_add(x, d, i, y, alpha=2.0),
                     [Input((5, 7), placements=place), idx((4,), 5 if dim == 0 else 7, None),
                      Input((4, 7) if dim == 0 else (5, 4), placements=place)], mesh),
                Case(f"index_fill_dim{dim}_{tag}", lambda x, i, d=dim: torch.index_fill(x, d, i, -1.5),
                     [Input((5, 7), placements=place), idx((3,), 5 if dim == 0 else 7, None)], mesh),
            ]
        # in place, on a copy (a leaf cannot be written); unique indices so that the values are defined
        cases.append(Case(f"scatter_inplace_{tag}", lambda x, y: x.detach().clone().scatter_(
            1, torch.arange(7).flip(0).expand(5, 7).contiguous(), y), [Input((5, 7), placements=place),
                                                                      Input((5, 7), placements=place)],
            mesh, check_grad=False))
        # scatter_'s reduce forms (src and value), repeated GLOBAL indices accumulate
        cases.append(Case(f"scatter_inplace_reduce_{tag}", lambda x, y: x.detach().clone().scatter_(
            1, torch.tensor([[6, 0, 6, 3, 3, 1, 0]]).expand(5, 7).contiguous(), y, reduce="add"),
            [Input((5, 7), placements=place), Input((5, 7), placements=place)], mesh, check_grad=False))
        cases.append(Case(f"scatter_inplace_value_reduce_{tag}", lambda x: x.detach().clone().scatter_(
            0, torch.tensor([[4, 0, 4, 2, 1, 1, 3]]), 1.5, reduce="multiply"),
            [Input((5, 7), placements=place)], mesh, check_grad=False))
        cases.append(Case(f"index_copy_{tag}", lambda x, y: torch.index_copy(x, 0, torch.tensor([4, 0, 2]), y),
                          [Input((5, 7), placements=place), Input((3, 7), placements=place)], mesh))
    # advanced indexing: GLOBAL indices, adjacent and not, a 2-D index, writes with accumulate
    for mesh, place, tag in ((M2, ["S(0)"], "2"), (M4, ["S(1)"], "4"), (M22, ["S(0)", "S(2)"], "2x2")):
        x = lambda: Input((5, 6, 4), placements=place)  # noqa: E731
        cases += [
            Case(f"index_dim0_{tag}", lambda a, i: a[i], [x(), idx((7,), 5, None)], mesh),
            Case(f"index_dim1_2d_index_{tag}", lambda a, i: a[:, i], [x(), idx((2, 3), 6, None)], mesh),
            Case(f"index_not_adjacent_{tag}", lambda a, i, j: a[i, :, j], [x(), idx((3,), 5, None), idx((3,), 4, None)],
                 mesh),
            Case(f"index_put_accumulate_{tag}", lambda a, i, v: torch.index_put(a, (i,), v, accumulate=True),
                 [x(), idx((7,), 5, None), Input((7, 6, 4), placements=place)], mesh),
            Case(f"setitem_broadcast_value_{tag}", setitem_dim1, [x(), idx((3,), 6, None), Input((4,))], mesh),
        ]
    # indexing by ownership: self sharded along the indexed dim alone (uneven: 7 rows over 2 and 4
    # ranks, 4 ranks holding 2/2/2/1), indices GLOBAL and whole -- reads come out Partial(sum),
    # writes keep self's layout; repeated indices accumulate; the gradients run the writes
    rows = lambda: idx((9,), 7, None)  # noqa: E731
    for mesh, place, tag in ((M2, S0, "2"), (M4, S0, "4"), (M22, ["S(0)", "S(0)"], "2x2_nested")):
        for d, shape, sel in ((0, (7, 5), lambda: idx((3, 5), 7, None)), (1, (5, 7), lambda: idx((5, 3), 7, None))):
            sharded = ["S(1)"] * len(place) if d == 1 else place
            cases += [
                Case(f"owned_gather_dim{d}_{tag}", lambda x, i, d=d: torch.gather(x, d, i),
                     [Input(shape, placements=sharded), sel()], mesh),
                Case(f"owned_index_select_dim{d}_{tag}", lambda x, i, d=d: torch.index_select(x, d, i) * 2,
                     [Input(shape, placements=sharded), rows()], mesh),
                Case(f"owned_index_select_int32_dim{d}_{tag}", lambda x, i, d=d: torch.index_select(x, d, i),
                     [Input(shape, placements=sharded),
                      Input((9,), torch.int32, placements=None, init=randint(0, 7))], mesh),
                Case(f"owned_index_add_dim{d}_{tag}", lambda x, i, y, d=d: torch.index_add(x, d, i, y, alpha=0.5),
                     [Input(shape, placements=sharded), rows(), Input((9, 5) if d == 0 else (5, 9))], mesh),
                Case(f"owned_scatter_add_dim{d}_{tag}", lambda x, i, y, d=d: torch.scatter_add(x, d, i, y),
                     [Input(shape, placements=sharded), sel(), Input((3, 5) if d == 0 else (5, 3))], mesh),
                Case(f"owned_index_fill_dim{d}_{tag}", lambda x, d=d: torch.index_fill(x, d, torch.tensor([6, 0, 3]), 2.5),
                     [Input(shape, placements=sharded)], mesh),
                Case(f"owned_index_copy_inplace_dim{d}_{tag}",
                     lambda x, y, d=d: x.detach().clone().index_copy_(d, torch.tensor([6, 1, 3]), y),
                     [Input(shape, placements=sharded), Input((3, 5) if d == 0 else (5, 3))], mesh, check_grad=False),
                Case(f"owned_scatter_inplace_dim{d}_{tag}",
                     lambda x, y, d=d: x.detach().clone().scatter_(d, torch.tensor([[6, 0, 2]]).T if d == 0
                                                                   else torch.tensor([[6, 0, 2]]), y, reduce="add"),
                     [Input(shape, placements=sharded), Input((3, 1) if d == 0 else (1, 3))], mesh, check_grad=False),
            ]
    # ... and with another dim sharded too: the operands follow self there; in-place writes keep
    # self's placements
    def keeps_placements(fn):
        def run(x, *rest):
            y = fn(x.detach().clone(), *rest)
            if in_distributed_run():
                assert y.placements == x.placements, (y.placements, x.placements)
            return y
        return run
    for d in (0, 1):
        place = ["S(0)", "S(1)"] if d == 0 else ["S(1)", "S(0)"]
        cases += [
            Case(f"owned_gather_dim{d}_other_sharded", lambda x, i, d=d: torch.gather(x, d, i),
                 [Input((7, 5), placements=place), idx((7, 5), 7 if d == 0 else 5, None)], M22),
            Case(f"owned_index_select_dim{d}_other_sharded", lambda x, i, d=d: torch.index_select(x, d, i),
                 [Input((7, 5), placements=place), rows() if d == 0 else idx((9,), 5, None)], M22),
            Case(f"owned_index_add_inplace_dim{d}_other_sharded",
                 keeps_placements(lambda x, i, y, d=d: x.index_add_(d, i, y)),
                 [Input((7, 5), placements=place), rows() if d == 0 else idx((9,), 5, None),
                  Input((9, 5) if d == 0 else (7, 9))], M22, check_grad=False),
            Case(f"owned_scatter_inplace_dim{d}_other_sharded",
                 keeps_placements(lambda x, i, y, d=d: x.scatter_(d, i, y, reduce="add")),
                 [Input((7, 5), placements=place), idx((7, 5), 7 if d == 0 else 5, None), Input((7, 5))], M22,
                 check_grad=False),
        ]
    # accumulating writes keep Partial(sum) self and values (linear): the MoE token gather's backward
    # (zeros + index_put accumulate of a tensor-parallel Partial gradient); a whole self is filled
    for mesh, tag, self_place, values_place in ((M2, "values_partial", ["R"], ["P"]),
                                                 (M2, "both_partial", ["P"], ["P"]),
                                                 (M22, "values_partial_2x2", ["R", "R"], ["S(0)", "P"]),
                                                 (M22, "self_sharded_values_partial", ["R", "S(1)"], ["R", "P"])):
        cases.append(Case(f"index_put_accumulate_{tag}",
                          lambda a, i, v: torch.index_put(a, (i,), v, accumulate=True) * 2,
                          [Input((5, 6), placements=self_place), idx((7,), 5, None),
                           Input((7, 6), placements=values_place)], mesh))
    # index_add / scatter_add are linear in self and the added values: sum Partials stay Partial
    for tag, self_place, src_place in (("both", ["P"], ["P"]), ("source", ["R"], ["P"]), ("self", ["P"], ["S(0)"])):
        cases.append(Case(f"index_add_partial_{tag}", lambda a, i, v: torch.index_add(a, 0, i, v) * 2,
                          [Input((5, 6), placements=self_place), idx((7,), 5, None),
                           Input((7, 6), placements=src_place)], M2))
        cases.append(Case(f"index_add_inplace_partial_{tag}", lambda a, i, v: a.detach().clone().index_add_(1, i, v),
                          [Input((5, 6), placements=self_place), idx((4,), 6, None),
                           Input((5, 4), placements=src_place)], M2, check_grad=False))
        cases.append(Case(f"scatter_add_partial_{tag}", lambda a, i, v: torch.scatter_add(a, 1, i, v),
                          [Input((5, 6), placements=self_place), idx((5, 3), 6, None),
                           Input((5, 3), placements=src_place)], M2))
    cases.append(Case("gather_rows_partial_grad", lambda a, i, w: (a[i] @ w),
                      [Input((5, 6), placements=["R"]), idx((7,), 5, None), Input((6, 4), placements=["S(0)"])], M2))
    cases.append(Case("index_put_overwrite_partial_refused", lambda a, i, v: torch.index_put(a, (i,), v),
                      [Input((5, 6), placements=["R"]), idx((3,), 5, None), Input((3, 6), placements=["P"])], M2,
                      expect_error="a Partial operand of an indexed write"))
    # repeat (views.cpp), unfold windows, diag_embed with the diagonal elsewhere than last
    for mesh, place, tag in ((M2, S0, "2"), (M4, S1, "4"), (M22, S01, "2x2")):
        add(f"repeat_once_keeps_{tag}", lambda x: x.repeat(1, 1), (5, 7), place, mesh)
        add(f"repeat_leading_and_dim1_{tag}", lambda x: x.repeat(2, 1, 3), (5, 7), place, mesh)
        # unfold's backward (unfold_backward) has no rule yet
        add(f"unfold_{tag}", lambda x: x.unfold(1, 3, 2) * 2, (5, 7), place, mesh, check_grad=False)
        add(f"diag_embed_front_{tag}", lambda x: torch.diag_embed(x, 0, 0, 1), (4, 4), place, mesh)
    # Fourier transforms along their dims (the transformed dims whole, the others keep their
    # sharding; linear: a Partial passes), view_as_real, index_reduce, squeeze_ in place
    for mesh, place, tag in ((M2, S0, "2"), (M2, ["S(1)"], "dim1_2"), (M22, ["S(0)", "S(2)"], "2x2"), (M2, ["P"], "P")):
        add(f"fft_dim1_{tag}", lambda x: torch.view_as_real(torch.fft.fft(x, dim=1)), (5, 6, 4), place, mesh)
        add(f"rfft2_{tag}", lambda x: torch.view_as_real(torch.fft.rfft2(x)), (5, 6, 4), place, mesh)
        add(f"irfft_{tag}", lambda x: torch.fft.irfft(torch.fft.rfft(x, dim=2), n=4, dim=2), (5, 6, 4), place, mesh)
        add(f"squeeze_inplace_{tag}", lambda x: x.detach().clone().unsqueeze(1).squeeze_(1) * 2, (5, 6, 4), place,
            mesh, check_grad=False)
        if tag != "P":
            cases.append(Case(f"index_reduce_amax_{tag}", lambda x, y: x.index_reduce(0, torch.tensor([0, 4, 4, 1]), y,
                                                                                    "amax"),
                              [Input((5, 6, 4), placements=place), Input((4, 6, 4))], mesh))
    # 2-d pooling (1-d pools reach it through a unsqueezed dim): batch and channels keep their
    # sharding, the spatial dims are whole; batched linear algebra; cross along a dim
    for mesh, place, tag in ((M2, S0, "2"), (M2, ["S(1)"], "channels_2"), (M22, ["S(0)", "S(1)"], "2x2")):
        add(f"avg_pool2d_{tag}", lambda x: F.avg_pool2d(x, 2, padding=1), (3, 4, 5, 6), place, mesh)
        add(f"adaptive_avg_pool1d_{tag}", lambda x: F.adaptive_avg_pool1d(x, 3), (3, 4, 7), place, mesh)
        add(f"max_pool2d_{tag}", lambda x: F.max_pool2d(x, 2), (3, 4, 5, 6), place, mesh)
        add(f"adaptive_max_pool2d_{tag}", lambda x: F.adaptive_max_pool2d(x, (2, 3)), (3, 4, 5, 6), place, mesh)
    for mesh, batch, tag in ((M2, S0, "2"), (M22, ["S(0)", "R"], "2x2")):
        add(f"cholesky_solve_{tag}", lambda a: torch.cholesky_solve(a[..., :2], torch.linalg.cholesky(a)), (5, 3, 3),
            batch, mesh, init=spd)
        add(f"cholesky_inverse_{tag}", lambda a: torch.cholesky_inverse(torch.linalg.cholesky(a)), (5, 3, 3), batch,
            mesh, init=spd)
        add(f"linalg_solve_{tag}", lambda a: torch.linalg.solve(a, a[..., :1]), (5, 3, 3), batch, mesh, init=spd)
        add(f"eigvals_{tag}", lambda a: torch.linalg.eigvals(a).real, (5, 3, 3), batch, mesh, init=spd, check_grad=False)
        add(f"triangular_solve_{tag}", lambda a: torch.triangular_solve(a[..., :2], torch.linalg.cholesky(a),
                                                                         upper=False)[0], (5, 3, 3), batch, mesh, init=spd)
        add(f"lu_unpack_{tag}", lambda a: torch.cat(torch.lu_unpack(*torch.linalg.lu_factor(a)), -1), (5, 3, 3), batch,
            mesh, init=spd)
        add(f"cross_{tag}", lambda a: torch.linalg.cross(a, a.flip(0) * 2, dim=2), (5, 4, 3), batch, mesh)
    # Partial through the linear ones
    for name, fn in (("cumsum", lambda x: torch.cumsum(x, 0)), ("flip", lambda x: torch.flip(x, [1])),
                     ("roll", lambda x: torch.roll(x, 1, 0))):
        add(f"{name}_partial", fn, (5, 7), ["P"], M2)
    return cases


def test_along_dims_match_one_device():
    assert_all_passed(run_cases(along_cases(), timeout=900))
