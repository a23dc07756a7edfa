"""Level0: ops whose result size depends on the data (nonzero and what decomposes to it --
argwhere, the one-argument where --, masked_select and its backward masked_scatter_,
_is_all_true, repeat_interleave's counts, masked_scatter and its backward; linspace/logspace with
tensor bounds, whose size is `steps` but whose bounds are data) on real
meshes in strict mode, against one device: the inputs are gathered, the result is Replicate with
GLOBAL coordinates, its shape taken from the computed result (the same on every rank)."""

import torch

from hypershard.testing import Case, Input, assert_all_passed, run_cases

M2 = ((2,), ("dp",))
M22 = ((2, 2), ("dp", "tp"))


def cases():
    out = []
    for mesh, placements, tag in ((M2, ["S(0)"], "rows"), (M2, ["S(1)"], "cols"), (M22, ["S(0)", "S(1)"], "2x2"),
                                  (M2, ["R"], "replicate")):
        # 7 x 5: uneven rows on both meshes
        def flags(shape=(7, 5), grad=False):
            return Input(shape, placements=placements, requires_grad=grad)
        out += [
            Case(f"nonzero_{tag}", lambda x: torch.nonzero(x > 0), [flags()], mesh),
            Case(f"where_one_arg_{tag}", lambda x: torch.stack(torch.where(x > 0)), [flags()], mesh),
            Case(f"argwhere_{tag}", lambda x: torch.argwhere(x < 0), [flags()], mesh),
            Case(f"masked_select_{tag}", lambda x: torch.masked_select(x, x > 0.3) * 2, [flags(grad=True)], mesh),
            Case(f"nonzero_none_{tag}", lambda x: torch.nonzero(x > 100), [flags()], mesh),
            Case(f"is_all_true_{tag}", lambda x: torch._is_all_true(x > -100) * x.sum(), [flags(grad=True)], mesh),
            Case(f"repeat_interleave_counts_{tag}", lambda x: torch.repeat_interleave((x > 0).sum(1)), [flags()], mesh),
            Case(f"masked_scatter_grad_{tag}", lambda x, y: x.masked_scatter(x > 0, y * 3),
                 [flags(grad=True), Input((35,))], mesh),
            # bounds that are tensors (a sum and a max of the input: a Partial and a Replicate
            # 0-d on a sharded input): read whole, `steps` values on every rank
            Case(f"linspace_tensor_bounds_{tag}", lambda x: torch.linspace(x.sum(), x.amax(), 6) + x.mean(),
                 [flags(grad=True)], mesh, check_grad=False),
            Case(f"logspace_tensor_start_{tag}", lambda x: torch.logspace(x.mean(), 2.0, 5, base=2.0), [flags()], mesh),
        ]
    return out


def test_data_dependent_sizes_match_one_device():
    assert_all_passed(run_cases(cases(), timeout=300))
