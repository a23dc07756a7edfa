"""Level0: torch.cdist, F.pdist and F.bilinear (_trilinear) on real meshes against one device,
strict mode, forward and gradients (csrc/ops/pairwise.cpp).

cdist: the batch sharded alike, x1's rows and x2's rows keep their sharding (the result sharded
on dims -2 and -1; checked on the distributed call), the feature dim gathered; p in 2, 1, inf
and 0.5; more than 25 rows (torch's matrix-product algorithm, which a block of fewer rows must
still use). pdist: the input whole. bilinear: batch and out-features keep their sharding, the
in-features (summed) are gathered. Meshes (2), (4), (2, 2); uneven sizes (7 rows over 4 ranks).

Tolerances: float32 defaults. cdist's backward adds each rank's columns' terms as parts of a
Partial(sum) (a few reordered additions); the rest runs torch's kernels on whole feature dims."""

import torch
import torch.nn.functional as F

from hypershard.testing import Case, Input, assert_all_passed, run_cases

M2 = ((2,), ("dp",))
M4 = ((4,), ("tp",))
M22 = ((2, 2), ("dp", "tp"))


def placed(fn, expected):
    """The distributed call, asserting the result's placements."""

    def run(*args):
        out = fn(*args)
        if [str(p) for p in out.placements] != expected:
            raise AssertionError(f"placements {out.placements}, expected {expected}")
        return out
    return run


def cdist_cases():
    out = []
    for p in (2.0, 1.0, float("inf"), 0.5):
        fn = lambda a, b, p=p: torch.cdist(a, b, p=p)  # noqa: E731
        t = f"cdist_p{p:g}"
        for tag, pa, pb, mesh, expected in (
                ("rows1_4", ["S(1)"], ["R"], M4, ["Shard(dim=1)"]),
                ("rows2_2", ["R"], ["S(1)"], M2, ["Shard(dim=2)"]),
                ("batch_2", ["S(0)"], ["S(0)"], M2, ["Shard(dim=0)"]),
                ("batch_one_side_2", ["S(0)"], ["R"], M2, ["Shard(dim=0)"]),
                ("both_rows_2x2", ["S(1)", "R"], ["R", "S(1)"], M22, ["Shard(dim=1)", "Shard(dim=2)"]),
                ("same_axis_2x2", ["S(0)", "S(1)"], ["S(0)", "S(1)"], M22, ["Shard(dim=0)", "Shard(dim=1)"]),
                ("features_2", ["S(2)"], ["S(2)"], M2, None)):
            dist = placed(fn, expected) if expected else None
            out.append(Case(f"{t}_{tag}", fn, [Input((3, 7, 5), placements=pa), Input((3, 6, 5), placements=pb)],
                            mesh, dist_fn=dist))
    # unbatched, and more than 25 rows through _cdist_forward (no mm for p = 2 by request; the
    # direct aten call with compute_mode None must use the GLOBAL row counts' choice)
    out.append(Case("cdist_unbatched_4", torch.cdist, [Input((7, 5), placements=["S(0)"]), Input((6, 5))], M4))
    out.append(Case("cdist_large_donot_mm_4",
                    lambda a, b: torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist"),
                    [Input((2, 30, 4), placements=["S(1)"]), Input((2, 27, 4))], M4))
    out.append(Case("cdist_forward_large_4", lambda a, b: torch.ops.aten._cdist_forward(a, b, 2.0, None),
                    [Input((2, 30, 4), placements=["S(1)"]), Input((2, 27, 4), placements=["R"])], M4,
                    check_grad=False))
    return out


def other_cases():
    out = []
    for tag, placements, mesh in (("rows_2", ["S(0)"], M2), ("cols_2", ["S(1)"], M2), ("rows_4", ["S(0)"], M4)):
        out.append(Case(f"pdist_{tag}", F.pdist, [Input((7, 5), placements=placements)], mesh))
    out.append(Case("pdist_p1_2", lambda x: F.pdist(x, p=1.0), [Input((6, 4), placements=["S(0)"])], M2))
    fn = F.bilinear
    shapes = ((5, 4), (5, 3), (6, 4, 3), (6,))
    for tag, layouts, mesh, expected in (
            ("batch_2", (["S(0)"], ["S(0)"], ["R"], ["R"]), M2, ["Shard(dim=0)"]),
            ("batch_one_side_4", (["S(0)"], ["R"], ["R"], ["R"]), M4, ["Shard(dim=0)"]),
            ("out_features_2", (["R"], ["R"], ["S(0)"], ["S(0)"]), M2, ["Shard(dim=1)"]),
            ("batch_out_2x2", (["S(0)", "R"], ["S(0)", "R"], ["R", "S(0)"], ["R", "S(0)"]), M22,
             ["Shard(dim=0)", "Shard(dim=1)"]),
            ("in_features_2", (["S(1)"], ["R"], ["S(1)"], ["R"]), M2, None)):
        inputs = [Input(s, placements=p) for s, p in zip(shapes, layouts)]
        out.append(Case(f"bilinear_{tag}", fn, inputs, mesh, dist_fn=placed(fn, expected) if expected else None))
    # batched leading dims (3, 5) with the second sharded unevenly
    out.append(Case("bilinear_leading_4", fn, [Input((3, 5, 4), placements=["S(1)"]), Input((3, 5, 3)),
                                               Input((6, 4, 3)), Input((6,))], M4))
    return out


def test_cdist_matches_one_device():
    assert_all_passed(run_cases(cdist_cases(), timeout=900))


def test_pdist_and_bilinear_match_one_device():
    assert_all_passed(run_cases(other_cases(), timeout=600))
