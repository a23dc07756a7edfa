"""Level 0: boolean masks in GLOBAL order (csrc/ops/masked.cpp) on real meshes against one process,
forward and gradients, strict mode (the harness):

- masked_scatter with self sharded on dim 0 (uneven: 5 rows over 2 and 4 ranks, over both axes of
  2x2), a mask of self's shape or broadcast ([B, S, 1] as transformers passes), the source whole:
  self keeps its sharding, each rank reads the source at its elements' GLOBAL positions; its
  gradient to the source is masked_scatter_backward's (a Replicate result);
- self[mask] (index.Tensor with a boolean mask over the leading dims): each rank's rows in global
  order in a Replicate result; a whole self; a Partial(sum) self (linear: stays Partial);
- self[mask] = values (index_put / index_put_): one row per selected position (read at the GLOBAL
  positions), broadcast values, accumulate=True;
- transformers' deepstack pattern: x[mask, :] = x[mask, :] + v;
- the sequence sharded as context parallelism does ([B, S, H] with S over the axis, uneven: 5 over 2
  and 4 ranks; on 2x2 the batch over one axis and the sequence over the other): each rank's
  elements are one run of the global order per batch row, a grid of run counts places them; the
  sequence and the hidden dim sharded (runs per position); a byte mask holding 2s.
Masks are random, so ranks hold different counts (empty ones included).
"""

from __future__ import annotations

import pytest
import torch

hs = pytest.importorskip("hypershard")
from hypershard.testing import Case, Input, assert_all_passed, run_cases  # noqa: E402

M2 = ((2,), ("x",))
M4 = ((4,), ("x",))
M22 = ((2, 2), ("x", "y"))
DIM0 = {M2: ["S(0)"], M4: ["S(0)"], M22: ["S(0)", "S(0)"]}  # dim 0 over every axis
SEQ = {M2: ["S(1)"], M4: ["S(1)"], M22: ["S(0)", "S(1)"]}  # [B, S, H]: S over the last axis
WHOLE = {M2: ["R"], M4: ["R"], M22: ["R", "R"]}


def bool_mask(shape, placements, p_true=0.4):
    def init(s, dtype, generator):
        return torch.rand(s, generator=generator) < p_true
    return Input(shape, torch.bool, placements=placements, init=init, requires_grad=False)


def keeps_sharding(fn):
    def run(*args):
        out = fn(*args)
        assert hs.layout_of(out).dim_axes == hs.layout_of(args[0]).dim_axes, hs.layout_of(out)
        return out
    return run


def deepstack(x, m, v):
    x = x.clone()
    x[m, :] = x[m, :] + v[: int(m.sum())]
    return x


def cases():
    out = []
    for mesh in (M2, M4, M22):
        s0, whole = DIM0[mesh], WHOLE[mesh]
        tag = "x".join(map(str, mesh[0]))
        # masked_scatter: full mask, broadcast mask
        fn = lambda x, m, src: x.masked_scatter(m, src)  # noqa: E731
        out.append(Case(f"masked_scatter_full_{tag}", fn,
                        [Input((5, 4, 3), placements=s0), bool_mask((5, 4, 3), s0), Input((60,), placements=whole)],
                        mesh, dist_fn=keeps_sharding(fn)))
        fn = lambda x, m, src: x.masked_scatter(m, src) * 2  # noqa: E731
        out.append(Case(f"masked_scatter_broadcast_mask_{tag}", fn,
                        [Input((5, 4, 3), placements=s0), bool_mask((5, 4, 1), s0), Input((20, 3), placements=whole)],
                        mesh, dist_fn=keeps_sharding(fn)))
        out.append(Case(f"masked_scatter_whole_{tag}", lambda x, m, src: x.masked_scatter(m, src),
                        [Input((5, 3), placements=whole), bool_mask((5, 3), whole), Input((15,), placements=whole)], mesh))
        # self[mask]
        out.append(Case(f"index_mask_leading_dims_{tag}", lambda x, m: x[m, :],
                        [Input((5, 4, 3), placements=s0), bool_mask((5, 4), s0)], mesh))
        out.append(Case(f"index_mask_all_dims_{tag}", lambda x, m: x[m],
                        [Input((5, 3), placements=s0), bool_mask((5, 3), s0)], mesh))
        out.append(Case(f"index_mask_whole_self_{tag}", lambda x, m: x[m],
                        [Input((5, 3), placements=whole), bool_mask((5,), s0)], mesh))
        # self[mask] = values
        out.append(Case(f"index_put_per_position_{tag}", lambda x, m, v: x.index_put((m,), v[: int(m.sum())]),
                        [Input((5, 4, 3), placements=s0), bool_mask((5, 4), s0), Input((20, 3), placements=whole)], mesh))
        out.append(Case(f"index_put_broadcast_{tag}", lambda x, m, v: x.index_put((m,), v),
                        [Input((5, 4, 3), placements=s0), bool_mask((5, 4), s0), Input((3,), placements=whole)], mesh))
        out.append(Case(f"index_put_accumulate_{tag}",
                        lambda x, m, v: x.index_put((m,), v[: int(m.sum())], accumulate=True),
                        [Input((5, 4, 3), placements=s0), bool_mask((5, 4), s0), Input((20, 3), placements=whole)], mesh))
        out.append(Case(f"deepstack_pattern_{tag}", deepstack,
                        [Input((5, 4, 3), placements=s0), bool_mask((5, 4), s0), Input((20, 3), placements=whole)], mesh))
        # the sequence sharded (dim 1 of [B, S, H]), the image-merge calls of a vision-language model
        seq = SEQ[mesh]
        fn = lambda x, m, src: x.masked_scatter(m, src) * 2  # noqa: E731
        out.append(Case(f"seq_masked_scatter_broadcast_mask_{tag}", fn,
                        [Input((2, 5, 4), placements=seq), bool_mask((2, 5, 1), seq), Input((10, 4), placements=whole)],
                        mesh, dist_fn=keeps_sharding(fn)))
        out.append(Case(f"seq_index_mask_leading_dims_{tag}", lambda x, m: x[m, :],
                        [Input((2, 5, 4), placements=seq), bool_mask((2, 5), seq)], mesh))
        out.append(Case(f"seq_index_put_per_position_{tag}", lambda x, m, v: x.index_put((m,), v[: int(m.sum())]),
                        [Input((2, 5, 4), placements=seq), bool_mask((2, 5), seq), Input((10, 4), placements=whole)],
                        mesh, dist_fn=keeps_sharding(lambda x, m, v: x.index_put((m,), v[: int(m.sum())]))))
        out.append(Case(f"seq_deepstack_pattern_{tag}", deepstack,
                        [Input((2, 5, 4), placements=seq), bool_mask((2, 5), seq), Input((10, 4), placements=whole)],
                        mesh))
    # the hidden dim sharded too (a [B, S, 1] mask broadcast along it): runs per (batch, position)
    fn = lambda x, m, src: x.masked_scatter(m, src) * 2  # noqa: E731
    out.append(Case("seq_and_hidden_masked_scatter_2x2", fn,
                    [Input((2, 5, 4), placements=["S(1)", "S(2)"]), bool_mask((2, 5, 1), ["S(1)", "R"]),
                     Input((10, 4), placements=["R", "R"])], M22, dist_fn=keeps_sharding(fn)))
    # a byte mask selects where it is nonzero (values 2 count once)
    def byte_mask(s, dtype, generator):
        return (torch.rand(s, generator=generator) < 0.4).to(torch.uint8) * 2
    out.append(Case("seq_index_byte_mask_2", lambda x, m: x[m, :],
                    [Input((2, 5, 4), placements=["S(1)"]),
                     Input((2, 5), torch.uint8, placements=["S(1)"], init=byte_mask, requires_grad=False)], M2))
    # a Partial(sum) self: index is linear in it
    out.append(Case("index_mask_partial_self", lambda x, m: x[m],
                    [Input((5, 3), placements=["P"]), bool_mask((5, 3), ["R"])], M2, check_grad=False))
    return out


def test_boolean_masks_match_one_device():
    assert_all_passed(run_cases(cases(), backend="hypershard", timeout=600))
