"""Level0: the requirement's operator list (../shared/design/OPERATORS.md, first table) as ONE
matrix: every name on every mesh (2,), (4,), (2, 2) and (2, 2, 2), inputs
sharded on a batch/leading dim with even and uneven sizes, strict mode (the harness default),
forward values and the gradients of every floating input against one device (float32: the
harness default rtol 1e-5, atol 1e-6; bfloat16: see BF16_NOTE).

The names and the forms a model uses them in:

  cpu, to, type_as                  x.cpu(), x.to(float64 | "cpu" | bf16), x.type_as(y)
  cross_entropy                     ignore_index=-100 and label_smoothing=0.1 (mean), reduction sum;
                                    logits sharded on the batch, and (separately) on the vocab
                                    (vocab-parallel), uneven vocab 7
  gather                            GLOBAL indices: along an unsharded dim with the index sharded
                                    like self, and along the sharded dim (index Replicate)
  histc                             of a sharded input, explicit range and data range
  index_add_ / index_add            GLOBAL indices along the sharded dim (repeats) and along another
  new_zeros                         GLOBAL sizes; a dim of the input's extent keeps its shards
  npu_rms_norm                      hypershard.ops.rms_norm (the fused op sharing its rule)
  npu_rotary_mul                    hypershard.ops.rotary_mul, modes half and interleave
  tolist                            inside the function: a tensor built from x.tolist() (and from
                                    histc counts, as DeepSeek-V3.2's router does)
  vstack                            2-D inputs sharded on the stacked dim; 1-D inputs
  conv1d                            Qwen3.5's causal depthwise conv (padding k-1, groups=C, [..., :L])
  softplus                          default and beta/threshold
  tril / triu                       diagonal offsets -1, 1, 2, -2 with the LAST TWO dims sharded,
                                    and with the batch dim sharded
  greater                           torch.greater / x.gt(scalar), used in a where
  one_hot                           num_classes given and -1; a (tokens, top_k) index permuted as
                                    the Qwen MoE blocks do
  where                             3-argument (tensor and scalar other) and 1-argument (GLOBAL
                                    coordinates, used to index x)
  bool                              x.bool() and its use as a mask
  scatter_                          src (unique GLOBAL indices along the sharded dim and along
                                    another), value, reduce="add" (repeated indices) and
                                    value+reduce="multiply"; the MoE top-k form
                                    zeros_like(x).scatter_(1, topk_ids, topk_vals)
  clamp_                            in place on a clone (min/max, min only)
  _grouped_mm                       weights (E, K, N) expert-sharded on dim 0 (E even and uneven;
                                    and on N on 2-D/3-D meshes) or on N, tokens Replicate or
                                    sharded on their leading dim (gathered), offs int32 Replicate
  grouped_mm_fallback               transformers::grouped_mm_fallback: weights sharded on N (colwise),
                                    expert-sharded (even and uneven), tokens sharded; with
                                    gradients: on a DTensor hypershard's autograd kernel
                                    (csrc/kernels/external_autograd.cpp) records a backward of
                                    _grouped_mm calls, since transformers' own backward writes
                                    grad_weight[i] / grad_input[start:end] with mm(out=), slices
                                    across the sharded dim that are no views of a shard
  adamw / fused_adamw               a tiny nn.Linear with DTensor parameters, torch.optim.AdamW
                                    (foreach=True) and (fused=True), parameters after 2 steps

plus Partial inputs: accepted where the algebra allows, the values equal to one device (tolist,
cpu/to/type_as, clamp_ of a Partial(max), tril/triu, vstack, new_zeros, _grouped_mm and the
fallback with Partial tokens), and refused with the house error text naming the op and the
argument where it does not (histc, one_hot, softplus, greater, bool, clamp_ of a sum, rms_norm,
rotary_mul, cross_entropy; gather and conv1d, whose refusal docs/operators.md documents).
The planning-level inference and error texts of the same ops: tests/python/unit/
test_requirement_ops_rules.py.

Every mesh runs every form with an even and an uneven batch, the vocab-parallel and causal-LM
cross entropy, tril/triu with the last two dims sharded, the grouped matmul layouts, the bfloat16
forms and the accepted Partial inputs, each compared with one device. The Partial refusals run on
(2,) and (2, 2) only: a refusal is the same rule code on every mesh. test_case_counts pins the
number of cases per mesh, so a case generator that silently yields fewer cases fails. Launches:
one per world size (2, 4 and 8 ranks; (4,) and (2, 2) share the 4-rank launch).

In-place forms (clamp_, scatter_ and index_add_ along an unsharded dim) also assert that self
keeps its placements (in_place).  Not here, because hypershard's plan differs from what the
requirement asks (these cases would pin the difference, not the requirement):
- index_add_ / index_add with a Partial(sum) self and source ("Partial(sum) self+source stays
  Partial", OPERATORS.md) raise "aten::index_add_: argument self (#0) ... Partial(sum) input is
  not supported by this op";
- index_add_ and scatter_ (src, value, reduce) along the SHARDED dim compute the right values
  (the cases below check them) but leave self Replicate where it was Shard(0) (OPERATORS.md:
  in-place ops keep their placements; docs/operators.md, along_dims: "an in-place form leaves
  self in the planned layout"), so those cases do not assert the layout.
"""

from __future__ import annotations

import collections
import importlib

import pytest
import torch
import torch.nn.functional as F

from hypershard.testing import Case, Input, in_distributed_run, randint, replicated, run_cases, uniform

M2 = ((2,), ("dp",))
M4 = ((4,), ("dp",))
M22 = ((2, 2), ("dp", "tp"))
M222 = ((2, 2, 2), ("dp", "tp", "sp"))
MESHES = {"2": M2, "4": M4, "2x2": M22, "2x2x2": M222}

# Rows of the batch dim: even (a multiple of the ranks that split it) and uneven (2,): 3+2;
# (4,): 6 -> 2+2+2+0; (2, 2): 5 -> 2+2+1+0; (2, 2, 2): 5 -> five 1s and three empty shards.
EVEN = {"2": 4, "4": 8, "2x2": 8, "2x2x2": 8}
UNEVEN = {"2": 5, "4": 6, "2x2": 5, "2x2x2": 5}

REQUIREMENT_OPS = (
    "cpu", "cross_entropy", "gather", "histc", "index_add_", "index_add", "new_zeros", "npu_rms_norm",
    "npu_rotary_mul", "tolist", "type_as", "vstack", "conv1d", "softplus", "to", "tril", "triu", "greater",
    "one_hot", "where", "where_1arg", "bool", "scatter_", "scatter_.value", "scatter_.reduce", "clamp_",
    "grouped_mm_fallback", "_grouped_mm", "adamw", "fused_adamw",
)

# BF16_NOTE -- the bfloat16 tolerances.  bf16 keeps 8 significant bits: one unit in the last place
# (ulp) of a value in [2**e, 2**(e+1)) is 2**(e-7), 7.8e-3 relative.  The distributed run rounds at
# other points than one device (a shard's partial result, a collective's sum), so its values may
# differ from one device's by a rounding or two.  Three kinds of case:
# - pointwise, indexing and conversions (no sum across ranks): each element is computed in float
#   from the same bf16 inputs and rounded once, exactly as on one device: the harness default
#   (rtol 1.6e-2 = two ulps, atol 1e-5) with a factor of two to spare.
# - cross entropy: the gradient (p - q) * dy / count is a DIFFERENCE of the bf16 probabilities p
#   and the smoothed targets q, so a one-ulp change of p (p < 1: at most 2**-8 = 3.9e-3; with
#   vocab-parallel logits the max / sum-exp are all-reduced and p can round the other way) is an
#   absolute error of 3.9e-3 * |dy| / count on a result that may be near 0 (|dy| < 3.4, count >= 4
#   rows not ignored here): atol 4e-3 (about 1.5 such ulps), rtol the default.
# - a gradient that is a Partial(sum) over the sharded batch (or, for grouped_mm's tokens on 2-D
#   meshes, over the N shards), reduced in bf16: every rank's partial sum is rounded before the
#   reduction and the reduction rounds again, each rounding up to half an ulp of the magnitude M the
#   gradient reaches (the largest |gradient| of the case, computed in float64 for every mesh:
#   rms_norm 9.7, rotary_mul 13.0, conv1d 18.3, grouped_mm 12.6), while the result itself may be
#   near 0 after cancellation: atol = 2 ulps of M (M in [8, 16): 0.125; [16, 32): 0.25), rtol
#   the default.  The largest difference seen was 1 ulp of M (0.0625).
# A wrong shard (a missing or doubled contribution) is an O(1) error: these tolerances still
# catch it.
BF16_CE_ATOL = 4e-3
BF16_PARTIAL_ATOL_M16 = 0.125   # partial sums below 16
BF16_PARTIAL_ATOL_M32 = 0.25    # partial sums below 32
BF16 = torch.bfloat16


def batch(mesh, dim=0):
    """Placements sharding tensor dim `dim` over every mesh axis (the batch split of a DP group)."""
    return [f"S({dim})"] * len(mesh[0])


def rep(mesh):
    return ["R"] * len(mesh[0])


def idx(shape, high, placements=None, low=0):
    return Input(shape, torch.int64, placements=placements, init=randint(low, high))


def fixed(tensor, placements=None):
    return Input(tuple(tensor.shape), tensor.dtype, placements=placements, init=tensor, requires_grad=False)


def permutations(rows, cols, seed=0):
    """(rows, cols): each row a permutation of range(cols) (scatter_ along dim 1 with defined values)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(cols, generator=gen) for _ in range(rows)])


def distinct_rows(count, high, cols, seed=0):
    """(count, cols): column j holds `count` distinct row numbers in [0, high)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(high, generator=gen)[:count] for _ in range(cols)], dim=1)


def ignored_targets(n_classes, every=3):
    """Class ids with every `every`-th entry set to ignore_index -100."""
    def init(shape, dtype, generator):
        t = torch.randint(0, n_classes, shape, generator=generator, dtype=torch.int64)
        t.view(-1)[1::every] = -100
        return t
    return init


# ------------------------------------------------------------------------------- functions

def ce_mean(logits, target):
    return F.cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.1)


def ce_sum(logits, target):
    return F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")


def ce_causal_lm(logits, target):
    """HF's causal LM loss shape: (B, S, V) logits flattened to rows."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                           label_smoothing=0.1)


def causal_depthwise(x, w, b=None):
    """Qwen3.5's GatedDeltaNet short convolution: depthwise, padded on the left only."""
    k = w.shape[-1]
    return F.conv1d(x, w, b, padding=k - 1, groups=x.shape[1])[..., : x.shape[-1]]


def tril_triu(x):
    return torch.tril(x, -1) + torch.triu(x, 2) * 2, torch.tril(x, 1), torch.triu(x, -2)


def greater(x, y):
    m = torch.greater(x, y)
    return torch.where(m, x, y * 2), m, x.gt(0.3)


def where_3arg(x, y):
    return torch.where(x > 0, x, y), torch.where(y < 0.5, y, 0.0)


def where_1arg(x):
    rows, cols = torch.where(x > 0.5)
    return rows, cols, x[rows, cols] * 3


def as_bool(x):
    b = x.round().bool()
    return b, b.float() * x, (x > 0).bool()


def one_hot(i):
    return F.one_hot(i, 7).float(), F.one_hot(i, -1)


def one_hot_moe(i):
    """Qwen MoE: expert_mask = one_hot(selected_experts, E).permute(2, 1, 0); tokens per expert."""
    mask = F.one_hot(i, num_classes=6).permute(2, 1, 0)
    return mask, mask.sum(dim=(-1, -2))


def in_place(method, *args, **kwargs):
    """t.method_(*args) on t = args[0] that also checks, in the distributed run, that the in-place op
    kept t's placements (OPERATORS.md: in-place ops keep Layout, DeviceMesh and placements)."""
    def run(t):
        before = t.placements if in_distributed_run() else None
        out = getattr(t, method)(*args, **kwargs)
        if in_distributed_run():
            assert out is t and t.placements == before, f"{method} changed {before} to {t.placements}"
        return out
    return run


def scatter_src_dim1(x, i, src):
    return in_place("scatter_", 1, i, src)(x.clone())


def scatter_src_dim0(x, i, src):
    return x.clone().scatter_(0, i, src)


def scatter_value(x, i):
    return x.clone().scatter_(0, i, 1.5)


def scatter_reduce_add(x, i, src):
    # scatter_ with reduce has no derivative in torch: on detached copies
    return x.detach().clone().scatter_(0, i, src.detach(), reduce="add")


def scatter_value_multiply(x, i):
    return x.detach().clone().scatter_(0, i, 1.5, reduce="multiply")


def scatter_topk(x):
    vals, ids = x.topk(2, dim=1)
    return in_place("scatter_", 1, ids, vals.softmax(-1))(torch.zeros_like(x))


def clamp_(x):
    return in_place("clamp_", min=-0.5, max=0.8)(x.clone()), in_place("clamp_", min=0.1)(x.clone())


def vstack_2d(a, b):
    return torch.vstack([a, b])


def vstack_1d(u, v):
    return torch.vstack([u, v])


def new_zeros(x):
    return x.new_zeros((3, 4)) + 1, x + x.new_zeros(x.shape)


def conversions(x, y):
    """cpu, to (dtype, device), type_as: the DTensor and its values kept; gradients flow back."""
    return x.cpu() * 2, x.to(torch.float64) * y, x.to("cpu") + 1, x.type_as(y) - y, x.to(dtype=BF16).float()


def via_tolist(x):
    return torch.tensor(x.tolist()) * 1.0


def histc_tolist(x):
    """DeepSeek-V3.2: tokens per expert = histc(...) then .tolist() (plain Python counts)."""
    counts = torch.histc(x, bins=4, min=-2, max=2).tolist()
    return torch.tensor([int(c) for c in counts])


def histc(x):
    return torch.histc(x, bins=6, min=-2, max=2), torch.histc(x, bins=5)


def rms_norm(x, w):
    from hypershard import ops
    return ops.rms_norm(x, w, 1e-6)


def rotary_mul(mode):
    def fn(x, r1, r2):
        from hypershard import ops
        return ops.rotary_mul(x, r1, r2, mode)
    return fn


def grouped(x, w, offs):
    return torch._grouped_mm(x, w, offs=offs)


def fallback(x, w, offs):
    importlib.import_module("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


def train_linear(make_optimizer, steps=2):
    """A tiny nn.Linear whose weight and bias are the case's inputs (DTensors in the distributed
    run), `steps` optimizer steps on a mean-square loss; the losses and the parameters after every
    step."""
    def fn(x, w, b):
        lin = torch.nn.Linear(w.shape[1], w.shape[0])
        lin.weight = torch.nn.Parameter(w.detach().clone())
        lin.bias = torch.nn.Parameter(b.detach().clone())
        opt = make_optimizer(lin.parameters())
        out = []
        for _ in range(steps):
            opt.zero_grad()
            loss = replicated(lin(x).pow(2).mean())
            loss.backward()
            opt.step()
            out += [loss.detach(), lin.weight.detach().clone(), lin.bias.detach().clone()]
        if in_distributed_run():
            assert lin.weight.placements == w.placements and lin.bias.placements == b.placements
        return out
    return fn


ADAMW_FOREACH = train_linear(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True))
ADAMW_FUSED = train_linear(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True))

# 11 tokens in 4 experts (expert 2 empty): cumulative ends, GLOBAL, Replicate
OFFS4 = torch.tensor([3, 7, 7, 11], dtype=torch.int32)
OFFS8 = torch.tensor([2, 3, 3, 5, 7, 8, 10, 11], dtype=torch.int32)
OFFS5 = torch.tensor([2, 5, 5, 8, 11], dtype=torch.int32)   # 5 experts: uneven expert shards


# ------------------------------------------------------------------------------- the matrix

COVERED: dict = collections.defaultdict(set)   # requirement op -> mesh tags with a passing-form case
ALL: list = []


def add(ops, tag, name, fn, inputs, expect_error=None, **kwargs):
    case = Case(f"{name}@{tag}", fn, inputs, MESHES[tag], expect_error=expect_error, **kwargs)
    ALL.append(case)
    if expect_error is None:
        for op in (ops if isinstance(ops, tuple) else (ops,)):
            COVERED[op].add(tag)
    return case


def mesh_cases(tag):
    mesh = MESHES[tag]
    B, R = batch(mesh), rep(mesh)
    world = 1
    for s in mesh[0]:
        world *= s
    for size_tag, n in (("even", EVEN[tag]), ("uneven", UNEVEN[tag])):
        s = f"_{size_tag}"
        # cpu / to / type_as
        add(("cpu", "to", "type_as"), tag, "conversions" + s, conversions,
            [Input((n, 3), placements=B), Input((n, 3), torch.float64, placements=B)])
        # cross_entropy: batch-sharded logits and targets
        add("cross_entropy", tag, "ce_batch_mean" + s, ce_mean,
            [Input((n, 7), placements=B), Input((n,), torch.int64, placements=B, init=ignored_targets(7))])
        add("cross_entropy", tag, "ce_batch_sum" + s, ce_sum,
            [Input((n, 7), placements=B), Input((n,), torch.int64, placements=B, init=ignored_targets(7))])
        # gather: index sharded like self (gather dim 1 unsharded); gather along the sharded dim 0
        add("gather", tag, "gather_dim1" + s, lambda x, i: torch.gather(x, 1, i),
            [Input((n, 7), placements=B), idx((n, 3), 7, B)])
        add("gather", tag, "gather_sharded_dim0" + s, lambda x, i: torch.gather(x, 0, i),
            [Input((n, 7), placements=B), idx((3, 7), n, R)])
        # histc
        add("histc", tag, "histc" + s, histc, [Input((n, 6), placements=B)])
        # index_add_ along the sharded dim (GLOBAL, repeated indices) and along dim 1
        add("index_add_", tag, "index_add__dim0" + s,
            lambda x, i, src: x.clone().index_add_(0, i, src, alpha=2.0),
            [Input((n, 6), placements=B), idx((4,), n, R), Input((4, 6), placements=R)])
        add(("index_add_", "index_add"), tag, "index_add_dim1" + s,
            lambda x, i, src: (in_place("index_add_", 1, i, src)(x.clone()), torch.index_add(x, 1, i, src * 0.5)),
            [Input((n, 6), placements=B), idx((3,), 6, R), Input((n, 3), placements=B)])
        # new_zeros
        add("new_zeros", tag, "new_zeros" + s, new_zeros, [Input((n, 3), placements=B)])
        # npu_rms_norm -> hypershard.ops.rms_norm
        add("npu_rms_norm", tag, "rms_norm" + s, rms_norm,
            [Input((n, 3, 8), placements=B), Input((8,), placements=R, init=uniform(0.5, 1.5))])
        # npu_rotary_mul -> hypershard.ops.rotary_mul, (B, S, N, D) sharded on B, tables Replicate
        for mode in ("half", "interleave"):
            add("npu_rotary_mul", tag, f"rotary_mul_{mode}" + s, rotary_mul(mode),
                [Input((n, 3, 2, 8), placements=B), Input((1, 3, 1, 8), placements=R),
                 Input((1, 3, 1, 8), placements=R)])
        # tolist
        add("tolist", tag, "tolist" + s, via_tolist, [Input((n, 3), placements=B)], check_grad=False)
        add(("tolist", "histc"), tag, "histc_tolist" + s, histc_tolist, [Input((n, 6), placements=B)],
            check_grad=False)
        # vstack: 2-D inputs sharded on the stacked dim; 1-D inputs (atleast_2d: a new leading dim)
        add("vstack", tag, "vstack_2d" + s, vstack_2d, [Input((n, 3), placements=B), Input((3, 3), placements=B)])
        add("vstack", tag, "vstack_1d" + s, vstack_1d, [Input((n,), placements=B), Input((n,), placements=B)])
        # conv1d: Qwen3.5's causal depthwise conv, batch sharded
        add("conv1d", tag, "conv1d_causal_depthwise" + s, causal_depthwise,
            [Input((n, 4, 9), placements=B), Input((4, 1, 3), placements=R), Input((4,), placements=R)])
        # softplus
        add("softplus", tag, "softplus" + s, lambda x: (F.softplus(x), F.softplus(x, beta=2.0, threshold=1.0)),
            [Input((n, 5), placements=B)])
        # tril / triu: the batch dim sharded
        add(("tril", "triu"), tag, "tril_triu_batch" + s, tril_triu, [Input((n, 4, 5), placements=B)])
        # greater
        add("greater", tag, "greater" + s, greater, [Input((n, 5), placements=B), Input((n, 5), placements=B)])
        # one_hot
        add("one_hot", tag, "one_hot" + s, one_hot, [idx((n,), 6, B)])
        add("one_hot", tag, "one_hot_moe" + s, one_hot_moe, [idx((n, 2), 6, B)])
        # where
        add("where", tag, "where_3arg" + s, where_3arg, [Input((n, 5), placements=B), Input((n, 5), placements=B)])
        add("where_1arg", tag, "where_1arg" + s, where_1arg, [Input((n, 5), placements=B)])
        # bool
        add("bool", tag, "bool" + s, as_bool, [Input((n, 5), placements=B, init=uniform(-1.5, 1.5))])
        # scatter_: src along dim 1 (index sharded like self), src / value / reduce along the sharded dim 0
        add("scatter_", tag, "scatter_src_dim1" + s, scatter_src_dim1,
            [Input((n, 5), placements=B), fixed(permutations(n, 5, seed=n)[:, :3], B), Input((n, 3), placements=B)])
        add("scatter_", tag, "scatter_src_sharded_dim0" + s, scatter_src_dim0,
            [Input((n, 4), placements=B), fixed(distinct_rows(3, n, 4, seed=n), R), Input((3, 4), placements=R)])
        add("scatter_.value", tag, "scatter_value_sharded_dim0" + s, scatter_value,
            [Input((n, 4), placements=B), fixed(distinct_rows(3, n, 4, seed=n + 1), R)])
        add("scatter_.reduce", tag, "scatter_reduce_add_sharded_dim0" + s, scatter_reduce_add,
            [Input((n, 4), placements=B), idx((5, 4), n, R), Input((5, 4), placements=R)], check_grad=False)
        add("scatter_.reduce", tag, "scatter_value_multiply_sharded_dim0" + s, scatter_value_multiply,
            [Input((n, 4), placements=B), idx((5, 4), n, R)], check_grad=False)
        add("scatter_", tag, "scatter_topk" + s, scatter_topk, [Input((n, 6), placements=B)])
        # clamp_
        add("clamp_", tag, "clamp_" + s, clamp_, [Input((n, 5), placements=B)])
        # AdamW on a tiny nn.Linear: x batch sharded, weight/bias sharded on out-features (the last axis)
        wp = ["R"] * (len(mesh[0]) - 1) + ["S(0)"]
        for name, make in (("adamw_foreach", ADAMW_FOREACH), ("adamw_fused", ADAMW_FUSED)):
            add("adamw" if name == "adamw_foreach" else "fused_adamw", tag, name + s, make,
                [Input((n, 6), placements=B, requires_grad=False), Input((5, 6), placements=wp),
                 Input((5,), placements=wp)], check_grad=False)

    # cross_entropy, vocab-parallel: logits sharded on the vocab (7: uneven; 16: even), targets Replicate
    for v in (7, 16):
        add("cross_entropy", tag, f"ce_vocab{v}_mean", ce_mean,
            [Input((6, v), placements=batch(mesh, 1)), Input((6,), torch.int64, placements=R, init=ignored_targets(v))])
    # (B, S, V) logits, HF's causal LM loss: batch on the first axis, vocab on the others (2-D/3-D)
    lp = ["S(0)"] + ["S(2)"] * (len(mesh[0]) - 1)
    tp = ["S(0)"] + ["R"] * (len(mesh[0]) - 1)
    add("cross_entropy", tag, "ce_causal_lm_batch_vocab", ce_causal_lm,
        [Input((UNEVEN[tag], 3, 7), placements=lp), Input((UNEVEN[tag], 3), torch.int64, placements=tp,
                                                          init=ignored_targets(7))])
    # tril / triu with the last two dims sharded (rows 6, cols 5: uneven on 4 ranks)
    if len(mesh[0]) == 1:
        for d in (1, 2):
            add(("tril", "triu"), tag, f"tril_triu_dim{d}", tril_triu, [Input((2, 6, 5), placements=[f"S({d})"])])
    else:
        lay = ["S(1)", "S(2)"] if len(mesh[0]) == 2 else ["S(0)", "S(1)", "S(2)"]
        add(("tril", "triu"), tag, "tril_triu_last_two", tril_triu, [Input((2, 6, 5), placements=lay)])
        add(("tril", "triu"), tag, "tril_triu_last_two_swapped", tril_triu,
            [Input((2, 6, 5), placements=list(reversed(lay[-2:])) if len(lay) == 2 else ["S(0)", "S(2)", "S(1)"])])
    # grouped matmuls: weights (E, K, N) expert-sharded on dim 0, N on the last axis of a 2-D/3-D mesh
    e, offs = (8, OFFS8) if world == 8 else (4, OFFS4)
    naxes = len(mesh[0])
    expert = ["S(0)"] * (naxes - 1 if naxes > 1 else 1) + (["S(2)"] if naxes > 1 else [])
    colwise = ["R"] * (naxes - 1) + ["S(2)"]
    # N = 12: 48-byte rows as torch's CPU reference kernel needs; 6/3-wide shards run the rule's loop
    w = lambda p: Input((e, 8, 12), placements=p)  # noqa: E731
    x = Input((11, 8), placements=R)
    add("_grouped_mm", tag, "grouped_mm_expert", grouped, [x, w(expert), fixed(offs, R)])
    add("_grouped_mm", tag, "grouped_mm_colwise", grouped, [x, w(colwise), fixed(offs, R)])
    add("grouped_mm_fallback", tag, "fallback_colwise", fallback, [x, w(colwise), fixed(offs, R)])
    add("grouped_mm_fallback", tag, "fallback_expert", fallback, [x, w(expert), fixed(offs, R)])
    # 5 experts: uneven expert shards (3+2; 2+2+1+0 on 4 shards)
    w5 = Input((5, 8, 12), placements=expert)
    add("_grouped_mm", tag, "grouped_mm_expert_uneven", grouped, [x, w5, fixed(OFFS5, R)])
    add("grouped_mm_fallback", tag, "fallback_expert_uneven", fallback, [x, w5, fixed(OFFS5, R)])
    # tokens sharded on their leading dim (11: uneven everywhere): expert parallelism is not a local
    # rule, the tokens are gathered
    xb = Input((11, 8), placements=B)
    add("_grouped_mm", tag, "grouped_mm_tokens_sharded", grouped, [xb, w(expert), fixed(offs, R)])
    add("grouped_mm_fallback", tag, "fallback_tokens_sharded", fallback, [xb, w(colwise), fixed(offs, R)])

    # bfloat16, one case per family (BF16_NOTE)
    n = UNEVEN[tag]
    add("cross_entropy", tag, "bf16_ce_vocab", ce_mean,
        [Input((6, 7), BF16, placements=batch(mesh, 1)),
         Input((6,), torch.int64, placements=R, init=ignored_targets(7))],
        atol=BF16_CE_ATOL)
    add("cross_entropy", tag, "bf16_ce_batch", ce_mean,
        [Input((n, 7), BF16, placements=B), Input((n,), torch.int64, placements=B, init=ignored_targets(7))],
        atol=BF16_CE_ATOL)
    add("npu_rms_norm", tag, "bf16_rms_norm", rms_norm,
        [Input((n, 3, 8), BF16, placements=B), Input((8,), BF16, placements=R, init=uniform(0.5, 1.5))],
        # the weight gradient: a Partial(sum) over the batch shards reduced in bf16 (BF16_NOTE), |g| < 16
        atol=BF16_PARTIAL_ATOL_M16)
    add("npu_rotary_mul", tag, "bf16_rotary_mul", rotary_mul("half"),
        [Input((n, 3, 2, 8), BF16, placements=B), Input((1, 3, 1, 8), BF16, placements=R),
         Input((1, 3, 1, 8), BF16, placements=R)],
        # r1/r2 gradients: Partial(sum) over the batch shards reduced in bf16 (BF16_NOTE), |g| < 16
        atol=BF16_PARTIAL_ATOL_M16)
    add("conv1d", tag, "bf16_conv1d_causal_depthwise", causal_depthwise,
        [Input((n, 4, 9), BF16, placements=B), Input((4, 1, 3), BF16, placements=R), Input((4,), BF16, placements=R)],
        # weight/bias gradients: Partial(sum) over the batch shards reduced in bf16 (BF16_NOTE), |g| < 32
        atol=BF16_PARTIAL_ATOL_M32)
    add(("softplus", "clamp_", "greater", "where", "tril", "triu"), tag, "bf16_pointwise",
        lambda x, y: (F.softplus(x), clamp_(x)[0], torch.where(torch.greater(x, y), x, y), torch.tril(x, 1)),
        [Input((n, 5), BF16, placements=B), Input((n, 5), BF16, placements=B)])
    add(("cpu", "to", "type_as"), tag, "bf16_conversions", lambda x, y: (x.cpu(), x.float() * 2, y.type_as(x)),
        [Input((n, 3), BF16, placements=B), Input((n, 3), placements=B)])
    add(("gather", "scatter_.value", "index_add_", "vstack"), tag, "bf16_indexing",
        lambda x, i, src: (torch.gather(x, 0, i), x.clone().index_add_(0, i[:, 0], src),
                           x.clone().scatter_(0, i, 2.0), torch.vstack([x, src])),
        [Input((n, 4), BF16, placements=B), idx((3, 4), n, R), Input((3, 4), BF16, placements=R)])
    # N = 16: bf16 rows of 32 bytes (the CPU reference kernel's 16-byte stride rule)
    add("_grouped_mm", tag, "bf16_grouped_mm_expert", grouped,
        [Input((11, 8), BF16, placements=R), Input((e, 8, 16), BF16, placements=expert), fixed(offs, R)],
        # the tokens' gradient on 2-D/3-D meshes: a Partial(sum) over the N shards in bf16 (BF16_NOTE), |g| < 16
        atol=BF16_PARTIAL_ATOL_M16)

    # Partial inputs: accepted where the algebra allows (values equal one device) ...
    P = ["P"] + ["R"] * (naxes - 1)
    PMAX = ["P(max)"] + ["R"] * (naxes - 1)
    add("tolist", tag, "partial_tolist", via_tolist, [Input((n, 3), placements=P)], check_grad=False)
    add(("cpu", "to", "type_as"), tag, "partial_conversions", conversions,
        [Input((n, 3), placements=P), Input((n, 3), torch.float64, placements=R)])
    add("clamp_", tag, "partial_max_clamp_", clamp_, [Input((n, 5), placements=PMAX)], check_grad=False)
    add(("tril", "triu"), tag, "partial_tril_triu", tril_triu, [Input((2, 6, 5), placements=P)])
    add("vstack", tag, "partial_vstack", vstack_2d, [Input((n, 3), placements=P), Input((3, 3), placements=P)])
    add("new_zeros", tag, "partial_new_zeros", new_zeros, [Input((n, 3), placements=P)])
    # linear in the tokens: a Partial(sum) token input gives a Partial(sum) product
    add("_grouped_mm", tag, "partial_grouped_mm", grouped,
        [Input((11, 8), placements=P), Input((e, 8, 12), placements=colwise), fixed(offs, R)])
    add("grouped_mm_fallback", tag, "partial_fallback", fallback,
        [Input((11, 8), placements=P), Input((e, 8, 12), placements=colwise), fixed(offs, R)])
    # ... and refused with the house error where it does not
    refused = [
        ("histc", histc, [Input((n, 6), placements=P)], "a histogram of a Partial tensor counts its parts"),
        ("one_hot", one_hot, [Input((n,), torch.int64, placements=P, init=randint(0, 6))],
         "hypershard: aten::one_hot: argument self (#0)"),
        ("softplus", F.softplus, [Input((n, 5), placements=P)], "aten::softplus: argument self (#0)"),
        ("greater", greater, [Input((n, 5), placements=P), Input((n, 5), placements=R)],
         "aten::gt.Tensor: argument self (#0)"),
        ("bool", lambda x: x.bool(), [Input((n, 5), placements=P)], "aten::_to_copy: argument self (#0)"),
        ("clamp_", clamp_, [Input((n, 5), placements=P)], "aten::clamp_: argument self (#0)"),
        ("npu_rms_norm", rms_norm, [Input((n, 3, 8), placements=P), Input((8,), placements=R)],
         "hypershard::rms_norm: argument x (#0)"),
        ("npu_rotary_mul", rotary_mul("half"), [Input((n, 3, 2, 8), placements=P), Input((1, 3, 1, 8), placements=R),
                                                Input((1, 3, 1, 8), placements=R)],
         "argument x (#0)"),
        ("cross_entropy", ce_mean, [Input((n, 7), placements=P), Input((n,), torch.int64, placements=R,
                                                                        init=ignored_targets(7))],
         "aten::_log_softmax: argument self (#0)"),
        # documented (docs/operators.md, along_dims): gather is refused a sum Partial self
        ("gather", lambda x, i: torch.gather(x, 1, i), [Input((n, 7), placements=P), idx((n, 3), 7, R)],
         "aten::gather: argument self (#0)"),
        # documented (docs/operators.md, convolution): the bias is added once, so a sum Partial input
        # is refused, bias or not
        ("conv1d", causal_depthwise, [Input((n, 4, 9), placements=P), Input((4, 1, 3), placements=R)],
         "aten::convolution: argument input (#0)"),
    ]
    if tag in ("2", "2x2"):   # the refusals are the same on every mesh: two meshes suffice
        for op, fn, inputs, text in refused:
            add(op, tag, f"partial_refused_{op}", fn, inputs, expect_error=text)


for _tag in MESHES:
    mesh_cases(_tag)
CASES = {case.name: case for case in ALL}
COUNTS = collections.Counter(name.split("@")[1] for name in CASES)
ERRORS = sum(case.expect_error is not None for case in ALL)

LAUNCH_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def results():
    return run_cases(list(CASES.values()), backend="hypershard", timeout=LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("name", list(CASES))
def test_case(results, name):
    results.check(name)


def test_every_requirement_op_on_every_mesh():
    missing = [(op, tag) for op in REQUIREMENT_OPS for tag in MESHES if tag not in COVERED[op]]
    assert not missing, f"requirement ops without a case: {missing}"


def test_case_counts():
    assert dict(COUNTS) == {"2": 109, "4": 98, "2x2": 109, "2x2x2": 98}, dict(COUNTS)
    assert ERRORS == 22
