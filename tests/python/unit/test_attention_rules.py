"""UT: the attention rule (csrc/ops/attention.cpp) for the kernels F.scaled_dot_product_attention
lowers to on CUDA and PrivateUse1 backends, and for torch_npu's fusion attention, without
processes or a GPU.

The CUDA ops' schemas (and Meta kernels, which the rule asks for its extra outputs' shapes) are in
every torch build, so each row plans the real aten op on meta DTensors of a mesh without process
groups (hypershard.testing.planning): _scaled_dot_product_flash_attention,
_scaled_dot_product_efficient_attention, _scaled_dot_product_cudnn_attention,
_scaled_dot_product_fused_attention_overrideable and their _backward ops, each checked for:
batch (dp) and heads (tp) sharding of query/key/value, output and logsumexp; grouped key/value
heads sharded alike (4 query / 2 KV heads on tp=2); the replicated-KV case (4 / 2 heads on tp=4:
key/value whole, an expand that reads each rank's KV heads, their gradients Partial(sum)); a
mask / attn_bias cut to the batch and heads shards or kept whole where it broadcasts (its
gradient Partial(sum) then); a Partial(sum) grad_out carried into every gradient; the extra
outputs (rng state, philox seed/offset) Replicate; context parallelism (the query's sequence
sharded: key/value gathered, their gradients reduce-scattered back; the flash kernel's causal call
and the efficient kernel's blocks off its 32-row padding not covered); and the refusals: a sharded
head dim, a Partial query, grouped heads that cannot be split, dropout with anything sharded (not
covered: default mode gathers, strict mode raises).

torch_npu's npu_fusion_attention(_grad) are absent without torch_npu: they are planned through
stand-ins of torch_npu's schemas (hypershard.testing.fused.define_npu_standins, schemas only, no
kernels), in every input_layout (BNSD, BSND, BSH/SBH with heads and head dim merged, TND),
with head_num localized to each rank's heads.
"""

from __future__ import annotations

import pytest
import torch

import hypershard as hs
from hypershard.testing.fused import NPU_FUSION_ATTENTION_SCHEMAS, define_npu_standins
from hypershard.testing.planning import Arg as T
from hypershard.testing.planning import PlanningMesh, plan, realise
from hypershard.testing.planning import spec as S

aten = torch.ops.aten
MESHES = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "tp4": {"tp": 4}, "dp2tp2": {"dp": 2, "tp": 2}}
B, L, E = 4, 8, 8


def q(heads=4, spec=None, shape=None):
    return T(shape or [B, heads, L, E], spec)


def _run(mesh_key, op, args, kwargs=None, rank=0):
    mesh = PlanningMesh(MESHES[mesh_key], rank=rank)
    return plan(op, *[realise(a, mesh) for a in args], **{k: realise(v, mesh) for k, v in (kwargs or {}).items()})


# --------------------------------------------------------------------------- the CUDA kernels
#
# Each kernel: (forward op, its arguments from (query, key, value, mask, dropout_p), the index of
# logsumexp among the returns, backward op, its arguments from (grad, q, k, v, mask, out, lse, fwd
# outputs), the number of gradients).

def _flash_args(qq, kk, vv, mask, dropout=0.0):
    assert mask is None
    return (qq, kk, vv, dropout, True, False)


def _efficient_args(qq, kk, vv, mask, dropout=0.0):
    return (qq, kk, vv, mask, True, dropout, False)


def _cudnn_args(qq, kk, vv, mask, dropout=0.0):
    return (qq, kk, vv, mask, True, dropout, False, False)


def _overrideable_args(qq, kk, vv, mask, dropout=0.0):
    return (qq, kk, vv, mask, dropout, False, False)


def _flash_bwd(g, qq, kk, vv, mask, out, lse, aux):
    return (g, qq, kk, vv, out, lse, None, None, L, L, 0.0, True, aux, aux)


def _efficient_bwd(g, qq, kk, vv, mask, out, lse, aux):
    return (g, qq, kk, vv, mask, out, lse, aux, aux, 0.0, [True, True, True, mask is not None], False)


def _cudnn_bwd(g, qq, kk, vv, mask, out, lse, aux):
    return (g, qq, kk, vv, out, lse, aux, aux, mask, None, None, L, L, 0.0, False)


def _overrideable_bwd(g, qq, kk, vv, mask, out, lse, aux):
    return (g, qq, kk, vv, mask, [True, True, True, mask is not None], out, lse, None, None, L, L, 0.0, False, aux,
            aux)


# name: (forward, args, takes a mask, logsumexp shape of (b, h), backward, args, gradients)
KERNELS = {
    "flash": (aten._scaled_dot_product_flash_attention.default, _flash_args, False, lambda b, h: [b, h, L],
              aten._scaled_dot_product_flash_attention_backward.default, _flash_bwd, 3),
    "efficient": (aten._scaled_dot_product_efficient_attention.default, _efficient_args, True,
                  lambda b, h: [b, h, 32], aten._scaled_dot_product_efficient_attention_backward.default,
                  _efficient_bwd, 4),
    "cudnn": (aten._scaled_dot_product_cudnn_attention.default, _cudnn_args, True, lambda b, h: [b, h, L, 1],
              aten._scaled_dot_product_cudnn_attention_backward.default, _cudnn_bwd, 3),
    "overrideable": (aten._scaled_dot_product_fused_attention_overrideable.default, _overrideable_args, True,
                     lambda b, h: [b, h, L], aten._scaled_dot_product_fused_attention_overrideable_backward.default,
                     _overrideable_bwd, 4),
}
MASKED = [name for name, k in KERNELS.items() if k[2]]


def _forward(kernel, mesh_key, qq, kk, vv, mask=None, dropout=0.0):
    op, args, *_ = KERNELS[kernel]
    return _run(mesh_key, op, args(qq, kk, vv, mask, dropout))


def _backward(kernel, mesh_key, qq, kk, vv, mask=None, grad=None, lse_spec=None):
    _, _, _, lse_shape, op, args, _ = KERNELS[kernel]
    out = T(qq.shape, qq.spec)
    lse = T(lse_shape(qq.shape[0], qq.shape[1]), lse_spec if lse_spec is not None else qq.spec)
    aux = T([], ["R"] * len(qq.spec), torch.int64)
    return _run(mesh_key, op, args(grad or T(qq.shape, qq.spec), qq, kk, vv, mask, out, lse, aux))


# (id, mesh, query spec, KV heads, KV spec, planned [q, k, v], output spec, expands)
LAYOUT_ROWS = [
    ("batch_dp2", "dp2", S(0), 4, S(0), [S(0)] * 3, S(0), False),
    ("heads_tp4", "tp4", S(1), 4, S(1), [S(1)] * 3, S(1), False),
    ("batch_and_heads", "dp2tp2", S(0, 1), 4, S(0, 1), [S(0, 1)] * 3, S(0, 1), False),
    ("replicate", "dp2tp2", S(None, None), 4, S(None, None), [S(None, None)] * 3, S(None, None), False),
    # grouped heads: 2 KV heads split over tp=2 alike, one group per rank
    ("grouped_heads_tp2", "dp2tp2", S(0, 1), 2, S(0, 1), [S(0, 1)] * 3, S(0, 1), False),
    # 2 KV heads, 4 head shards: key/value whole on the heads, each rank reads its group's KV head
    ("replicated_kv_tp4", "tp4", S(1), 2, S(1), [S(1), S(None), S(None)], S(1), True),
    ("replicated_kv_given_whole", "tp4", S(1), 2, S(None), [S(1), S(None), S(None)], S(1), True),
    # a replicated query follows the sharded key (the cheapest plan: nothing moved but the query)
    ("query_follows_batch_shard", "dp2", S(None), 4, S(0), [S(0)] * 3, S(0), False),
    # a max Partial query is reduced (only sum/avg are errors)
    ("partial_max_query_reduced", "dp2tp2", S(0, "P(max)"), 4, S(0, None), [S(0, None)] * 3, S(0, None), False),
]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("name,mesh_key,q_spec,kv_heads,kv_spec,planned,out_spec,expands",
                         [pytest.param(*r, id=r[0]) for r in LAYOUT_ROWS])
def test_forward_layouts(kernel, name, mesh_key, q_spec, kv_heads, kv_spec, planned, out_spec, expands):
    result = _forward(kernel, mesh_key, q(4, q_spec), q(kv_heads, kv_spec), q(kv_heads, kv_spec))
    assert result.input_specs == planned
    specs = result.output_specs
    assert specs[0] == out_spec and specs[1] == out_spec  # output and logsumexp: per (batch, head) row
    whole = ["R"] * len(out_spec)
    assert all(s == whole for s in specs[2:]), specs  # rng state / philox seed and offset
    assert result.expands == expands and result.refused == "" and not result.localizes
    shapes = [list(o.global_shape) for o in result.outputs]
    assert shapes[0] == [B, 4, L, E] and shapes[1] == KERNELS[kernel][3](B, 4)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("name,mesh_key,q_spec,kv_heads,kv_spec,planned,out_spec,expands",
                         [pytest.param(*r, id=r[0]) for r in LAYOUT_ROWS if "partial" not in r[0]])
def test_backward_layouts(kernel, name, mesh_key, q_spec, kv_heads, kv_spec, planned, out_spec, expands):
    result = _backward(kernel, mesh_key, q(4, out_spec), q(kv_heads, kv_spec), q(kv_heads, kv_spec))
    grads = result.output_specs[:3]
    if expands:  # each rank's key/value gradient covers its KV heads: summed over the head shards
        assert grads == [out_spec, S("P"), S("P")]
    else:
        assert grads == [out_spec] * 3
    assert result.expands == expands
    assert [list(o.global_shape) for o in result.outputs[:3]] == [[B, 4, L, E], [B, kv_heads, L, E],
                                                                  [B, kv_heads, L, E]]
    assert len(result.outputs) == KERNELS[kernel][6]


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_backward_carries_a_partial_grad(kernel):
    # linear in grad_out: a Partial(sum) grad with the rest whole on that axis stays Partial
    result = _backward(kernel, "dp2tp2", q(4, S(0, None)), q(4, S(0, None)), q(4, S(0, None)),
                       grad=q(4, S(0, "P")))
    assert result.output_specs[:3] == [S(0, "P")] * 3
    assert result.input_specs[0] == S(0, "P")


# --- masks: attn_bias broadcast to (batch, heads, L, S) ------------------------------------------

# (id, mesh, query spec, mask shape, mask spec, planned mask spec, grad_attn_bias spec)
MASK_ROWS = [
    # a full (b, h, L, S) mask is cut to the query's batch and heads shards (no communication)
    ("full_mask_cut_to_batch", "dp2", S(0), [B, 4, L, L], S(None), S(0), S(0)),
    ("full_mask_cut_to_heads", "tp4", S(1), [B, 4, L, L], S(None), S(1), S(1)),
    ("full_mask_sharded_alike", "dp2tp2", S(0, 1), [B, 4, L, L], S(0, 1), S(0, 1), S(0, 1)),
    # a padding mask (b, 1, L, S): batch sharded with the query, its broadcast heads dim whole;
    # its gradient sums over the heads shards
    ("padding_mask_batch", "dp2tp2", S(0, 1), [B, 1, L, L], S(0, None), S(0, None), S(0, "P")),
    # a causal (1, 1, L, S) or (L, S) mask broadcasts everywhere: whole, its gradient Partial(sum)
    ("broadcast_mask", "dp2tp2", S(0, 1), [1, 1, L, L], S(None, None), S(None, None), S("P", "P")),
    ("two_dim_mask", "dp2", S(0), [L, L], S(None), S(None), S("P")),
]


@pytest.mark.parametrize("kernel", MASKED)
@pytest.mark.parametrize("name,mesh_key,q_spec,m_shape,m_spec,planned,grad_spec",
                         [pytest.param(*r, id=r[0]) for r in MASK_ROWS])
def test_masks(kernel, name, mesh_key, q_spec, m_shape, m_spec, planned, grad_spec):
    mask = T(m_shape, m_spec)
    result = _forward(kernel, mesh_key, q(4, q_spec), q(4, q_spec), q(4, q_spec), mask)
    assert result.input_specs == [q_spec] * 3 + [planned]
    assert result.output_specs[0] == q_spec
    backward = _backward(kernel, mesh_key, q(4, q_spec), q(4, q_spec), q(4, q_spec), mask)
    assert backward.output_specs[:3] == [q_spec] * 3
    if KERNELS[kernel][6] == 4:  # grad_attn_bias, laid out like attn_bias
        assert backward.output_specs[3] == grad_spec
        assert list(backward.outputs[3].global_shape) == m_shape


def test_efficient_logsumexp_without_compute_log_sumexp():
    # compute_log_sumexp=False: an empty (b, h, 0) logsumexp, still per row (and keyed: a plan
    # cached with True must not serve False)
    qq = q(4, S(0))
    result = _run("dp2", aten._scaled_dot_product_efficient_attention.default, (qq, qq, qq, None, False, 0.0, False))
    assert list(result.outputs[1].global_shape) == [B, 4, 0] and result.output_specs[1] == S(0)


# --- refusals ----------------------------------------------------------------------------------

ALLOWED = "; allowed: batch (dim 0), heads (dim 1) or sequence (dim 2) sharded"

# (id, mesh, query, kv heads, kv spec, mask, text pieces after "hypershard: <op>: ")
ERROR_ROWS = [
    ("head_dim_sharded", "tp4", q(4, S(3)), 4, S(3), None,
     ["argument query (#0) [4, 4, 8, 8] (\"None\", \"None\", \"None\", \"tp\"): dim 3 (head_dim) is sharded; "
      "attention needs whole head dims" + ALLOWED]),
    ("partial_query", "tp4", q(4, S("P")), 4, S(None), None,
     ["argument query (#0)", "Partial(sum) input is not supported by attention (it is not linear in it); allowed: "
      "Replicate or Shard on batch/heads (redistribute the Partial input first)"]),
    # 6 query / 2 KV heads on tp=4: rank 1's query heads 2-3 read KV heads 0 and 1
    ("grouped_heads_unsplittable", "tp4", q(6, S(1)), 2, S(1), None,
     ["argument key (#1)", "2 key/value heads (grouped under 6 query heads) cannot be split evenly over 4 shards"]),
    ("mask_broadcast_dim_sharded", "dp2tp2", q(4, S(0, 1)), 4, S(0, 1), T([B, 1, L, L], S(None, 1)),
     ["argument attn_bias (#3)", "dim 1 (broadcast) is sharded"]),
]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("name,mesh_key,qq,kv_heads,kv_spec,mask,pieces", [pytest.param(*r, id=r[0]) for r in ERROR_ROWS])
def test_refusals(kernel, name, mesh_key, qq, kv_heads, kv_spec, mask, pieces):
    if mask is not None and not KERNELS[kernel][2]:
        pytest.skip("the flash kernel takes no mask")
    op = KERNELS[kernel][0]
    with pytest.raises((hs.LayoutError, RuntimeError)) as raised:
        _forward(kernel, mesh_key, qq, q(kv_heads, kv_spec, [B, kv_heads] + qq.shape[2:]),
                 q(kv_heads, kv_spec, [B, kv_heads] + qq.shape[2:]), mask)
    text = str(raised.value)
    assert text.startswith(f"hypershard: {op._schema.name}: " + pieces[0]), text
    for piece in pieces[1:]:
        assert piece in text, (piece, text)


# --- context parallelism: the query's sequence sharded, key/value gathered on S ----------------
#
# The all-gather-KV plan the CPU kernel makes (test_rules.py, level0 test_context_parallel.py):
# query and output stay sharded on L, key/value are gathered; in the backward the key/value
# gradients are reduce-scattered back onto S (the expand). 64 rows: tp=2 blocks of 32, which the
# efficient kernel's logsumexp padding (32 rows per call) lines up with.

CP_L = 64
CP_MAX_Q = {"flash": 8, "cudnn": 11, "overrideable": 10}  # where the backward takes max_q, max_k
CP_LSE = {"flash": [B, 4, CP_L], "efficient": [B, 4, CP_L], "cudnn": [B, 4, CP_L, 1], "overrideable": [B, 4, CP_L]}


def _cp(spec, length=CP_L):
    return T([B, 4, length, E], spec)


def _cp_forward_args(kernel, qq, causal):
    if kernel == "flash":
        return (qq, qq, qq, 0.0, causal, False)
    args = list(KERNELS[kernel][1](qq, qq, qq, None))
    args[6 if kernel != "overrideable" else 5] = causal  # is_causal
    return tuple(args)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("causal", [False, True])
def test_sequence_sharded_gathers_kv(kernel, causal):
    if kernel == "flash" and causal:
        pytest.skip("test_flash_causal_sequence_is_not_covered")
    qq = _cp(S(2))
    result = _run("tp2", KERNELS[kernel][0], _cp_forward_args(kernel, qq, causal))
    assert result.input_specs == [S(2), S(None), S(None)]
    assert result.output_specs[:2] == [S(2), S(2)]  # output and logsumexp: this rank's rows
    assert result.expands  # is_causal becomes a mask from global positions (the CPU kernel's decides per call)
    assert list(result.outputs[1].global_shape) == CP_LSE[kernel]


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_sequence_sharded_backward_scatters_kv(kernel):
    qq = _cp(S(2))
    aux = T([], ["R"], torch.int64)
    lse = T(CP_LSE[kernel], S(2))
    args = list(KERNELS[kernel][5](qq, qq, qq, qq, None, qq, lse, aux))
    if kernel in CP_MAX_Q:  # max_q, max_k: the global lengths
        args[CP_MAX_Q[kernel]:CP_MAX_Q[kernel] + 2] = [CP_L, CP_L]
    if kernel == "flash":
        args[11] = False  # is_causal
    result = _run("tp2", KERNELS[kernel][4], tuple(args))
    assert result.input_specs[:4] == [S(2), S(2), S(None), S(None)]  # grad_out, query, key, value
    assert result.output_specs[:3] == [S(2)] * 3  # key/value gradients reduce-scattered onto S
    assert result.expands


def test_key_sequence_sharded_is_gathered():
    # the query sharded on the batch, key/value on S over the same axis: key/value are gathered
    # on S and cut to the batch
    for kernel in KERNELS:
        result = _forward(kernel, "dp2", q(4, S(0)), q(4, S(2)), q(4, S(2)))
        assert result.input_specs == [S(0)] * 3, kernel


def test_mask_sequence_sharded_is_gathered():
    mask = T([B, 1, L, L], S(3))
    for kernel in MASKED:
        result = _forward(kernel, "dp2", q(4, S(0)), q(4, S(0)), q(4, S(0)), mask)
        assert result.input_specs == [S(0)] * 3 + [S(0)], kernel


def test_flash_causal_sequence_is_not_covered():
    # the flash kernel takes no mask: a causal call cannot be given this rank's global positions
    qq = _cp(S(2))
    with pytest.raises((hs.LayoutError, RuntimeError),
                       match=r"Missing operator aten::_scaled_dot_product_flash_attention for these arguments "
                             r"\(is_causal with the query's sequence sharded"):
        _run("tp2", KERNELS["flash"][0], _cp_forward_args("flash", qq, True))


def test_efficient_sequence_blocks_off_its_padding_are_not_covered():
    # 8 rows on tp=2: blocks of 4, whose logsumexp the kernel pads to 32 rows each
    qq = _cp(S(2), length=L)
    with pytest.raises((hs.LayoutError, RuntimeError),
                       match=r"Missing operator aten::_scaled_dot_product_efficient_attention for these arguments "
                             r"\(the query's sequence sharded in blocks that are not multiples of 32 rows"):
        _run("tp2", KERNELS["efficient"][0], _cp_forward_args("efficient", qq, False))


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_dropout_with_sharding_is_not_covered(kernel):
    # the kernel would draw its dropout mask per rank over the local shape: not one device's draw
    qq = q(4, S(0))
    with pytest.raises((hs.LayoutError, RuntimeError),
                       match=r"Missing operator aten::_scaled_dot_product_\w+ for these arguments \(dropout inside "
                             r"the attention kernel with sharded inputs"):
        _forward(kernel, "dp2", qq, qq, qq, dropout=0.1)
    # ... and in the backward, which replays that mask
    _, _, _, lse_shape, op, args, _ = KERNELS[kernel]
    bwd_args = list(args(qq, qq, qq, qq, None, qq, T(lse_shape(B, 4), S(0)), T([], ["R"], torch.int64)))
    bwd_args[[a is not None and isinstance(a, float) for a in bwd_args].index(True)] = 0.1  # dropout_p
    with pytest.raises((hs.LayoutError, RuntimeError), match="dropout inside the attention kernel"):
        _run("dp2", op, bwd_args)
    # everything whole: the local call is one device's call
    whole = q(4, S(None))
    assert _forward(kernel, "dp2", whole, whole, whole, dropout=0.1).output_specs[0] == S(None)


def test_plans_do_not_depend_on_the_rank():
    for kernel in KERNELS:
        seen = {tuple(layout.to_string() for layout in p.inputs + p.outputs)
                for p in (_run("tp4", KERNELS[kernel][0], KERNELS[kernel][1](q(4, S(1)), q(2, S(1)), q(2, S(1)), None),
                               rank=rank) for rank in range(4))}
        assert len(seen) == 1, (kernel, seen)


def test_cpu_kernel_keeps_its_plans():
    # the CPU kernel shares the rule: the same rows plan alike
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    for mesh_key, q_spec, kv_heads, kv_spec, planned, expands in (("dp2tp2", S(0, 1), 4, S(0, 1), [S(0, 1)] * 3, False),
                                                                  ("tp4", S(1), 2, S(1), [S(1), S(None), S(None)], True)):
        result = _run(mesh_key, op, (q(4, q_spec), q(kv_heads, kv_spec), q(kv_heads, kv_spec), 0.0, True))
        assert result.input_specs == planned and result.expands == expands
        assert result.output_specs == [q_spec, q_spec]


# --------------------------------------------------------------------------- torch_npu's fusion attention


@pytest.fixture(scope="module")
def npu():
    """torch.ops.npu with torch_npu's fusion-attention schemas (stand-ins without kernels where
    torch_npu is absent)."""
    return define_npu_standins(NPU_FUSION_ATTENTION_SCHEMAS)


N, D = 4, 8
SHAPES = {  # (query shape with N heads, key shape with NKV heads) per input_layout
    "BNSD": lambda n: [B, n, L, D],
    "BSND": lambda n: [B, L, n, D],
    "BSH": lambda n: [B, L, n * D],
    "SBH": lambda n: [L, B, n * D],
    "TND": lambda n: [B * L, n, D],
}
BATCH_DIM = {"BNSD": 0, "BSND": 0, "BSH": 0, "SBH": 1}
HEADS_DIM = {"BNSD": 1, "BSND": 2, "BSH": 2, "SBH": 2, "TND": 1}


def _npu_fwd(npu, mesh_key, layout, q_spec, kv_spec=None, kv_heads=N, **kwargs):
    kv_spec = kv_spec if kv_spec is not None else q_spec
    qq = T(SHAPES[layout](N), q_spec)
    kk = T(SHAPES[layout](kv_heads), kv_spec)
    return _run(mesh_key, npu.npu_fusion_attention.default, (qq, kk, T(kk.shape, kv_spec), N, layout), kwargs)


@pytest.mark.parametrize("layout", list(SHAPES))
def test_npu_heads_sharded_and_head_num_localized(npu, layout):
    h = HEADS_DIM[layout]
    result = _npu_fwd(npu, "tp2", layout, S(h))
    assert result.input_specs == [S(h)] * 3
    stats = S(1)  # softmax_max/sum (B, N, S, 8), TND (T, N, 8): N is dim 1
    assert result.output_specs == [S(h), stats, stats, S(None)]
    assert result.localizes  # head_num -> this rank's N / 2 heads
    expected = [SHAPES[layout](N), [B, N, L, 8], [B, N, L, 8], [0]] if layout != "TND" else \
        [SHAPES[layout](N), [B * L, N, 8], [B * L, N, 8], [0]]
    assert [list(o.global_shape) for o in result.outputs] == expected


@pytest.mark.parametrize("layout", list(BATCH_DIM))
def test_npu_batch_sharded(npu, layout):
    b = BATCH_DIM[layout]
    result = _npu_fwd(npu, "dp2", layout, S(b))
    assert result.input_specs == [S(b)] * 3
    assert result.output_specs == [S(b), S(0), S(0), S(None)]
    assert not result.localizes  # the heads are whole: head_num stands


def test_npu_grouped_and_replicated_kv(npu):
    # BSND with 4 query / 2 KV heads: tp=2 splits them alike; tp=4 keeps key/value whole
    alike = _npu_fwd(npu, "tp2", "BSND", S(2), kv_heads=2)
    assert alike.input_specs == [S(2)] * 3 and not alike.expands
    replicated = _npu_fwd(npu, "tp4", "BSND", S(2), kv_heads=2)
    assert replicated.input_specs == [S(2), S(None), S(None)] and replicated.expands and replicated.localizes
    # merged heads: H = N x D blocks; 2 KV heads of 8 over tp=4 cannot be split, key/value stay whole
    merged = _npu_fwd(npu, "tp4", "BSH", S(2), kv_heads=2)
    assert merged.input_specs == [S(2), S(None), S(None)] and merged.expands


def test_npu_masks(npu):
    # atten_mask (B, 1, S, S) follows the batch; the 2048 x 2048 compressed causal mask stays whole;
    # pse (1, N, S, S) follows the heads
    result = _npu_fwd(npu, "dp2tp2", "BNSD", S(0, 1), atten_mask=T([B, 1, L, L], S(None, None), torch.bool),
                      pse=T([1, N, L, L], S(None, None)))
    assert result.input_specs == [S(0, 1)] * 3 + [S(None, 1), S(0, None)]  # schema order: pse, atten_mask
    compressed = _npu_fwd(npu, "dp2", "BSND", S(0), atten_mask=T([2048, 2048], S(None), torch.bool), sparse_mode=2)
    assert compressed.input_specs == [S(0)] * 3 + [S(None)]


def test_npu_grad(npu):
    qq, stats = T([B, N, L, D], S(0, 1)), T([B, N, L, 8], S(0, 1))
    pse = T([1, N, L, L], S(None, 1))
    result = _run("dp2tp2", npu.npu_fusion_attention_grad.default, (qq, qq, qq, qq, N, "BNSD"),
                  {"pse": pse, "softmax_max": stats, "softmax_sum": stats, "attention_in": qq})
    assert result.output_specs[:3] == [S(0, 1)] * 3
    assert result.output_specs[3] == S("P", 1)  # dpse: pse broadcast over the batch, summed over its shards
    assert result.localizes
    # without pse: dpse is an empty placeholder
    result = _run("dp2", npu.npu_fusion_attention_grad.default, (T([B, N, L, D], S(0)),) * 4 + (N, "BNSD"),
                  {"softmax_max": T([B, N, L, 8], S(0)), "softmax_sum": T([B, N, L, 8], S(0))})
    assert result.output_specs == [S(0)] * 3 + [S(None)]
    # a Partial dy with the rest whole is carried (linear in dy)
    whole = T([B, N, L, D], S(None))
    result = _run("dp2", npu.npu_fusion_attention_grad.default, (whole, whole, whole, T([B, N, L, D], S("P")), N, "BNSD"))
    assert result.output_specs[:3] == [S("P")] * 3


def test_npu_refusals(npu):
    name = "hypershard: npu::npu_fusion_attention: "
    cases = [
        (dict(layout="BSND", q_spec=S(1)), name + "argument query (#0) [4, 8, 4, 8]", "dim 1 (sequence) is sharded"),
        (dict(layout="TND", q_spec=S(0)), name + "argument query (#0) [32, 4, 8]", "dim 0 (sequence) is sharded"),
        # npu's BNSD keeps its sequences whole (the aten kernels' context parallelism is not npu's)
        (dict(layout="BNSD", q_spec=S(2)), name + "argument query (#0) [4, 4, 8, 8]",
         "dim 2 (sequence) is sharded; attention needs whole sequences and head dims; allowed: batch (dim 0) or heads "
         "(dim 1) sharded"),
        # 3 heads of 8 (H = 24) over tp=2: blocks of 12 split a head
        (dict(layout="BSH", q_spec=S(2), shape=[B, L, 24], heads=3), name + "argument query (#0) [4, 8, 24]",
         "a block of H would split a head of 8 elements"),
        (dict(layout="BNSD", q_spec=S(0), keep_prob=0.9), "hypershard: Missing operator npu::npu_fusion_attention "
         "for these arguments (dropout inside the attention kernel", ""),
        (dict(layout="BNSD", q_spec=S(0), padding_mask=T([B, 1, L, L], S(None))),
         "hypershard: Missing operator npu::npu_fusion_attention for these arguments (padding_mask", ""),
        (dict(layout="BNDS", q_spec=S(0)), name + "input_layout 'BNDS' is not supported; allowed: BNSD, BSND, BSH, "
         "SBH, TND", ""),
        (dict(layout="BNSD", q_spec=S(0), prefix=[1, 2, 3, 4]),
         "hypershard: Missing operator npu::npu_fusion_attention for these arguments (a per-batch prefix", ""),
    ]
    for case, start, piece in cases:
        case = dict(case)
        layout, q_spec = case.pop("layout"), case.pop("q_spec")
        shape, heads = case.pop("shape", None), case.pop("heads", N)
        qq = T(shape or SHAPES.get(layout, SHAPES["BNSD"])(N), q_spec)
        with pytest.raises((hs.LayoutError, RuntimeError)) as raised:
            _run("tp2" if layout == "BSH" else "dp2", npu.npu_fusion_attention.default,
                 (qq, qq, T(qq.shape, q_spec), heads, layout), case)
        text = str(raised.value)
        assert text.startswith(start) and piece in text, (start, piece, text)
