"""Level0: the assembly family (csrc/ops/assembly.cpp: select/slice/diagonal_scatter, block_diag,
_chunk_cat) and the *_copy forms of the slicing views (views.cpp: t_copy, narrow_copy,
select_copy, slice_copy, split_copy, split_with_sizes_copy, unbind_copy, unfold_copy,
as_strided_copy) on real meshes against one device, strict mode, forward and gradients.

select_scatter keeps a sharded dim sharded (the rank holding the GLOBAL index writes: checked by
the output's placements); the other scattered dims are made whole. Meshes (2), (4), (2, 2); uneven
sizes (5 and 7 over 2 and 4 ranks, an empty block on 4 ranks); GLOBAL indices at the first, a
middle and the last block, negative ones; Partial operands (linear: they pass).

Tolerances: every op here copies elements (exact); the gradients copy or add at most two cotangent
values per position (float32 defaults)."""

import torch

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, run_cases

M2 = ((2,), ("dp",))
M4 = ((4,), ("tp",))
M22 = ((2, 2), ("dp", "tp"))


def keeps_placements(fn):
    """The distributed call, asserting the output keeps the first input's placements."""

    def run(x, *rest):
        out = fn(x, *rest)
        if tuple(out.placements) != tuple(x.placements):
            raise AssertionError(f"placements {out.placements}, expected the input's {x.placements}")
        return out
    return run


def scatter_cases():
    out = []
    # select_scatter along a sharded dim: (5, 7, 3), dim 0 over 2 ranks, dim 1 over 4 and (2, 2)
    for mesh, place, dim, tag in ((M2, ["S(0)"], 0, "2"), (M4, ["S(1)"], 1, "4"), (M22, ["S(0)", "S(1)"], 1, "2x2"),
                                  (M22, ["S(1)", "S(1)"], 1, "2x2_nested")):
        size = (5, 7, 3)[dim]
        src_shape = tuple(s for d, s in enumerate((5, 7, 3)) if d != dim)
        for index in (0, size // 2, size - 1, -2):
            fn = lambda x, s, d=dim, i=index: torch.select_scatter(x, s, d, i)  # noqa: E731
            out.append(Case(f"select_scatter_d{dim}_i{index}_{tag}".replace("-", "m"), fn,
                            [Input((5, 7, 3), placements=place), Input(src_shape)], mesh, dist_fn=keeps_placements(fn)))
        # along a whole dim (the sharded dims stay as they are, src sharded alike)
        fn = lambda x, s: torch.select_scatter(x, s, 2, 1)  # noqa: E731
        src_place = [p if p != "S(2)" else "R" for p in place]
        out.append(Case(f"select_scatter_whole_dim_{tag}", fn,
                        [Input((5, 7, 3), placements=place), Input((5, 7), placements=src_place)], mesh,
                        dist_fn=keeps_placements(fn)))
        # slice_scatter: dim made whole; the GLOBAL start/end/step
        for name, d, start, end, step in (("mid", dim, 1, 4, 1), ("step", dim, 0, None, 2), ("neg", dim, -3, None, 1),
                                          ("other_dim", 2, 1, 3, 1)):
            length = len(range(*slice(start, end, step).indices((5, 7, 3)[d])))
            src_shape = tuple(length if k == d else s for k, s in enumerate((5, 7, 3)))
            out.append(Case(f"slice_scatter_{name}_{tag}",
                            lambda x, s, d=d, a=start, b=end, c=step: torch.slice_scatter(x, s, d, a, b, c),
                            [Input((5, 7, 3), placements=place), Input(src_shape, placements=place)], mesh))
        # diagonal_scatter: (5, 7, 3) with the diagonal of dims 0, 1 at offsets 0, 2, -1
        for offset, length in ((0, 5), (2, 5), (-1, 4)):
            out.append(Case(f"diagonal_scatter_o{offset}_{tag}".replace("-", "m"),
                            lambda x, s, o=offset: torch.diagonal_scatter(x, s, o, 0, 1),
                            [Input((5, 7, 3), placements=place), Input((3, length))], mesh))
        out.append(Case(f"diagonal_scatter_batch_{tag}", lambda x, s: torch.diagonal_scatter(x, s, 1, 1, 2),
                        [Input((5, 7, 3), placements=["S(0)"] * len(place)), Input((5, 2), placements=["S(0)"] * len(place))],
                        mesh))
    # Partial operands: linear, so a sum Partial passes (a Replicate src is filled)
    out.append(Case("select_scatter_partial_2x2", lambda x, s: torch.select_scatter(x, s, 1, 3),
                    [Input((5, 7, 3), placements=["P", "S(1)"]), Input((5, 3))], M22))
    out.append(Case("slice_scatter_partial_2x2", lambda x, s: torch.slice_scatter(x, s, 1, 2, 5),
                    [Input((5, 7, 3), placements=["S(0)", "P"]), Input((5, 3, 3), placements=["S(0)", "P"])], M22))
    out.append(Case("diagonal_scatter_partial_src_2", lambda x, s: torch.diagonal_scatter(x, s),
                    [Input((5, 7)), Input((5,), placements=["P"])], M2))
    return out


def assembly_cases():
    out = []
    for mesh, place, tag in ((M2, ["S(0)"], "2"), (M4, ["S(1)"], "4"), (M22, ["S(0)", "S(1)"], "2x2")):
        out.append(Case(f"block_diag_{tag}", lambda a, b, c: torch.block_diag(a, b, c),
                        [Input((5, 7), placements=place), Input((3, 2), placements=place), Input((4,))], mesh))
        # _chunk_cat: the dims before dim are a batch that keeps its sharding
        out.append(Case(f"chunk_cat_dim1_{tag}", lambda a, b: torch._chunk_cat([a, b], 1, 3),
                        [Input((5, 7, 3), placements=place, requires_grad=False),
                         Input((5, 4), placements=place, requires_grad=False)], mesh))
        out.append(Case(f"chunk_cat_dim0_{tag}", lambda a, b: torch._chunk_cat([a, b], 0, 2),
                        [Input((5, 7), placements=place, requires_grad=False),
                         Input((3,), placements=["S(0)"] * len(place), requires_grad=False)], mesh))
    out.append(Case("block_diag_partial_2", lambda a, b: torch.block_diag(a, b),
                    [Input((5, 7), placements=["P"]), Input((3, 2))], M2))
    return out


def copy_cases():
    out = []
    for mesh, place, tag in ((M2, ["S(0)"], "2"), (M4, ["S(1)"], "4"), (M22, ["S(0)", "S(1)"], "2x2")):
        def add(name, fn, shape=(5, 7, 3), **kw):
            out.append(Case(f"{name}_{tag}", fn, [Input(shape, placements=place)], mesh, **kw))

        add("t_copy", torch.t_copy, shape=(5, 7))
        add("narrow_copy_dim1", lambda x: torch.narrow_copy(x, 1, 2, 4))
        add("narrow_copy_neg_start", lambda x: torch.narrow_copy(x, 0, -3, 2))
        add("select_copy", lambda x: torch.select_copy(x, 1, 6))
        add("slice_copy", lambda x: torch.slice_copy(x, 1, 1, 6, 2))
        add("split_copy", lambda x: torch.split_copy(x, 3, 1))
        add("split_with_sizes_copy", lambda x: torch.split_with_sizes_copy(x, [1, 4, 0, 2], 1))
        add("unbind_copy", lambda x: torch.unbind_copy(x, 0))
        add("unfold_copy", lambda x: torch.unfold_copy(x, 1, 3, 2))
    # as_strided_copy: a tensor with no sharded dim only (a house error otherwise)
    out.append(Case("as_strided_copy_replicate_2", lambda x: torch.as_strided_copy(x, (4, 3), (2, 5), 1),
                    [Input((5, 7))], M2))
    out.append(Case("as_strided_copy_partial_2x2", lambda x: torch.as_strided_copy(x, (4, 3), (2, 5), 1),
                    [Input((5, 7), placements=["P", "R"])], M22))
    out.append(Case("as_strided_copy_sharded_refused_2", lambda x: torch.as_strided_copy(x, (4, 3), (2, 5), 1),
                    [Input((5, 7), placements=["S(0)"])], M2,
                    expect_error="as_strided on a sharded tensor cannot be mapped to the local shards"))
    return out


def test_scatters_match_one_device():
    assert_all_passed(run_cases(scatter_cases(), timeout=900))


def test_block_diag_and_chunk_cat_match_one_device():
    assert_all_passed(run_cases(assembly_cases(), timeout=600))


def test_view_copies_match_one_device():
    assert_all_passed(run_cases(copy_cases(), timeout=900))


def _local_select_scatter(x, s):
    """A planted fault: every rank writes src at the GLOBAL index of its own block."""
    local = torch.select_scatter(x.to_local(), s.full_tensor(), 0, 1)
    return hs.DTensor.from_local(local, x.device_mesh, x.placements)


def test_a_local_select_scatter_would_be_caught():
    case = Case("planted_local_select_scatter", lambda x, s: torch.select_scatter(x, s, 0, 1),
                [Input((5, 7), placements=["S(0)"]), Input((7,))], M2, dist_fn=_local_select_scatter,
                check_grad=False)
    assert not run_cases([case], timeout=300).ok, "the planted local select_scatter passed"
