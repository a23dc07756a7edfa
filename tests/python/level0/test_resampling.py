"""Level0: pads that read their border from the input (F.pad reflect / replicate / circular) and
upsampling (F.interpolate: nearest, nearest-exact, linear, bilinear, bicubic, trilinear, area,
antialiased) on real meshes against one device, strict mode, forward and gradients
(csrc/ops/resampling.cpp).

Batch- and channel-sharded inputs keep their sharding. A padded dim sharded over one axis STAYS
sharded (the output's placements are the input's, checked on the distributed call), each rank
fetching the input positions its block reads; over two axes it is made whole. A sharded spatial
dim of an upsampling is gathered. Meshes (2), (4), (2, 2), (2, 2, 2); even and uneven sizes
(7 positions over 4 ranks, one empty output block where the pad is cropped); Partial inputs.

Tolerances: the pads' forward only copies elements (exact); their gradients add at most a few
cotangent values per position, in another order than one device (float32 defaults). The
upsampling runs torch's own kernel on whole spatial dims, the same arithmetic as one device."""

import torch.nn.functional as F

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, run_cases, traffic_checked

M2 = ((2,), ("dp",))
M4 = ((4,), ("tp",))
M22 = ((2, 2), ("dp", "tp"))
M222 = ((2, 2, 2), ("dp", "tp", "sp"))


def keeps_placements(fn):
    """The distributed call, asserting the output keeps the input's placements (a sharded padded
    dim was not gathered)."""

    def run(x):
        out = fn(x)
        if tuple(out.placements) != tuple(x.placements):
            raise AssertionError(f"placements {out.placements}, expected the input's {x.placements}")
        return out
    return run


PADS = {1: (2, 1), 2: (2, 1, 1, 3), 3: (1, 2, 2, 1, 1, 2)}
SHAPES = {1: (4, 3, 7), 2: (4, 3, 7, 6), 3: (4, 3, 5, 7, 6)}


def pad_cases():
    out = []
    for mode in ("reflect", "replicate", "circular"):
        for nd in (1, 2, 3):
            shape, pad = SHAPES[nd], PADS[nd]
            fn = lambda x, p=pad, m=mode: F.pad(x, p, mode=m)  # noqa: E731
            last = len(shape) - 1
            t = f"{mode}{nd}d"
            out.append(Case(f"pad_{t}_batch_2", fn, [Input(shape, placements=["S(0)"])], M2))
            out.append(Case(f"pad_{t}_channel_4", fn, [Input(shape, placements=["S(1)"])], M4))
            # the padded last dim sharded: 7 (or 6) positions over 2 and 4 ranks (uneven)
            keep = mode != "circular"  # circular decomposes into narrow/cat (their own rules)
            dist = keeps_placements(fn) if keep else None
            out.append(Case(f"pad_{t}_padded_2", fn, [Input(shape, placements=[f"S({last})"])], M2, dist_fn=dist))
            out.append(Case(f"pad_{t}_padded_4", fn, [Input(shape, placements=[f"S({last})"])], M4, dist_fn=dist))
            out.append(Case(f"pad_{t}_batch_padded_2x2", fn, [Input(shape, placements=["S(0)", f"S({last})"])], M22,
                            dist_fn=dist))
            # over two axes: the padded dim is made whole
            out.append(Case(f"pad_{t}_padded_two_axes_2x2", fn,
                            [Input(shape, placements=[f"S({last})", f"S({last})"])], M22))
            # a Partial input passes (copies) with the padded dim sharded on the other axis
            out.append(Case(f"pad_{t}_partial_2x2", fn, [Input(shape, placements=["P", f"S({last})"])], M22,
                            dist_fn=dist))
            if nd >= 2:  # two padded dims sharded on different axes, batch on a third
                out.append(Case(f"pad_{t}_two_padded_2x2x2", fn,
                                [Input(shape, placements=["S(0)", f"S({last - 1})", f"S({last})"])], M222,
                                dist_fn=dist))
    # even sizes, a wide reflect (pad = n - 1: every rank reads the far edge), a crop (negative
    # pad: an empty output block on 4 ranks), a replicate pad far wider than the dim
    for name, fn, shape, mesh in (
            ("reflect_even_4", lambda x: F.pad(x, (3, 3), mode="reflect"), (2, 3, 8), M4),
            ("reflect_wide_4", lambda x: F.pad(x, (6, 6), mode="reflect"), (2, 3, 7), M4),
            ("reflect_crop_4", lambda x: F.pad(x, (-2, -2), mode="reflect"), (2, 3, 7), M4),
            ("replicate_crop_left_4", lambda x: F.pad(x, (-3, 2), mode="replicate"), (2, 3, 7), M4),
            ("replicate_wide_4", lambda x: F.pad(x, (9, 11), mode="replicate"), (2, 3, 5), M4),
            ("replicate_2d_no_batch_2", lambda x: F.pad(x, (1, 2), mode="replicate"), (3, 5), M2)):
        out.append(Case(f"pad_{name}", fn, [Input(shape, placements=[f"S({len(shape) - 1})"])], mesh,
                        dist_fn=keeps_placements(fn)))
    # the same exchanged pad twice (the second from the plan cache), forward and backward
    twice = lambda x: F.pad(x, (2, 3), mode="reflect") + F.pad(x * 2, (2, 3), mode="reflect")  # noqa: E731
    out.append(Case("pad_reflect_twice_padded_4", twice, [Input((2, 3, 9), placements=["S(2)"])], M4))
    return out


def interpolate_cases():
    out = []

    def add(name, fn, shape):
        n = len(shape)
        out.append(Case(f"{name}_batch_2", fn, [Input(shape, placements=["S(0)"])], M2))
        out.append(Case(f"{name}_channel_4", fn, [Input(shape, placements=["S(1)"])], M4))
        # a sharded spatial dim is gathered; batch keeps its sharding
        out.append(Case(f"{name}_spatial_2x2", fn, [Input(shape, placements=["S(0)", f"S({n - 1})"])], M22))
        out.append(Case(f"{name}_partial_2x2", fn, [Input(shape, placements=["P", "S(1)"])], M22))

    for mode in ("nearest", "nearest-exact"):
        for nd in (1, 2, 3):
            shape = (4, 3) + (5, 3, 4)[:nd]
            add(f"{mode}{nd}d_scale", lambda x, m=mode: F.interpolate(x, scale_factor=2, mode=m), shape)
            add(f"{mode}{nd}d_size", lambda x, m=mode, k=nd: F.interpolate(x, size=(7, 5, 3)[:k], mode=m), shape)
    for align in (False, True):
        t = "_align" if align else ""
        add(f"linear{t}", lambda x, a=align: F.interpolate(x, size=9, mode="linear", align_corners=a), (4, 3, 5))
        add(f"bilinear{t}", lambda x, a=align: F.interpolate(x, scale_factor=1.7, mode="bilinear", align_corners=a),
            (4, 3, 5, 6))
        add(f"bicubic{t}", lambda x, a=align: F.interpolate(x, size=(9, 7), mode="bicubic", align_corners=a),
            (4, 3, 5, 6))
        add(f"trilinear{t}", lambda x, a=align: F.interpolate(x, size=(7, 5, 3), mode="trilinear", align_corners=a),
            (4, 3, 5, 6, 4))
    add("bilinear_aa", lambda x: F.interpolate(x, size=(3, 2), mode="bilinear", antialias=True), (4, 3, 7, 6))
    add("bicubic_aa", lambda x: F.interpolate(x, size=(3, 4), mode="bicubic", antialias=True), (4, 3, 7, 6))
    # area: 3 spatial dims reach _adaptive_avg_pool3d (here); 1 and 2 reach _adaptive_avg_pool2d
    # (along_dims.cpp), whose backward kernel refuses a rank's empty channel block -- those two
    # take 4 channels over 4 ranks
    for nd in (1, 2, 3):
        add(f"area{nd}d", lambda x, k=nd: F.interpolate(x, size=(3, 2, 2)[:k], mode="area"),
            (4, 3 if nd == 3 else 4) + (7, 6, 5)[:nd])
    # (2, 2, 2): batch, channel and a spatial dim, uneven batch
    out.append(Case("bilinear_2x2x2", lambda x: F.interpolate(x, size=(9, 7), mode="bilinear"),
                    [Input((5, 6, 5, 6), placements=["S(0)", "S(1)", "S(3)"])], M222))
    out.append(Case("nearest3d_2x2x2", lambda x: F.interpolate(x, scale_factor=(2, 1, 3), mode="nearest"),
                    [Input((3, 4, 3, 2, 5), placements=["S(1)", "S(0)", "S(4)"])], M222))
    # the same call twice (the second from the plan cache / fast path): a backward's input_size
    # localised both times
    twice = lambda x: (F.interpolate(x, size=(9, 7), mode="bilinear")  # noqa: E731
                       + F.interpolate(x * 2, size=(9, 7), mode="bilinear"))
    out.append(Case("bilinear_twice_batch_4", twice, [Input((6, 3, 5, 6), placements=["S(0)"])], M4))
    return out


def test_pads_match_one_device():
    assert_all_passed(run_cases(pad_cases(), timeout=900))


def test_interpolate_matches_one_device():
    assert_all_passed(run_cases(interpolate_cases(), timeout=900))


def moves_at_most_twice_its_block(fn):
    """The distributed call, once for the plan cache and again with the traffic counted: the
    output keeps the input's placements and this rank sent at most twice its block -- a position
    goes to the ranks whose output blocks read it, at most two others for these pads (its own
    mirror image and the edge it replicates), where gathering the dim over 4 ranks would send
    three times the block."""

    def check(inputs, out, sent):
        x, problems = inputs[0], []
        local = x.to_local()
        limit = 2 * local.numel() * local.element_size()
        if tuple(out.placements) != tuple(x.placements):
            problems.append(f"placements {out.placements}, expected the input's {x.placements}")
        if sent > limit:
            problems.append(f"sent {sent} bytes, at most {limit} expected")
        return problems
    return traffic_checked(fn, check)


def test_a_sharded_padded_dim_is_not_gathered():
    cases = []
    for name, fn, shape in (
            ("reflect1d", lambda x: F.pad(x, (2, 1), mode="reflect"), (2, 3, 16)),
            ("reflect_wide", lambda x: F.pad(x, (6, 6), mode="reflect"), (2, 3, 7)),
            ("replicate_wide", lambda x: F.pad(x, (9, 11), mode="replicate"), (2, 3, 5)),
            ("replicate2d", lambda x: F.pad(x, (3, 2, 1, 1), mode="replicate"), (2, 3, 4, 13))):
        cases.append(Case(f"traffic_{name}_4", fn, [Input(shape, placements=[f"S({len(shape) - 1})"])], M4,
                          dist_fn=moves_at_most_twice_its_block(fn), check_grad=False))
    assert_all_passed(run_cases(cases, timeout=300))


def _local_pad(x):
    """A planted fault: each rank reflect-pads its own block, nothing exchanged."""
    local = F.pad(x.to_local(), (2, 1), mode="reflect")
    return hs.DTensor.from_local(local, x.device_mesh, x.placements)


def test_a_local_pad_would_be_caught():
    case = Case("planted_local_reflect", lambda x: F.pad(x, (2, 1), mode="reflect"),
                [Input((2, 3, 16), placements=["S(2)"])], M4, dist_fn=_local_pad, check_grad=False)
    assert not run_cases([case], timeout=300).ok, "the planted local pad passed"
