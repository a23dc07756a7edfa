"""Level 0: the nn families -- embedding (csrc/ops/embedding.cpp), normalization
(normalization.cpp: layer norm, group norm, softmax, and RMSNorm written out), attention
(attention.cpp: scaled dot-product attention, HF's sdpa and eager paths) and random ops
(random.cpp: dropout, bernoulli, normal_, uniform_, the other fills, *_like draws, draws from
parameter tensors: normal(mean, std), poisson, multinomial) -- on real multi-process gloo
meshes (2,), (4,) and (2, 2), through hypershard.testing.

Every case compares the forward AND the input gradients with one device. Random cases seed
torch.manual_seed identically inside the case function, so the reference and every rank start
from the same generator state: a Replicate draw must be the one-device draw on every rank, a
sharded draw exactly the slice of it (local draws would fail: a shard drawn on its own is a
different sequence, and normal_ even takes another kernel below 16 elements). Partial inputs are
made of random parts that sum to the global value (so a Partial dropped or summed twice shows).
All cases share ONE run_cases call (a module fixture: one launch per world size); each test
function checks its family's cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

hs = pytest.importorskip("hypershard")
from hypershard.testing import (  # noqa: E402
    Case,
    Input,
    NoisyPartialAdapter,
    current_mesh,
    in_distributed_run,
    randint,
    run_cases,
    uniform,
)

M2 = ((2,), ("x",))
M4 = ((4,), ("x",))
M22 = ((2, 2), ("x", "y"))
TIMEOUT = 300


def expect(placements, fn):
    """dist_fn: `fn`, also checking the first output's placements (their repr)."""
    def run(*args):
        out = fn(*args)
        first = out[0] if isinstance(out, tuple) else out
        got = [repr(p) for p in first.placements]
        if got != placements:
            raise AssertionError(f"placements {got}, expected {placements}")
        return out
    return run


def C(name, fn, inputs, mesh=M2, placements=None, **kw):
    return Case(name, fn, inputs, mesh=mesh, dist_fn=expect(placements, fn) if placements else None, **kw)


def I(shape, placements=None, **kw):  # noqa: E743
    return Input(shape, placements=placements, **kw)


def ids(shape, vocab, placements=None, pad=None):
    """int64 indices in [0, vocab); with `pad`, every third index is the padding index."""
    def init(shape_, dtype, generator):
        values = torch.randint(0, vocab, shape_, generator=generator)
        if pad is not None:
            values.view(-1)[::3] = pad
        return values
    return Input(shape, torch.int64, placements=placements, init=init)


R, S0, S1, S2, S3, P = ["R"], ["S(0)"], ["S(1)"], ["S(2)"], ["S(3)"], ["P"]
SUM = ["Partial(sum)"]


# ------------------------------------------------------------------------------------ embedding

def emb(w, i):
    return F.embedding(i, w)


def emb_pad(pad):
    return lambda w, i: F.embedding(i, w, padding_idx=pad)


def emb_freq(w, i):
    return F.embedding(i, w, scale_grad_by_freq=True)


def emb_then_sum(w, i):  # the Partial output of a vocab-parallel lookup reduced downstream
    return F.embedding(i, w).sum(-1)


def grad_arrives_as(placements, fn):
    """dist_fn: `fn`, checking the layout of the gradient that reaches the table (argument 0)
    before the leaf's hook redistributes it: a vocab-parallel table gets its rows only."""
    def run(w, *rest):
        def check(grad):
            got = [repr(p) for p in grad.placements]
            if got != placements:
                raise AssertionError(f"gradient placements {got}, expected {placements}")
        w.register_hook(check)
        return fn(w, *rest)
    return run


def embedding_cases():
    c = []
    add = c.append
    V, D = 10, 6
    add(C("emb_replicate", emb, [I((V, D)), ids((4, 3), V)], placements=["Replicate()"]))
    add(C("emb_idx_batch", emb, [I((V, D)), ids((4, 3), V, S0)], placements=["Shard(dim=0)"]))
    add(C("emb_idx_seq_uneven", emb, [I((V, D)), ids((2, 5), V, S1)], placements=["Shard(dim=1)"]))
    add(C("emb_hidden", emb, [I((V, D), S1), ids((4, 3), V)], placements=["Shard(dim=2)"]))
    add(C("emb_hidden_uneven", emb, [I((V, 5), S1), ids((4, 3), V)], mesh=M4))
    add(C("emb_vocab", emb, [I((V, D), S0), ids((4, 3), V)], placements=SUM))
    add(C("emb_vocab_uneven7", emb, [I((7, D), S0), ids((4, 3), 7)], placements=SUM))
    add(C("emb_vocab_empty_shard", emb, [I((5, D), S0), ids((4, 3), 5)], mesh=M4, placements=SUM))
    add(C("emb_vocab_1d_indices", emb, [I((V, D), S0), ids((7,), V)]))
    add(Case("emb_vocab_grad_rows_only", emb_pad(4), [I((V, D), S0), ids((4, 3), V, pad=4)], mesh=M2,
             dist_fn=grad_arrives_as(["Shard(dim=0)"], emb_pad(4))))
    add(Case("emb_vocab_grad_rows_only_m4", emb, [I((5, D), S0), ids((4, 3), 5)], mesh=M4,
             dist_fn=grad_arrives_as(["Shard(dim=0)"], emb)))
    add(Case("m22_emb_vocab_grad_rows_batch_y", emb, [I((V, D), ["S(0)", "R"]), ids((4, 3), V, ["R", "S(0)"])],
             mesh=M22, dist_fn=grad_arrives_as(["Shard(dim=0)", "Partial(sum)"], emb)))
    add(Case("m22_emb_vocab_yx_grad_rows", emb, [I((7, D), (("y", "x"), "None")), ids((4, 3), 7)], mesh=M22,
             dist_fn=grad_arrives_as(["Shard(dim=0)", "Shard(dim=0)"], emb)))
    add(Case("emb_batch_grad_partial", emb, [I((V, D)), ids((4, 3), V, S0)], mesh=M2,
             dist_fn=grad_arrives_as(["Partial(sum)"], emb)))
    add(C("emb_vocab_reduced", emb_then_sum, [I((V, D), S0), ids((4, 3), V)]))
    add(C("emb_vocab_padding", emb_pad(3), [I((V, D), S0), ids((4, 3), V, pad=3)]))
    add(C("emb_vocab_padding_last_rank", emb_pad(8), [I((V, D), S0), ids((4, 3), V, pad=8)], mesh=M4))
    add(C("emb_padding_idx_batch", emb_pad(0), [I((V, D)), ids((4, 3), V, S0, pad=0)]))
    add(C("emb_padding_negative", emb_pad(-2), [I((V, D), S1), ids((4, 3), V, pad=V - 2)]))
    add(C("emb_freq_batch", emb_freq, [I((V, D)), ids((4, 3), V, S0, pad=2)]))
    add(C("emb_freq_vocab", emb_freq, [I((V, D), S0), ids((4, 3), V, pad=2)]))
    add(C("emb_idx_on_vocab_axis", emb, [I((V, D), S0), ids((4, 3), V, S0)]))
    add(C("emb_partial_weight", emb, [I((V, D), P), ids((4, 3), V)], placements=SUM))
    add(C("emb_partial_weight_idx_batch", emb, [I((V, D), P), ids((4, 3), V, S0)]))
    # 2-D meshes
    add(C("m22_emb_vocab_x_batch_y", emb, [I((V, D), ["S(0)", "R"]), ids((4, 3), V, ["R", "S(0)"])], mesh=M22,
          placements=["Partial(sum)", "Shard(dim=0)"]))
    add(C("m22_emb_vocab_x_hidden_y", emb, [I((V, D), ["S(0)", "S(1)"]), ids((4, 3), V)], mesh=M22,
          placements=["Partial(sum)", "Shard(dim=2)"]))
    add(C("m22_emb_vocab_xy_uneven", emb, [I((7, D), (("x", "y"), "None")), ids((4, 3), 7)], mesh=M22))
    add(C("m22_emb_batch_x_seq_y_pad", emb_pad(1), [I((V, D)), ids((4, 3), V, ["S(0)", "S(1)"], pad=1)], mesh=M22))
    add(C("m22_emb_batch_x_hidden_y", emb, [I((V, D), ["R", "S(1)"]), ids((4, 3), V, ["S(0)", "R"])], mesh=M22,
          placements=["Shard(dim=0)", "Shard(dim=2)"]))
    add(C("m22_emb_vocab_y_padding", emb_pad(9), [I((V, D), ["R", "S(0)"]), ids((4, 3), V, ["S(0)", "R"], pad=9)],
          mesh=M22))
    # errors (every rank raises the same text)
    add(Case("emb_partial_indices", emb, [I((V, D), S0), Input((4, 3), torch.int64, placements=P,
                                                                  init=randint(0, V))], mesh=M2,
             expect_error="Partial indices have no meaning"))
    add(Case("emb_vocab_out_of_range", emb, [I((V, D), S0), Input((4, 3), torch.int64, init=randint(V, V + 3))],
             mesh=M2, expect_error="index out of range in self"))
    return c


# ------------------------------------------------------------------------------------ normalization

def ln(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b)


def ln2(x, w, b):
    return F.layer_norm(x, x.shape[-2:], w, b)


def ln_plain(x):
    return F.layer_norm(x, x.shape[-1:])


def ln_colwise(x, w, b, W):  # the layer norm backward receives a Partial(sum) gradient
    return F.layer_norm(x, x.shape[-1:], w, b) @ W


def ln_grads_only_weight(x, w, b):
    return F.layer_norm(x.detach(), x.shape[-1:], w, b)


def rms(x, w, eps=1e-6):  # HF Qwen3RMSNorm
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return w * h.to(dtype)


def rms_type_as(x, w, eps=1e-6):  # DeepSeek style
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.type_as(x)


def rms_functional(x, w):
    return F.rms_norm(x, x.shape[-1:], w, 1e-6)


def gn(x, w, b):
    return F.group_norm(x, 2, w, b)


def safe_softmax(x):
    return torch.ops.aten._safe_softmax(x, -1)


def safe_softmax_masked(x):  # fully masked rows give zeros, not NaN
    return torch.ops.aten._safe_softmax(x.masked_fill(x > 0.5, float("-inf")), -1)


def softmax_last(x):
    return torch.softmax(x, -1)


def softmax_dim1(x):
    return torch.softmax(x, 1)


def softmax_f32(x):
    return F.softmax(x, dim=-1, dtype=torch.float32)


def normalization_cases():
    c = []
    add = c.append
    B, S, H = 4, 3, 8
    lnin = lambda p, shape=(B, S, H), mesh_ndim=1: [I(shape, p), I(shape[-1:]), I(shape[-1:])]  # noqa: E731
    add(C("ln_batch", ln, lnin(S0), placements=["Shard(dim=0)"]))
    add(C("ln_seq_uneven", ln, lnin(S1), placements=["Shard(dim=1)"]))
    add(C("ln_replicate", ln, lnin(R)))
    add(C("ln_hidden_gathered", ln, lnin(S2), placements=["Replicate()"]))
    add(C("ln_weight_sharded_gathered", ln, [I((B, S, H), S0), I((H,), S0), I((H,))]))
    add(C("ln_uneven_empty_shard", ln, lnin(S0, (3, 2, H)), mesh=M4))
    add(C("ln_no_affine", ln_plain, [I((B, S, H), S0)]))
    add(C("ln_two_dims", ln2, [I((B, 3, 4, 5), S1), I((4, 5)), I((4, 5))]))
    add(C("ln_two_dims_sharded_normalized", ln2, [I((B, 3, 4, 5), S2), I((4, 5)), I((4, 5))]))
    add(C("ln_only_weight_grads", ln_grads_only_weight, lnin(S0)))
    add(C("ln_partial_grad", ln_colwise, [I((4, H)), I((H,)), I((H,)), I((H, 6), S1)]))
    add(C("m22_ln_batch_x_seq_y", ln, lnin(["S(0)", "S(1)"]), mesh=M22, placements=["Shard(dim=0)", "Shard(dim=1)"]))
    add(C("m22_ln_batch_xy_uneven", ln, lnin((("x", "y"), "None", "None"), (3, 2, H)), mesh=M22))
    add(C("m22_ln_partial_grad_dp_x", ln_colwise, [I((4, H), ["S(0)", "R"]), I((H,)), I((H,)), I((H, 6), ["R", "S(1)"])],
          mesh=M22))
    add(Case("ln_partial_input", ln, [I((B, S, H), P), I((H,)), I((H,))], mesh=M2,
             expect_error="Partial(sum) input is not supported"))
    # RMSNorm written out (pointwise + reductions)
    add(C("rms_batch", rms, [I((B, S, H), S0), I((H,))], placements=["Shard(dim=0)"]))
    add(C("rms_seq_uneven", rms, [I((B, 5, H), S1), I((H,))], mesh=M4))
    # a sharded normalized dim makes mean(-1) Partial(sum), which rsqrt refuses (house policy)
    add(Case("rms_hidden_sharded", rms, [I((B, S, H), S2), I((H,))], mesh=M2,
             expect_error="aten::rsqrt: argument self (#0) [4, 3, 1]"))
    add(C("rms_bf16", rms, [I((B, S, H), S0, dtype=torch.bfloat16), I((H,), dtype=torch.bfloat16)]))
    add(C("rms_type_as", rms_type_as, [I((B, S, H), S1), I((H,))]))
    add(C("rms_functional", rms_functional, [I((B, S, H), S0), I((H,))]))
    add(C("m22_rms_batch_x_seq_y", rms, [I((B, S, H), ["S(0)", "S(1)"]), I((H,))], mesh=M22))
    # group norm: batch sharded; channels gathered
    add(C("gn_batch", gn, [I((4, 6, 5), S0), I((6,)), I((6,))], placements=["Shard(dim=0)"]))
    add(C("gn_batch_uneven", gn, [I((3, 4, 5), S0), I((4,)), I((4,))], mesh=M4))
    add(C("gn_channels_gathered", gn, [I((4, 6, 5), S1), I((6,)), I((6,))]))
    # _safe_softmax (the attention math path; its backward is the loss family's): forward only
    add(C("safe_softmax_batch", safe_softmax, [I((4, 5, 6), S0, requires_grad=False)], placements=["Shard(dim=0)"]))
    add(C("safe_softmax_dim_gathered", safe_softmax, [I((4, 5, 6), S2, requires_grad=False)]))
    add(C("safe_softmax_masked_rows_uneven", safe_softmax_masked, [I((5, 4), S0, requires_grad=False)], mesh=M4))
    add(Case("safe_softmax_partial_input", safe_softmax, [I((4, 5), P, requires_grad=False)], mesh=M2,
             expect_error="Partial(sum) input is not supported"))
    return c


# ------------------------------------------------------------------------------------ attention

def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_mask(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def sdpa_bool_mask(q, k, v):
    L, S = q.shape[2], k.shape[2]
    mask = torch.ones(L, S, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def cudnn_attention_seed(q, k, v):
    """cuDNN attention's output and dropout seed. On a GPU the seed is a 1-element tensor where the
    op's Meta kernel (hypershard's planned shape) says 0-dim; hypershard.testing.cuda_lowering's
    CPU kernel returns the GPU's shape. The wrapper must take the local's shape (it was 0-dim
    around a (1,) local)."""
    from hypershard.testing import cuda_lowering

    cuda_lowering.install_cpu_kernels()
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    assert out[6].shape == (1,), out[6].shape  # a DTensor's global shape as the kernel's
    return out[0], out[6]


def sdpa_dropout(q, k, v):
    torch.manual_seed(11)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)


def repeat_kv(hidden_states, n_rep):  # transformers.integrations.sdpa_attention.repeat_kv
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def hf_sdpa_with_mask(q, k, v, m):  # HF "sdpa" with a mask: repeat_kv, then sdpa
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=m)


def causal_mask(L, S, dtype=torch.float32):
    return torch.full((L, S), torch.finfo(dtype).min).triu(1)[None, None]


def hf_eager(dropout):
    def run(q, k, v):  # transformers' eager_attention_forward (training)
        torch.manual_seed(5)
        n_rep = q.shape[1] // k.shape[1]
        key_states, value_states = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        weights = torch.matmul(q, key_states.transpose(2, 3)) * q.shape[-1] ** -0.5
        weights = weights + causal_mask(q.shape[2], k.shape[2])
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        weights = F.dropout(weights, p=dropout, training=True)
        out = torch.matmul(weights, value_states)
        return out.transpose(1, 2).contiguous()
    return run


def qwen3_attention(impl, tp_axis=0, mask=False, dropout=0.0):
    """HF Qwen3Attention (GQA: 4 query heads, 2 key/value heads) with attn_implementation `impl`;
    in the distributed run q/k/v_proj are column-parallel and o_proj row-parallel over mesh axis
    `tp_axis` (Megatron-style tensor parallelism: attention heads sharded)."""
    def run(hidden):
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=16, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_dropout=dropout)
        config._attn_implementation = impl
        attn = Qwen3Attention(config, 0)
        B, S = hidden.shape[0], hidden.shape[1]
        cos, sin = Qwen3RotaryEmbedding(config)(torch.zeros(1), torch.arange(S)[None].expand(B, S))
        attention_mask = causal_mask(S, S)[:, :, :, :].expand(B, 1, S, S) if mask else None
        if in_distributed_run():
            mesh = current_mesh()
            def shard(dim):
                placements = ["R"] * mesh.ndim
                placements[tp_axis] = f"S({dim})"
                return placements
            for proj, dim in (("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("o_proj", 1)):
                linear = getattr(attn, proj)
                linear.weight = torch.nn.Parameter(hs.distribute_tensor(linear.weight.detach(), mesh, shard(dim)))
            for norm in (attn.q_norm, attn.k_norm):
                norm.weight = torch.nn.Parameter(hs.distribute_tensor(norm.weight.detach(), mesh, ["R"] * mesh.ndim))
        torch.manual_seed(1)
        out, _ = attn(hidden, (cos, sin), attention_mask)
        return out
    return run


def attention_cases():
    c = []
    add = c.append
    B, H, L, D = 2, 4, 6, 8
    qkv = lambda p, b=B, h=H, hkv=H: [I((b, h, L, D), p), I((b, hkv, L, D), p), I((b, hkv, L, D), p)]  # noqa: E731
    add(C("sdpa_causal_batch", sdpa_causal, qkv(S0), placements=["Shard(dim=0)"]))
    add(C("sdpa_causal_heads", sdpa_causal, qkv(S1), placements=["Shard(dim=1)"]))
    add(C("sdpa_causal_heads_uneven3", sdpa_causal, qkv(S1, h=3, hkv=3)))
    add(C("sdpa_causal_batch_uneven3_m4", sdpa_causal, qkv(S0, b=3), mesh=M4))
    add(C("sdpa_heads_q_only_sharded", sdpa_causal, [I((B, H, L, D), S1), I((B, H, L, D)), I((B, H, L, D))]))
    add(C("sdpa_mask_2d", sdpa_mask, qkv(S1) + [I((L, L), requires_grad=False)]))
    add(C("sdpa_mask_batch", sdpa_mask, qkv(S0) + [I((B, 1, L, L), S0, requires_grad=False)]))
    add(C("sdpa_mask_full_heads", sdpa_mask, qkv(S1) + [I((B, H, L, L), requires_grad=False)]))
    add(C("sdpa_bool_mask", sdpa_bool_mask, qkv(S1)))
    add(C("sdpa_gqa_heads", sdpa_gqa, qkv(S1, hkv=2), placements=["Shard(dim=1)"]))
    add(C("sdpa_gqa_batch", sdpa_gqa, qkv(S0, hkv=2), mesh=M4))
    add(C("cudnn_attention_seed_shape", cudnn_attention_seed, qkv(S1)))
    add(C("hf_sdpa_repeat_kv_mask", hf_sdpa_with_mask, qkv(S1, hkv=2) + [I((1, 1, L, L), requires_grad=False)]))
    add(C("m22_sdpa_batch_x_heads_y", sdpa_causal, qkv(["S(0)", "S(1)"]), mesh=M22,
          placements=["Shard(dim=0)", "Shard(dim=1)"]))
    add(C("m22_sdpa_gqa_batch_x_heads_y", sdpa_gqa, qkv(["S(0)", "S(1)"], hkv=2), mesh=M22))
    add(C("m22_sdpa_mask_batch_x", sdpa_mask, qkv(["S(0)", "S(1)"]) + [I((B, 1, L, L), ["S(0)", "R"], requires_grad=False)],
          mesh=M22))
    # HF Qwen3Attention, "sdpa": enable_gqa without a mask, repeat_kv with one
    add(C("qwen3_sdpa_tp", qwen3_attention("sdpa"), [I((2, 5, 32))]))
    add(C("qwen3_sdpa_mask_tp", qwen3_attention("sdpa", mask=True), [I((2, 5, 32))]))
    add(C("m22_qwen3_sdpa_dp_x_tp_y", qwen3_attention("sdpa", tp_axis=1), [I((2, 5, 32), ["S(0)", "R"])], mesh=M22))
    # errors
    # a sharded sequence: context parallelism's all-gather-KV (test_context_parallel.py has the rest)
    add(C("sdpa_sequence_sharded", sdpa_causal, qkv(S2), placements=["Shard(dim=2)"]))
    add(Case("sdpa_head_dim_sharded", sdpa_causal, qkv(S3), mesh=M2, expect_error="needs whole head dims"))
    add(C("sdpa_mask_sequence_sharded", sdpa_mask, qkv(S0) + [I((L, L), S0, requires_grad=False)]))
    add(Case("sdpa_partial_query", sdpa_causal, [I((B, H, L, D), P), I((B, H, L, D)), I((B, H, L, D))], mesh=M2,
             expect_error="not supported by attention"))
    # more head shards than KV heads (tp wider than the KV heads): key/value whole on the heads, each
    # rank reading the KV heads its query heads need; their gradients Partial(sum)
    add(C("sdpa_gqa_kv_heads_fewer_than_shards", sdpa_gqa, qkv(S1, hkv=2), mesh=M4))
    add(C("sdpa_gqa_kv_replicated_8_heads_1_kv", sdpa_gqa,
          [I((B, 8, L, D), S1), I((B, 1, L, D)), I((B, 1, L, D))], mesh=M4))
    add(C("sdpa_gqa_kv_replicated_8_heads_2_kv_m22", sdpa_gqa,
          [I((B, 8, L, D), ["S(1)", "S(1)"]), I((B, 2, L, D)), I((B, 2, L, D))], mesh=M22))
    # query heads split across a group boundary (3 query heads per KV head over 4 shards): refused
    add(Case("sdpa_gqa_heads_cut_groups", sdpa_gqa, [I((B, 6, L, D), S1), I((B, 2, L, D)), I((B, 2, L, D))],
             mesh=M4, expect_error="cannot be split evenly"))
    return c


# ------------------------------------------------------------------------------------ softmax paths

SOFTMAX_OPS = ("aten::_softmax", "aten::_softmax_backward_data")


def softmax_path_cases():
    """Cases that need _softmax / _softmax_backward_data (the loss family's rules): softmax
    itself, HF eager attention and the sdpa math path (taken with dropout)."""
    c = []
    add = c.append
    B, H, L, D = 2, 4, 6, 8
    qkv = lambda p, b=B, h=H, hkv=H: [I((b, h, L, D), p), I((b, hkv, L, D), p), I((b, hkv, L, D), p)]  # noqa: E731
    add(C("softmax_batch", softmax_last, [I((4, 5, 6), S0)], placements=["Shard(dim=0)"]))
    add(C("softmax_dim1_last_sharded", softmax_dim1, [I((4, 5, 6), S2)], placements=["Shard(dim=2)"]))
    add(C("softmax_f32_uneven", softmax_f32, [I((3, 5), S0)], mesh=M4))
    add(C("m22_softmax", softmax_last, [I((4, 5, 6), ["S(0)", "S(1)"])], mesh=M22))
    # sdpa takes the math path with dropout, with a mask that needs a gradient, or E != Ev
    add(C("sdpa_dropout_math_path", sdpa_dropout, qkv(S1)))
    add(C("sdpa_math_mask_grad", sdpa_mask, qkv(S0) + [I((B, 1, L, L), S0)]))
    add(C("sdpa_math_cross_lengths", sdpa_mask, [I((B, H, L, D), S1), I((B, H, 5, D), S1), I((B, H, 5, 3), S1),
                                                 I((L, 5), requires_grad=False)]))
    add(C("hf_eager_heads", hf_eager(0.0), qkv(S1, hkv=2)))
    add(C("hf_eager_dropout_batch", hf_eager(0.1), qkv(S0, hkv=2)))
    add(C("m22_hf_eager_dropout", hf_eager(0.2), qkv(["S(0)", "S(1)"], hkv=2), mesh=M22))
    add(C("qwen3_eager_dropout_tp", qwen3_attention("eager", dropout=0.1), [I((2, 5, 32))]))
    add(C("m22_qwen3_eager_mask_dp_x_tp_y", qwen3_attention("eager", tp_axis=1, mask=True),
          [I((2, 5, 32), ["S(0)", "R"])], mesh=M22))
    return c


# ------------------------------------------------------------------------------------ random

def seeded(fn, seed=1234):
    def run(*args):
        torch.manual_seed(seed)
        return fn(*args)
    return run


dropout = seeded(lambda x: F.dropout(x, 0.3, training=True))
dropout_twice = seeded(lambda x: F.dropout(x, 0.5, training=True) + 2 * F.dropout(x, 0.2, training=True))
bernoulli_fill = seeded(lambda x: x * torch.empty_like(x).bernoulli_(0.4))
bernoulli_tensor_fill = seeded(lambda x: x * torch.empty_like(x).bernoulli_(torch.sigmoid(x.detach())))
bernoulli_probs = seeded(lambda x: torch.bernoulli(torch.sigmoid(x)))
bernoulli_p = seeded(lambda x: x * torch.bernoulli(x.detach(), 0.3))
normal_fill = seeded(lambda x: x + torch.empty_like(x).normal_(0.5, 2.0))
normal_transposed = seeded(lambda x: x + torch.empty_like(x.t()).normal_().t())
uniform_fill = seeded(lambda x: x * torch.empty_like(x).uniform_(-1, 1))
exponential_fill = seeded(lambda x: x * torch.empty_like(x).exponential_())
other_fills = seeded(lambda x: x * torch.empty_like(x).cauchy_() + torch.empty_like(x).log_normal_()
                     + torch.empty_like(x).geometric_(0.3) + torch.empty_like(x).random_(0, 5))
# draws from a tensor of parameters (means, rates, probabilities); multinomial's last dim becomes
# num_samples, normal(mean, std) reads std whole
parameter_draws = seeded(lambda x: torch.normal(x, 0.5) + torch.normal(x, x.detach().abs() + 0.1)
                         + torch.poisson(x.detach().abs()))
multinomial = seeded(lambda x: x[:, :1] + torch.multinomial(torch.softmax(x.detach(), -1), 3)
                     + torch.multinomial(torch.softmax(x.detach(), -1), 8, replacement=True).sum(-1, keepdim=True))
like_draws = seeded(lambda x: torch.rand_like(x) + 2 * torch.randn_like(x) + torch.randint_like(x, 10)
                    + torch.randint_like(x, 3, 7))
native_dropout = seeded(lambda x: torch.native_dropout(x, 0.3, True))
native_dropout_eval = seeded(lambda x: torch.native_dropout(x, 0.3, False))


def with_generator(x):
    g = torch.Generator().manual_seed(7)
    return x * torch.empty_like(x).uniform_(generator=g) + torch.rand_like(x, generator=g)


def normal_into_partial(x):
    return x.clone().normal_()


def random_cases():
    c = []
    add = c.append
    fns = [("dropout", dropout), ("dropout_twice", dropout_twice), ("bernoulli_fill", bernoulli_fill),
           ("bernoulli_tensor_fill", bernoulli_tensor_fill), ("bernoulli_probs", bernoulli_probs),
           ("bernoulli_p", bernoulli_p), ("normal_fill", normal_fill), ("uniform_fill", uniform_fill),
           ("exponential_fill", exponential_fill), ("other_fills", other_fills),
           ("parameter_draws", parameter_draws), ("multinomial", multinomial), ("native_dropout", native_dropout),
           ("with_generator", with_generator)]
    # (4, 6): 24 elements, 12 per shard on 2 ranks, 6 on 4: normal_ takes its vectorised path for
    # the global draw (>= 16) and would take the serial one on a shard.
    for name, fn in fns:
        for label, placements, mesh in [("R", R, M2), ("S0", S0, M2), ("S1", S1, M2), ("m4_S1", S1, M4),
                                        ("m22", ["S(1)", "S(0)"], M22)]:
            add(Case(f"{name}_{label}", fn, [I((4, 6), placements)], mesh=mesh))
        add(Case(f"{name}_uneven_m4", fn, [I((5, 3), S0)], mesh=M4))
    add(Case("like_draws_S0", like_draws, [I((4, 6), S0, requires_grad=False)], mesh=M2))
    add(Case("like_draws_m22", like_draws, [I((5, 7), ["S(1)", "S(0)"], requires_grad=False)], mesh=M22))
    add(Case("like_draws_partial_self", like_draws, [I((4, 6), P, requires_grad=False)], mesh=M2))
    add(Case("normal_small_serial_path", normal_fill, [I((2, 3), S1)], mesh=M2))
    add(Case("normal_transposed", normal_transposed, [I((4, 6), S0)], mesh=M2))
    add(Case("normal_bf16", normal_fill, [I((4, 6), S1, dtype=torch.bfloat16)], mesh=M2))
    add(Case("dropout_3d_m22", dropout, [I((2, 3, 5), ["S(0)", "S(2)"])], mesh=M22))
    add(Case("dropout_partial_input", dropout, [I((4, 6), P)], mesh=M2))
    add(Case("native_dropout_partial_input", native_dropout, [I((4, 6), P)], mesh=M2))
    add(Case("native_dropout_eval", native_dropout_eval, [I((4, 6), S0)], mesh=M2))
    add(Case("normal_into_partial", normal_into_partial, [I((4, 6), P, requires_grad=False)], mesh=M2,
             expect_error="a fill would leave the same draw"))
    add(Case("bernoulli_partial_probs", lambda p: torch.bernoulli(p), [I((4, 6), P, requires_grad=False,
                                                                         init=uniform(0, 0.5))], mesh=M2,
             expect_error="probabilities that are a sum of parts"))
    return c


# ------------------------------------------------------------------------------------ tests

FAMILIES = {"embedding": embedding_cases, "normalization": normalization_cases, "attention": attention_cases,
            "random": random_cases, "softmax_paths": softmax_path_cases}


def _missing_softmax_rules():
    return [op for op in SOFTMAX_OPS if op not in set(hs._C.rule_names())]


@pytest.fixture(scope="module")
def results():
    """Every family's cases in ONE run_cases call (one launch per world size)."""
    cases, names = [], {}
    for family, make in FAMILIES.items():
        batch = [] if family == "softmax_paths" and _missing_softmax_rules() else make()
        names[family] = [case.name for case in batch]
        cases += batch
    return run_cases(cases, backend=NoisyPartialAdapter(), timeout=TIMEOUT), names


def _check(results, family):
    run, names = results
    failed = [run[name] for name in names[family] if not run[name].passed]
    if failed or run.problems:
        raise AssertionError(f"{len(failed)} of {len(names[family])} {family} cases did not pass\n"
                             + "\n".join(result.describe() for result in failed)
                             + "".join("\nLAUNCH PROBLEM " + problem for problem in run.problems))


def test_embedding(results):
    _check(results, "embedding")


def test_normalization(results):
    _check(results, "normalization")


def test_attention(results):
    _check(results, "attention")


def test_random(results):
    _check(results, "random")


def test_softmax_paths(results):
    if _missing_softmax_rules():
        pytest.skip("needs the loss family's rules: " + ", ".join(_missing_softmax_rules()))
    _check(results, "softmax_paths")
