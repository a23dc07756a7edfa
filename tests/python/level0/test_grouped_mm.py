"""Level0: grouped matrix products (aten::_grouped_mm and transformers' grouped_mm_fallback, the MoE
experts' matmuls) on real meshes against one device, strict mode, forward and gradients of the
tokens and the expert weights:

- colwise tensor parallelism: weights (E, K, N) sharded on N, tokens Replicate -> output sharded on N;
- rowwise: tokens sharded on K and weights on K -> Partial(sum) output;
- expert parallelism: weights sharded on E, tokens Replicate -> each rank computes its experts'
  rows, a Partial(sum) output (HF's grouped_gemm EP layout);
- the same on 2-D meshes (ep x tp), uneven splits, empty groups, and shard widths that break the
  CPU kernel's 16-byte stride rule (the rule's local loop has no such rule);
- offs is the GLOBAL cumulative row count per expert, Replicate.
The weight gradient runs the 2d x 2d grouped product ("km,mn->ekn") of the backward.
"""

import importlib

import torch

from hypershard.testing import Case, Input, assert_all_passed, run_cases

M2 = ((2,), ("tp",))
M4 = ((4,), ("ep",))
M22 = ((2, 2), ("ep", "tp"))

# 11 tokens in 4 experts (expert 2 empty), cumulative ends
OFFS = torch.tensor([3, 7, 7, 11], dtype=torch.int32)


def offs_input():
    return Input((4,), torch.int32, init=OFFS, requires_grad=False)


def grouped(x, w, offs):
    return torch._grouped_mm(x, w, offs=offs)


def fallback(x, w, offs):
    importlib.import_module("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


def cases():
    out = []
    layouts = [
        ("replicate", M2, ["R"], ["R"]),
        ("colwise", M2, ["R"], ["S(2)"]),
        ("rowwise", M2, ["S(1)"], ["S(1)"]),
        ("colwise_uneven", M4, ["R"], ["S(2)"]),
        ("expert", M4, ["R"], ["S(0)"]),
        ("expert_tp_colwise", M22, ["R", "R"], ["S(0)", "S(2)"]),
        ("expert_tp_rowwise", M22, ["R", "S(1)"], ["S(0)", "S(1)"]),
    ]
    for name, mesh, xp, wp in layouts:
        for fn, tag in ((grouped, "grouped_mm"), (fallback, "fallback")):
            # transformers' own backward of its fallback op would write into weight[i] of an
            # expert-sharded gradient (a slice across the sharded dim, not a view of a shard); on
            # DTensors hypershard's autograd kernel for the op (csrc/kernels/external_autograd.cpp)
            # records a backward of _grouped_mm calls instead, so every layout has gradients.
            # N = 12 (48-byte rows, as torch's CPU kernel needs for the one-device reference): a 2-way
            # shard is 6 floats wide and a 4-way one 3 (24- and 12-byte strides, refused by that
            # kernel; the rule's local loop takes them)
            out.append(Case(f"{tag}_{name}", fn,
                            [Input((11, 8), placements=xp), Input((4, 8, 12), placements=wp), offs_input()], mesh))
    out.append(Case("grouped_mm_batched_3d", lambda a, b: torch._grouped_mm(a, b),
                    [Input((4, 5, 8), placements=["S(0)"]), Input((4, 8, 4), placements=["S(0)"])], M2))
    return out


def test_grouped_mm_matches_one_device():
    assert_all_passed(run_cases(cases(), timeout=600))
