"""Level0: 3-d and fractional pools, max_unpool, grid sampling and unfold/fold on real meshes
against one device, strict mode, forward and gradients (csrc/ops/spatial.cpp).

Batch- and channel-sharded inputs keep their sharding (checked on the distributed call where it
matters: the result's placements are the input's); a sharded spatial dim is gathered. Meshes
(2), (4), (2, 2); uneven sizes (5 samples over 2 and 4 ranks, 3 channels over 4 ranks: one
rank's block is empty), unbatched inputs, Partial inputs through the linear ops. grid_sample:
channel-sharded input (grad_grid Partial over the channel axis), output positions sharded in the
grid (grad_input Partial over that axis), both on a 2-d mesh.

Tolerances: the pools, unpooling and unfold run torch's kernels on whole planes (the same
arithmetic as one device; their gradients add the same terms). grid_sample's grad_grid adds the
channels' terms in per-rank parts, grad_input the output positions' (float32 defaults cover a
few reordered additions); fold sums the overlaps in torch's order."""

import torch
import torch.nn.functional as F

from hypershard.testing import Case, Input, assert_all_passed, run_cases
from hypershard.testing.spec import uniform

M2 = ((2,), ("dp",))
M4 = ((4,), ("tp",))
M22 = ((2, 2), ("dp", "tp"))


def keeps(fn, index=0):
    """The distributed call, asserting the result keeps input `index`'s placements."""

    def run(*args):
        out = fn(*args)
        first = out[0] if isinstance(out, tuple) else out
        if tuple(first.placements) != tuple(args[index].placements):
            raise AssertionError(f"placements {first.placements}, expected {args[index].placements}")
        return out
    return run


def leading_cases(name, fn, shape, linear):
    """Batch, channels (uneven, one empty block), both, a gathered spatial dim, unbatched, and a
    Partial input where the op is linear."""
    n = len(shape)
    out = [
        Case(f"{name}_batch_2", fn, [Input(shape, placements=["S(0)"])], M2, dist_fn=keeps(fn)),
        Case(f"{name}_batch_4", fn, [Input(shape, placements=["S(0)"])], M4, dist_fn=keeps(fn)),
        Case(f"{name}_channel_4", fn, [Input(shape, placements=["S(1)"])], M4, dist_fn=keeps(fn)),
        Case(f"{name}_both_2x2", fn, [Input(shape, placements=["S(0)", "S(1)"])], M22, dist_fn=keeps(fn)),
        Case(f"{name}_spatial_2x2", fn, [Input(shape, placements=["S(1)", f"S({n - 1})"])], M22),
        Case(f"{name}_unbatched_4", fn, [Input(shape[1:], placements=["S(0)"])], M4, dist_fn=keeps(fn)),
    ]
    if linear:
        out.append(Case(f"{name}_partial_2x2", fn, [Input(shape, placements=["P", "S(1)"])], M22))
    return out


def pool_cases():
    out = []
    shape = (5, 3, 6, 5, 7)
    out += leading_cases("max_pool3d", lambda x: F.max_pool3d(x, 2, return_indices=True), shape, False)
    out += leading_cases("max_pool3d_pad", lambda x: F.max_pool3d(x, (3, 2, 2), stride=(2, 1, 2), padding=1,
                                                                  dilation=(1, 2, 1), ceil_mode=True), shape, False)
    out += leading_cases("avg_pool3d", lambda x: F.avg_pool3d(x, (2, 3, 2), stride=(1, 2, 2), padding=1,
                                                              ceil_mode=True, count_include_pad=False), shape, True)
    out += leading_cases("avg_pool3d_divisor", lambda x: F.avg_pool3d(x, 2, divisor_override=3), shape, True)
    out += leading_cases("adaptive_max_pool3d", lambda x: F.adaptive_max_pool3d(x, (3, 2, 4), return_indices=True),
                         shape, False)
    # 2-d pools on a 3-d spatial input through max_pool1d/2d's composites reach along_dims.cpp;
    # the 3-d area pool is resampling.cpp's; here the 1-d and 2-d unpooling
    for nd, size in ((1, (5, 3, 8)), (2, (5, 3, 6, 8)), (3, (5, 3, 4, 6, 4))):
        pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
        unpool = (F.max_unpool1d, F.max_unpool2d, F.max_unpool3d)[nd - 1]

        def fn(x, pool=pool, unpool=unpool, nd=nd):
            values, indices = pool(x, 2, return_indices=True)
            return unpool(values, indices, 2, output_size=x.shape[-nd:])
        out += leading_cases(f"max_unpool{nd}d", fn, size, False)  # (max pool: no Partial)
    # max_unpool's own inputs sharded: values and indices from one device, laid out alike
    x = torch.randn(5, 3, 6, 8, generator=torch.Generator().manual_seed(3))
    values, indices = F.max_pool2d(x, 2, return_indices=True)
    for placements, mesh, tag in ((["S(0)"], M2, "batch_2"), (["S(1)"], M4, "channel_4"),
                                  (["S(1)", "S(0)"], M22, "both_2x2"), (["P", "S(1)"], M22, "partial_2x2")):
        index_placements = [p if p != "P" else "R" for p in placements]
        out.append(Case(f"max_unpool2d_given_{tag}", lambda v, i: F.max_unpool2d(v, i, 2),
                        [Input(values.shape, placements=placements, init=values.clone()),
                         Input(indices.shape, torch.int64, placements=index_placements, init=indices.clone())], mesh))
    # fractional pools: random_samples [N, C, K] follow the input's batch and channels
    for nd, size in ((2, (5, 3, 9, 8)), (3, (5, 3, 7, 8, 6))):
        pool = F.fractional_max_pool2d if nd == 2 else F.fractional_max_pool3d
        kernel, osize = (2, (4, 3)) if nd == 2 else ((2, 2, 3), (3, 4, 2))
        fn = lambda x, s, p=pool, k=kernel, o=osize: p(x, k, output_size=o, _random_samples=s)  # noqa: E731
        samples = lambda n, c, k=nd: Input((n, c, k), requires_grad=False, init=uniform())  # noqa: E731
        for placements, mesh, tag in ((["S(0)"], M2, "batch_2"), (["S(1)"], M4, "channel_4"),
                                      (["S(0)", "S(1)"], M22, "both_2x2")):
            out.append(Case(f"fractional{nd}d_{tag}", fn, [Input(size, placements=placements), samples(5, 3)], mesh,
                            dist_fn=keeps(fn)))
            out.append(Case(f"fractional{nd}d_samples_too_{tag}", fn,
                            [Input(size, placements=placements),
                             Input((5, 3, nd), requires_grad=False, init=uniform(), placements=placements)], mesh))
        out.append(Case(f"fractional{nd}d_unbatched_4", fn, [Input(size[1:], placements=["S(0)"]), samples(1, 3)], M4))
        out.append(Case(f"fractional{nd}d_spatial_2", fn, [Input(size, placements=[f"S({nd + 1})"]), samples(5, 3)], M2))
    return out


def grid_cases():
    out = []
    grid_init = uniform(-1.1, 1.1)  # a little outside [-1, 1]: the padding modes matter
    for nd, in_shape, grid_shape in ((2, (5, 3, 6, 7), (5, 5, 6, 2)), (3, (3, 3, 4, 5, 3), (3, 5, 3, 4, 3))):
        modes = [("bilinear", "zeros", False), ("nearest", "border", True), ("bilinear", "reflection", True)]
        if nd == 2:
            modes.append(("bicubic", "zeros", True))
        for mode, padding, align in modes:
            fn = lambda x, g, m=mode, p=padding, a=align: F.grid_sample(x, g, mode=m, padding_mode=p,  # noqa: E731
                                                                      align_corners=a)
            t = f"grid{nd}d_{mode}_{padding}"
            layouts = [
                ("batch_2", ["S(0)"], ["S(0)"], M2),
                ("channel_4", ["S(1)"], ["R"], M4),           # 3 channels over 4: grad_grid Partial
                ("positions_4", ["R"], ["S(1)"], M4),         # 5 rows of positions: grad_input Partial
                ("batch_channel_2x2", ["S(0)", "S(1)"], ["S(0)", "R"], M22),
                ("channel_positions_2x2", ["S(1)", "R"], ["R", f"S({nd})"], M22),
                ("spatial_2", [f"S({nd + 1})"], ["R"], M2),   # a sharded input plane: gathered
                ("partial_2x2", ["P", "S(1)"], ["R", "R"], M22),
            ]
            for tag, xp, gp, mesh in layouts:
                dist = keeps(fn) if tag in ("batch_2", "channel_4", "batch_channel_2x2") else None
                out.append(Case(f"{t}_{tag}", fn, [Input(in_shape, placements=xp),
                                                   Input(grid_shape, placements=gp, init=grid_init)], mesh,
                                dist_fn=dist))
    return out


def unfold_cases():
    out = []
    unfold = lambda x: F.unfold(x, (2, 3), padding=1, stride=(1, 2))  # noqa: E731
    fold = lambda x: F.fold(x, (6, 7), (2, 3), padding=1, stride=(1, 2))  # noqa: E731
    L = 7 * 4  # (6 + 2 - 2 + 1) x ((7 + 2 - 3) // 2 + 1)
    for name, fn, shape in (("unfold", unfold, (5, 4, 6, 7)), ("fold", fold, (5, 4 * 6, L))):
        out.append(Case(f"{name}_batch_2", fn, [Input(shape, placements=["S(0)"])], M2, dist_fn=keeps(fn)))
        out.append(Case(f"{name}_batch_4", fn, [Input(shape, placements=["S(0)"])], M4, dist_fn=keeps(fn)))
        # 4 channels over 4 / 2 x 2 ranks: channel blocks are whole row blocks, kept
        out.append(Case(f"{name}_channel_4", fn, [Input(shape, placements=["S(1)"])], M4, dist_fn=keeps(fn)))
        out.append(Case(f"{name}_both_2x2", fn, [Input(shape, placements=["S(0)", "S(1)"])], M22,
                        dist_fn=keeps(fn)))
        out.append(Case(f"{name}_channel_twice_2x2", fn, [Input(shape, placements=["S(1)", "S(1)"])], M22,
                        dist_fn=keeps(fn)))
        out.append(Case(f"{name}_partial_2x2", fn, [Input(shape, placements=["P", "S(0)"])], M22))
        out.append(Case(f"{name}_last_2", fn, [Input(shape, placements=[f"S({len(shape) - 1})"])], M2))
        out.append(Case(f"{name}_unbatched_2", fn, [Input(shape[1:], placements=["S(0)"])], M2))
    # 3 channels over 2 ranks do not split the 3 * 6 rows at channel boundaries: gathered
    out.append(Case("unfold_channel_uneven_2", unfold, [Input((5, 3, 6, 7), placements=["S(1)"])], M2))
    out.append(Case("fold_channel_uneven_2", fold, [Input((5, 3 * 6, L), placements=["S(1)"])], M2))
    return out


def test_pools_match_one_device():
    assert_all_passed(run_cases(pool_cases(), timeout=900))


def test_grid_sample_matches_one_device():
    assert_all_passed(run_cases(grid_cases(), timeout=900))


def test_unfold_fold_match_one_device():
    assert_all_passed(run_cases(unfold_cases(), timeout=600))
