"""Level0: ops given rules together on real meshes against one device, strict mode, forward and
gradients: hardswish, logsigmoid, prelu, polar, complex (pointwise.cpp); glu, renorm, rot90,
channel/pixel shuffles, hash_tensor (along_dims.cpp); trace, equal, allclose (reductions.cpp);
isin (lookups.cpp). Meshes (2), (4), (2, 2); uneven sizes (5 and 7 over 2 and 4 ranks, an empty
block on 4 ranks); Partial inputs where the op passes them (trace, complex, the shuffles).

Tolerances: the pointwise ops and the shuffles compute each element as one device does (float32
defaults hold exactly); glu/renorm gather their dims first (torch's kernel on the whole slice);
trace adds the diagonal's few entries in another order (float32 defaults)."""

import torch
import torch.nn.functional as F

from hypershard.testing import Case, Input, assert_all_passed, run_cases
from hypershard.testing.spec import randint, uniform

M2 = ((2,), ("dp",))
M4 = ((4,), ("tp",))
M22 = ((2, 2), ("dp", "tp"))
LAYOUTS = ((M2, ["S(0)"], "2"), (M4, ["S(1)"], "4"), (M22, ["S(0)", "S(1)"], "2x2"))


def hardswish_inplace(x):
    y = x * 1.0
    F.hardswish(y, inplace=True)
    return y


def prelu_cases():
    out = []
    for mesh, place, tag in LAYOUTS:
        # x (5, 3, 7): the weight broadcasts along the channel dim 1
        x_place = {"2": ["S(0)"], "4": ["S(2)"], "2x2": ["S(0)", "S(1)"]}[tag]
        out.append(Case(f"prelu_channels_{tag}", F.prelu,
                        [Input((5, 3, 7), placements=x_place), Input((3,))], mesh))
        out.append(Case(f"prelu_one_weight_{tag}", F.prelu, [Input((5, 7), placements=place), Input((1,))], mesh))
    # the weight sharded along with the channels
    out.append(Case("prelu_weight_sharded_2x2", F.prelu,
                    [Input((5, 4, 7), placements=["S(0)", "S(1)"]), Input((4,), placements=["R", "S(0)"])], M22))
    return out


def pointwise_cases():
    out = []
    for mesh, place, tag in LAYOUTS:
        x = lambda: Input((5, 7), placements=place)  # noqa: E731
        out.append(Case(f"hardswish_{tag}", F.hardswish, [Input((5, 7), placements=place, init=uniform(-4, 4))], mesh))
        out.append(Case(f"hardswish_inplace_{tag}", hardswish_inplace,
                        [Input((5, 7), placements=place, init=uniform(-4, 4))], mesh))
        out.append(Case(f"logsigmoid_{tag}", F.logsigmoid, [x()], mesh))
        out.append(Case(f"multilabel_soft_margin_{tag}", F.multilabel_soft_margin_loss,
                        [x(), Input((5, 7), placements=place, init=randint(0, 2), requires_grad=False)], mesh))
        out.append(Case(f"polar_{tag}", torch.polar, [Input((5, 7), placements=place, init=uniform(0.1, 2)), x()], mesh))
        out.append(Case(f"complex_{tag}", torch.complex, [x(), x()], mesh))
    # Partial: complex is linear in both operands (a Replicate imag is filled), polar in abs only
    out.append(Case("complex_partial_2x2", torch.complex,
                    [Input((5, 7), placements=["P", "S(1)"]), Input((5, 7), placements=["R", "S(1)"])], M22))
    out.append(Case("polar_partial_abs_2x2", lambda a, t: torch.polar(a, t),
                    [Input((5, 7), placements=["P", "S(1)"], init=uniform(0.1, 2)), Input((5, 7), placements=["R", "S(1)"])],
                    M22))
    # a broadcast operand
    out.append(Case("complex_broadcast_4", torch.complex,
                    [Input((5, 7), placements=["S(1)"]), Input((7,), placements=["S(0)"])], M4))
    return out + prelu_cases()


def along_cases():
    out = []
    for mesh, place, tag in LAYOUTS:
        out.append(Case(f"glu_dim1_{tag}", lambda x: F.glu(x, 1), [Input((5, 8), placements=place)], mesh))
        out.append(Case(f"glu_dim0_{tag}", lambda x: F.glu(x, 0), [Input((6, 7), placements=place)], mesh))
        out.append(Case(f"renorm_dim0_{tag}", lambda x: torch.renorm(x, 2, 0, 1.5), [Input((5, 7), placements=place)],
                        mesh))
        out.append(Case(f"renorm_dim1_{tag}", lambda x: torch.renorm(x, 1, 1, 2.0), [Input((5, 7), placements=place)],
                        mesh))
        for k in (1, 2, 3, -1):
            out.append(Case(f"rot90_k{k}_{tag}".replace("-", "m"), lambda x, k=k: torch.rot90(x, k, (1, 2)),
                            [Input((5, 7, 3), placements=place)], mesh))
        out.append(Case(f"rot90_dims01_{tag}", lambda x: torch.rot90(x, 1, (0, 1)), [Input((5, 7, 3), placements=place)],
                        mesh))
        out.append(Case(f"hash_tensor_{tag}", lambda x: torch.hash_tensor(x, 1),
                        [Input((5, 7), placements=place)], mesh, check_grad=False))
    for mesh, place, tag in ((M2, ["S(0)"], "2"), (M4, ["S(1)"], "4"), (M22, ["S(0)", "S(2)"], "2x2")):
        out.append(Case(f"channel_shuffle_{tag}", lambda x: F.channel_shuffle(x, 2),
                        [Input((5, 6, 3, 4), placements=place)], mesh))
        out.append(Case(f"pixel_shuffle_{tag}", lambda x: F.pixel_shuffle(x, 2),
                        [Input((5, 8, 3, 2), placements=place)], mesh))
        out.append(Case(f"pixel_unshuffle_{tag}", lambda x: F.pixel_unshuffle(x, 2),
                        [Input((5, 3, 4, 6), placements=place)], mesh))
    # batch dims beyond one keep their sharding; a Partial passes the permutations
    out.append(Case("pixel_shuffle_two_batch_dims_2x2", lambda x: F.pixel_shuffle(x, 2),
                    [Input((3, 5, 4, 2, 3), placements=["S(0)", "S(1)"])], M22))
    out.append(Case("pixel_shuffle_partial_2x2", lambda x: F.pixel_shuffle(x, 2),
                    [Input((5, 8, 3, 2), placements=["P", "S(0)"])], M22))
    out.append(Case("rot90_partial_2x2", lambda x: torch.rot90(x, 1, (0, 1)),
                    [Input((5, 7, 3), placements=["P", "S(2)"])], M22))
    return out


def exact(values):
    """A fixed tensor (the same in the reference and the distributed run)."""
    return lambda shape, dtype, generator: torch.as_tensor(values, dtype=dtype).reshape(shape)


def compare_cases():
    out = []
    base = torch.arange(35.0).reshape(5, 7)
    one_off = base.clone()
    one_off[4, 6] += 1  # differs in one element only: the last block on every mesh
    near = base + 1e-7
    for mesh, place, tag in LAYOUTS:
        other_place = list(reversed(place)) if len(place) == 2 else ["S(1)" if place == ["S(0)"] else "S(0)"]
        same = [Input((5, 7), placements=place, init=exact(base)), Input((5, 7), placements=place, init=exact(base))]
        out.append(Case(f"equal_true_{tag}", torch.equal, same, mesh, check_grad=False))
        out.append(Case(f"equal_one_off_{tag}", torch.equal,
                        [Input((5, 7), placements=place, init=exact(base)),
                         Input((5, 7), placements=place, init=exact(one_off))], mesh, check_grad=False))
        # operands laid out differently: redistributed alike first
        out.append(Case(f"equal_other_layout_{tag}", torch.equal,
                        [Input((5, 7), placements=place, init=exact(base)),
                         Input((5, 7), placements=other_place, init=exact(base))], mesh, check_grad=False))
        out.append(Case(f"equal_shapes_differ_{tag}", torch.equal,
                        [Input((5, 7), placements=place), Input((5, 6), placements=place)], mesh, check_grad=False))
        out.append(Case(f"allclose_near_{tag}", torch.allclose,
                        [Input((5, 7), placements=place, init=exact(base)),
                         Input((5, 7), placements=place, init=exact(near))], mesh, check_grad=False))
        out.append(Case(f"allclose_one_off_{tag}", torch.allclose,
                        [Input((5, 7), placements=place, init=exact(base)),
                         Input((5, 7), placements=place, init=exact(one_off))], mesh, check_grad=False))
        out.append(Case(f"allclose_broadcast_{tag}", lambda a, b: torch.allclose(a, b, atol=100.0),
                        [Input((5, 7), placements=place), Input((7,))], mesh, check_grad=False))
        # trace: every block's part of the GLOBAL diagonal (a square and a wide matrix)
        out.append(Case(f"trace_{tag}", torch.trace, [Input((5, 7), placements=place)], mesh))
        out.append(Case(f"trace_square_{tag}", torch.trace, [Input((6, 6), placements=place)], mesh))
        out.append(Case(f"trace_int_{tag}", torch.trace, [Input((7, 5), torch.int64, placements=place)], mesh,
                        check_grad=False))
        # isin: the elements keep their layout, the test elements are read whole
        ints = randint(0, 12)
        out.append(Case(f"isin_{tag}", torch.isin,
                        [Input((5, 7), torch.int64, placements=place, init=ints),
                         Input((6,), torch.int64, placements=["S(0)"] * len(place), init=ints)], mesh, check_grad=False))
        out.append(Case(f"isin_invert_{tag}", lambda a, b: torch.isin(a, b, invert=True),
                        [Input((5, 7), torch.int64, placements=place, init=ints),
                         Input((6,), torch.int64, init=ints)], mesh, check_grad=False))
        out.append(Case(f"isin_scalar_test_{tag}", lambda a: torch.isin(a, 3),
                        [Input((5, 7), torch.int64, placements=place, init=ints)], mesh, check_grad=False))
        out.append(Case(f"isin_scalar_element_{tag}", lambda b: torch.isin(3, b),
                        [Input((9,), torch.int64, placements=["S(0)"] * len(place), init=ints)], mesh, check_grad=False))
    out.append(Case("trace_partial_2x2", torch.trace, [Input((5, 7), placements=["P", "S(1)"])], M22))
    out.append(Case("trace_two_axes_one_dim_2x2", torch.trace, [Input((7, 6), placements=["S(0)", "S(0)"])], M22))
    return out


def test_pointwise_ops_match_one_device():
    assert_all_passed(run_cases(pointwise_cases(), timeout=900))


def test_along_dims_ops_match_one_device():
    assert_all_passed(run_cases(along_cases(), timeout=900))


def test_trace_equal_allclose_isin_match_one_device():
    assert_all_passed(run_cases(compare_cases(), timeout=900))


def _local_trace(x):
    """A planted fault: every rank sums its own block's local diagonal (no global offset)."""
    import hypershard as hs
    return hs.DTensor.from_local(torch.trace(x.to_local()).reshape(()), x.device_mesh, [hs.Partial()])


def test_a_local_trace_would_be_caught():
    case = Case("planted_local_trace", torch.trace, [Input((6, 6), placements=["S(1)"])], M2,
                dist_fn=_local_trace, check_grad=False)
    assert not run_cases([case], timeout=300).ok, "the planted local trace passed"
