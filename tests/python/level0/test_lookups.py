"""Level0: lookups (csrc/ops/lookups.cpp: searchsorted, bucketize, take -- the query keeps its
sharding, the table is read whole, GLOBAL positions for take) and bincount (reductions.cpp: local
counts into the GLOBAL number of bins, Partial(sum)) on real meshes against one device, strict
mode. bincount's length comes from the data: one rank's shard may hold no large value, so a
rank-local length would differ (the 4-rank cases put the maximum on one rank only)."""

import torch

from hypershard.testing import Case, Input, assert_all_passed, run_cases
from hypershard.testing.spec import randint

M2 = ((2,), ("dp",))
M4 = ((4,), ("tp",))
M22 = ((2, 2), ("dp", "tp"))
M222 = ((2, 2, 2), ("dp", "tp", "sp"))


def sorted_rows(shape, dtype, generator):
    return torch.randn(shape, generator=generator, dtype=dtype).sort(-1).values


def ints_with_one_large(shape, dtype, generator):
    """Small non-negative ints, and the largest value (17) only in the last position."""
    t = torch.randint(0, 5, shape, generator=generator).to(dtype)
    t[-1] = 17
    return t


def cases():
    out = []
    for mesh, place, tag in ((M2, ["S(0)"], "2"), (M4, ["S(1)"], "4"), (M22, ["S(0)", "S(1)"], "2x2"),
                             (M222, ["S(0)", "S(1)", "R"], "2x2x2")):
        q = Input((5, 7), placements=place, requires_grad=False)
        out += [
            Case(f"searchsorted_1d_{tag}", lambda s, v: torch.searchsorted(s, v),
                 [Input((9,), init=sorted_rows, requires_grad=False), q], mesh, check_grad=False),
            Case(f"searchsorted_right_rows_{tag}", lambda s, v: torch.searchsorted(s, v, right=True),
                 [Input((5, 6), init=sorted_rows, requires_grad=False), q], mesh, check_grad=False),
            Case(f"bucketize_{tag}", lambda v, b: torch.bucketize(v, b, out_int32=True),
                 [q, Input((6,), init=sorted_rows, requires_grad=False)], mesh, check_grad=False),
            Case(f"take_{tag}", lambda x, i: torch.take(x, i) * 2,
                 [Input((4, 6), placements=place[:1] + ["R"] * (len(place) - 1)),
                  Input((5, 7), torch.int64, placements=place, init=randint(0, 24))], mesh),
        ]
    for mesh, place, tag in ((M2, ["S(0)"], "2"), (M4, ["S(0)"], "4"), (M22, ["S(0)", "S(0)"], "2x2")):
        x = Input((13,), torch.int64, placements=place, init=ints_with_one_large, requires_grad=False)
        out += [
            Case(f"bincount_{tag}", lambda x: torch.bincount(x), [x], mesh, check_grad=False),
            Case(f"bincount_weights_minlength_{tag}", lambda x, w: torch.bincount(x, w, minlength=25),
                 [x, Input((13,), placements=place, requires_grad=False)], mesh, check_grad=False),
        ]
    out.append(Case("take_partial_2", lambda x, i: torch.take(x, i),
                    [Input((4, 6), placements=["P"]), Input((5,), torch.int64, init=randint(0, 24))], M2))
    return out


def test_lookups_match_one_device():
    assert_all_passed(run_cases(cases(), timeout=900))
