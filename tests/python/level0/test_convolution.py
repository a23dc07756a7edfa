"""Level0: convolutions (csrc/ops/convolution.cpp) on real meshes against one device, in strict mode,
forward and gradients: the batch dim sharded (even and uneven, 1-D and 2-D meshes), the channels
of a grouped or depthwise convolution sharded (each rank convolves its own groups, nothing sent;
a dense convolution's channels are gathered), a spatial dim sharded (a halo exchange: the output stays sharded
along it and each rank sends only the neighbouring positions its neighbours read), Qwen3.5's
causal depthwise conv1d, conv2d with bias and groups, strides, dilations and paddings, a
transposed conv1d (its sharded length is gathered). grad_weight / grad_bias come out
Partial(sum) over the batch and halo axes. A planted fault (each rank convolving its own block
with no halo) is caught."""

import torch.nn.functional as F

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, run_cases, traffic_checked

M2 = ((2,), ("dp",))
M4 = ((4,), ("dp",))
M22 = ((2, 2), ("dp", "tp"))
M4SP = ((4,), ("sp",))
M222 = ((2, 2, 2), ("dp", "tp", "sp"))


def causal_depthwise(x, w):
    """Qwen3.5's GatedDeltaNet short convolution: depthwise, padded on the left only."""
    k = w.shape[-1]
    return F.conv1d(x, w, padding=k - 1, groups=x.shape[1])[..., : x.shape[-1]]


def conv_cases():
    cases = []
    for mesh, place, tag in ((M2, ["S(0)"], "2"), (M4, ["S(0)"], "4"), (M22, ["S(0)", "S(0)"], "2x2"),
                             (M2, ["S(1)"], "channels"), (M2, ["S(2)"], "length")):
        cases += [
            Case(f"conv1d_depthwise_causal_{tag}", causal_depthwise,
                 [Input((5, 6, 9), placements=place), Input((6, 1, 4))], mesh),
            Case(f"conv1d_bias_stride_{tag}", lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1),
                 [Input((5, 6, 9), placements=place), Input((4, 6, 3)), Input((4,))], mesh),
            Case(f"conv_transpose1d_{tag}", lambda x, w: F.conv_transpose1d(x, w, stride=2),
                 [Input((5, 6, 9), placements=place), Input((6, 3, 3))], mesh),
        ]
    for mesh, place, tag in ((M2, ["S(0)"], "2"), (M22, ["S(0)", "R"], "2x2")):
        cases.append(Case(f"conv2d_groups_bias_{tag}", lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=2),
                          [Input((3, 4, 6, 5), placements=place), Input((6, 2, 3, 3)), Input((6,))], mesh))
    return cases


def halo_checked(fn, dim, reach):
    """The distributed call, checked on its second run: the output stays sharded along the halo
    dim `dim`, and this rank sends at most `reach` positions' slices plus the shift between the
    input's and the output's chunk boundaries (a gather would send the whole block to every other
    member)."""

    def check(inputs, out, sent):
        x, problems = inputs[0], []
        if len([p for p in out.placements if isinstance(p, hs.Shard) and p.dim == dim]) != 1:
            problems.append(f"output placements {out.placements}: not sharded along dim {dim}")
        local = x.to_local()
        slice_bytes = local.numel() // max(local.shape[dim], 1) * local.element_size()
        limit = (reach + abs(out.shape[dim] - x.shape[dim])) * slice_bytes
        if sent > limit:
            problems.append(f"sent {sent} bytes, at most {limit} expected")
        return problems
    return traffic_checked(fn, check)


def halo_cases():
    """A spatial dim sharded: conv1d/2d/3d, strides, dilations, paddings, empty output chunks."""
    cases = []

    def add(name, fn, inputs, mesh, dim, reach, atol=None):
        cases.append(Case(name, fn, inputs, mesh, dist_fn=halo_checked(fn, dim, reach), atol=atol))

    for mesh, place, tag in ((M2, ["S(2)"], "2"), (M4SP, ["S(2)"], "4"), (M22, ["S(0)", "S(2)"], "2x2"),
                             (M222, ["S(0)", "R", "S(2)"], "2x2x2")):
        x = lambda length=26: Input((3, 4, length), placements=place)  # noqa: E731
        add(f"halo_conv1d_same_{tag}", lambda x, w, b: F.conv1d(x, w, b, padding=1),
            [x(), Input((5, 4, 3)), Input((5,))], mesh, 2, 2)
        add(f"halo_conv1d_depthwise_padded_{tag}", lambda x, w: F.conv1d(x, w, padding=3, groups=4),
            [x(), Input((4, 1, 4))], mesh, 2, 6)
        add(f"halo_conv1d_stride2_{tag}", lambda x, w: F.conv1d(x, w, stride=2, padding=2),
            [x(27), Input((2, 4, 5))], mesh, 2, 6)
        add(f"halo_conv1d_dilation2_{tag}", lambda x, w: F.conv1d(x, w, dilation=2),
            [x(), Input((3, 4, 3))], mesh, 2, 4)
        add(f"halo_conv1d_stride3_no_pad_{tag}", lambda x, w: F.conv1d(x, w, stride=3),
            [x(), Input((3, 4, 2))], mesh, 2, 4)
    # a length-3 input over 4 ranks (an empty block), a 2-long output (empty output chunks)
    add("halo_conv1d_empty_chunks_4", lambda x, w: F.conv1d(x, w), [Input((2, 3, 3), placements=["S(2)"]),
                                                                   Input((2, 3, 2))], M4SP, 2, 2)
    # conv2d with H sharded, then with W sharded (and the batch on the other axis)
    add("halo_conv2d_h_2", lambda x, w, b: F.conv2d(x, w, b, padding=1),
        [Input((2, 3, 13, 6), placements=["S(2)"]), Input((4, 3, 3, 3)), Input((4,))], M2, 2, 2)
    add("halo_conv2d_w_2x2", lambda x, w: F.conv2d(x, w, stride=(1, 2), padding=(0, 1)),
        [Input((2, 3, 5, 14), placements=["S(0)", "S(3)"]), Input((4, 3, 2, 3))], M22, 3, 3)
    add("halo_conv3d_d_4", lambda x, w: F.conv3d(x, w, padding=1),
        [Input((1, 2, 12, 4, 3), placements=["S(2)"]), Input((3, 2, 3, 3, 3))], M4SP, 2, 2)
    # an input without gradient: the backward's output_mask leaves grad_input undefined (its layout
    # had indexed the halo dim of a 0-d shape). Each weight-gradient entry sums n = 2 * 9 * 6 = 108
    # products of unit normals, each rank's part then their sum: two summation orders differ by
    # about u * n (u = 2^-24; see benchmarks/hsbench/fallback.py CHECK_ATOL), so atol = 4 u n =
    # 2.6e-5, against entries cancelled down to ~0.08 (a lost halo changes them by whole products, ~1)
    add("halo_conv2d_h_input_without_grad_2", lambda x, w, b: F.conv2d(x, w, b, padding=1),
        [Input((2, 3, 9, 6), placements=["S(2)"], requires_grad=False), Input((4, 3, 3, 3)), Input((4,))], M2, 2, 2,
        atol=4 * 2.0 ** -24 * 2 * 9 * 6)
    return cases


def channels_local(fn):
    """The distributed call, checked on its second run: the output's channels (dim 1) stay sharded
    like the input's and nothing is sent (each rank convolves its own groups)."""

    def check(inputs, out, sent):
        x = inputs[0]
        if list(out.placements) != list(x.placements) or sent:
            return [f"output placements {out.placements} (input {x.placements}), {sent} bytes sent: expected the "
                    f"input's placements and none"]
        return []
    return traffic_checked(fn, check)


def channel_cases():
    """Grouped / depthwise convolutions with the channels sharded: each rank runs its own groups
    (weight and bias split on their out-channels); with the length sharded too, the halo as well."""
    cases = []

    def add(name, fn, inputs, mesh, local=True):
        cases.append(Case(name, fn, inputs, mesh, dist_fn=channels_local(fn) if local else None))

    add("depthwise_conv1d_channels_2", lambda x, w, b: F.conv1d(x, w, b, padding=1, groups=6),
        [Input((3, 6, 10), placements=["S(1)"]), Input((6, 1, 3)), Input((6,))], M2)
    add("depthwise_causal_channels_4", lambda x, w: causal_depthwise(x, w),
        [Input((2, 8, 9), placements=["S(1)"]), Input((8, 1, 4))], M4, local=False)  # the slice is a view
    add("grouped_conv1d_channels_4", lambda x, w: F.conv1d(x, w, groups=4),
        [Input((2, 8, 7), placements=["S(1)"]), Input((12, 2, 3))], M4)
    add("grouped_conv2d_channels_2x2", lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=4),
        [Input((3, 8, 5, 4), placements=["S(0)", "S(1)"]), Input((8, 2, 3, 3)), Input((8,))], M22)
    add("depthwise_conv1d_channels_and_length_2x2", lambda x, w: F.conv1d(x, w, padding=2, groups=4),
        [Input((2, 4, 13), placements=["S(1)", "S(2)"]), Input((4, 1, 3))], M22, local=False)
    add("depthwise_conv1d_channels_2x2x2", lambda x, w: F.conv1d(x, w, padding=1, groups=8),
        [Input((4, 8, 6), placements=["S(0)", "S(1)", "S(1)"]), Input((8, 1, 3))], M222)
    # 3 groups over 2 ranks: shards would split a group, the channels are gathered
    add("grouped_conv1d_groups_not_divisible_2", lambda x, w: F.conv1d(x, w, groups=3),
        [Input((2, 6, 7), placements=["S(1)"]), Input((6, 2, 3))], M2, local=False)
    return cases


def test_convolutions_match_one_device():
    assert_all_passed(run_cases(conv_cases() + halo_cases() + channel_cases(), timeout=900))


def _no_halo(x, w):
    """A planted fault: each rank convolves its own block (zero padding at every block edge)."""
    local = F.conv1d(x.to_local(), w.to_local(), padding=1)
    return hs.DTensor.from_local(local, x.device_mesh, x.placements)


def test_a_missing_halo_would_be_caught():
    case = Case("planted_no_halo", lambda x, w: F.conv1d(x, w, padding=1),
                [Input((3, 4, 26), placements=["S(2)"]), Input((5, 4, 3))], M4SP, dist_fn=_no_halo,
                check_grad=False)
    assert not run_cases([case], timeout=300).ok, "a convolution without its halo passed"
