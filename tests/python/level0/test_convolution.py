"""Level0: convolutions (csrc/ops/convolution.cpp) on real meshes against one device, in strict mode,
forward and gradients: the batch dim sharded (even and uneven, 1-D and 2-D meshes), a channel
or spatial dim sharded (gathered first), Qwen3.5's causal depthwise conv1d, conv2d with bias and
groups, a transposed conv1d. grad_weight / grad_bias come out Partial(sum) over the batch axes."""

import torch.nn.functional as F

from hypershard.testing import Case, Input, assert_all_passed, run_cases

M2 = ((2,), ("dp",))
M4 = ((4,), ("dp",))
M22 = ((2, 2), ("dp", "tp"))


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


def test_convolutions_match_one_device():
    assert_all_passed(run_cases(conv_cases(), timeout=900))
