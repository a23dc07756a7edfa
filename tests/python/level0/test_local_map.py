"""Level0: user code on local shards -- hs.local_map regions and hs.DFunction -- on real meshes,
forward AND gradients against one device (where the same function runs on whole tensors).

- a region over a sequence sharded on its axis (per-token code), 1-D and 2-D meshes;
- a region whose input arrives in another layout (redistributed on entry, gradient transposed);
- a region returning per-rank partial sums declared Partial (a contraction over a sharded dim);
- a DFunction with a hand-written backward, and one with two outputs;
- the debug check: a region that returns per-rank partial sums but declares them Replicate is
  refused on every rank in debug mode (without the check the wrong values would pass silently);
- a refused layout with redistribute_inputs=False;
- a region inside hs.compile (a graph break: it runs eagerly on the real DTensors);
- a region as the forward of a fully_shard module (its weight gathered before the region).
"""

import torch

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, debug_checked, replicated, run_cases

CP2 = ((2,), ("cp",))
DP_CP = ((2, 2), ("dp", "cp"))


def per_token(x, w):
    return torch.nn.functional.gelu(x) * w + x.pow(2)


@hs.local_map(out_placements=["S(1)"], in_placements=(["S(1)"], ["R"]))
def per_token_region(x, w):
    return per_token(x, w)


@hs.local_map(out_placements=["S(0)", "S(1)"], in_placements=(["S(0)", "S(1)"], ["R", "R"]))
def per_token_region_2d(x, w):
    return per_token(x, w)


def region_2d(x, w):
    return per_token_region_2d(x, w).sum(dim=-1)


def region(x, w):
    return per_token_region(x, w).sum(dim=-1)


@hs.local_map(out_placements=["P"], in_placements=(["S(1)"], ["S(0)"]))
def contraction(x, w):  # x [m, k] and w [k, n] both sharded on k: this rank's partial product
    return x @ w


def partial_region(x, w):
    return replicated(contraction(x, w)).tanh()


class SiLU(hs.DFunction):
    in_placements = (["S(0)"],)
    out_placements = ["S(0)"]

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


class SplitScale(hs.DFunction):
    in_placements = (["S(0)"], ["R"])
    out_placements = (["S(0)"], ["S(0)"])

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x, scale)
        return x * scale, x.exp()

    @staticmethod
    def backward(ctx, g1, g2):
        x, scale = ctx.saved_tensors
        return g1 * scale + g2 * x.exp(), (g1 * x).sum(dim=0)


def two_outputs(x, scale):
    a, b = SplitScale.apply(x, scale)
    return a + b


@hs.local_map(out_placements=["R"], in_placements=(["S(1)"], ["S(0)"]), name="mislabelled_contraction")
def mislabelled(x, w):  # the partial product of each rank, wrongly declared Replicate
    return x @ w


@hs.local_map(out_placements=["S(1)"], in_placements=(["S(1)"], ["R"]), redistribute_inputs=False)
def strict_region(x, w):
    return per_token(x, w)


@hs.local_map(out_placements=["S(0)"], in_placements=(["S(0)"], ["R"]))
def rows_region(x, w):
    return per_token(x, w)


class RegionNet(torch.nn.Module):
    """A module whose forward is a region: under fully_shard its weight is gathered before the
    forward (Replicate on dp), as the region declares."""

    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w.detach().clone())

    def forward(self, x):
        return rows_region(x, self.w).sum(dim=-1)


def region_net(x, w):
    return RegionNet(w)(x)


def region_net_fully_shard(x, w):
    net = RegionNet(w)
    hs.fully_shard(net, x.device_mesh, dp_axis="dp")
    out = net(x)
    assert isinstance(net.w, hs.DTensor) and net.w.placements[0].is_shard()  # resharded after forward
    return out


def compiled(fn):
    """dist_fn: fn under hs.compile (aot_eager): the region is a graph break that runs eagerly on the
    real DTensors; forward and gradients must still equal one device."""

    def run(*inputs):
        import torch._dynamo

        torch._dynamo.reset()
        return hs.compile(fn, backend="aot_eager")(*inputs)

    return run


def cases():
    seq = Input((2, 8, 6), placements=["S(1)"])
    seq_elsewhere = Input((2, 8, 6), placements=["S(0)"])  # redistributed on entry
    w6 = Input((6,), placements=["R"])
    k_sharded = [Input((4, 6), placements=["S(1)"]), Input((6, 5), placements=["S(0)"])]
    return [
        Case("region_sequence_sharded", region, [seq, w6], CP2),
        Case("region_input_redistributed", region, [seq_elsewhere, w6], CP2),
        # the region is written per axis name: on an expert-parallel axis it is the same algebra
        Case("region_on_ep_axis", region, [seq, w6], ((2,), ("ep",))),
        Case("region_under_hs_compile", region, [seq, w6], CP2, dist_fn=compiled(region)),
        Case(
            "region_in_fully_shard_module",
            region_net,
            [Input((4, 6), placements=["S(0)"]), Input((6,), placements=["R"], requires_grad=False)],
            ((2,), ("dp",)),
            dist_fn=region_net_fully_shard,
        ),
        Case(
            "region_2d_mesh",
            region_2d,
            [Input((4, 8, 6), placements=["S(0)", "S(1)"]), Input((6,), placements=["R", "R"])],
            DP_CP,
        ),
        Case("region_partial_output", partial_region, k_sharded, CP2),
        Case("dfunction_silu", SiLU.apply, [Input((6, 5), placements=["S(0)"])], CP2),
        Case("dfunction_silu_redistributed", SiLU.apply, [Input((6, 5), placements=["S(1)"])], CP2),
        Case(
            "dfunction_two_outputs",
            two_outputs,
            [Input((6, 5), placements=["S(0)"]), Input((5,), placements=["R"])],
            CP2,
        ),
        Case(
            "debug_check_catches_wrong_replicate",
            lambda x, w: x @ w,
            k_sharded,
            CP2,
            dist_fn=debug_checked(mislabelled),
            expect_error="local_map(mislabelled_contraction): output 0 is declared Replicate on mesh axis 'cp'",
        ),
        Case(
            "refused_without_redistribution",
            per_token,
            [seq_elsewhere, w6],
            CP2,
            dist_fn=strict_region,
            expect_error="argument 0 has layout",
        ),
    ]


def test_local_map_regions():
    assert_all_passed(run_cases(cases(), world_size=4, timeout=240))


def test_wrong_declaration_passes_without_debug_checks():
    """The planted fault the debug check exists for: without it, the mislabelled region's output
    differs from one device -- the comparison catches it, so the check is not what makes it fail
    silently in user code."""
    results = run_cases([Case("mislabelled_unchecked", lambda x, w: x @ w,
                              [Input((4, 6), placements=["S(1)"]), Input((6, 5), placements=["S(0)"])],
                              CP2, dist_fn=mislabelled, check_grad=False)], world_size=4, timeout=240)
    assert not results["mislabelled_unchecked"].passed
