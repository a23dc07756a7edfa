"""Level 0: context parallelism (csrc/ops/attention.cpp, attention_sequence.cpp): softmax attention
(the CPU flash kernel F.scaled_dot_product_attention lowers to) with the sequence sharded over a
mesh axis "cp", on real gloo meshes (2,), (4,) and (2, 2) = (dp, cp), strict mode, against one
device: forward and the gradients of query, key and value, for each algorithm (the mesh's
``cp_algorithm``): all-gather-KV, Ulysses and ring.

The layout convention (docs/context_parallel.md): with a load-balanced sequence axis
(``mesh.load_balanced_sequence_axis``) every sequence is STORED in head-tail order of 2n chunks
(rank i holds chunks i and 2n-1-i). The inputs here are given in stored order; the reference
undoes the order, runs one-device attention in natural order and stores the result again, so
"equal to one device" means equal to the natural-order computation. Without a load-balanced axis
the sequence is in natural order (uneven lengths allowed).

Also the two ops before attention that must keep the sequence sharded: a linear layer with two
sequences per rank and the KV cache's first update (a cat onto a legacy empty tensor).

Cases: causal (head-tail and natural order, uneven L in natural order), not causal, GQA
(enable_gqa, 4 query heads over 2 KV heads), padding masks (a right-padded key mask, with and
without causal), key/value gradients laid out like key/value, bytes per call equal to the
algorithm's formula (expected_bytes), the refusals (head-tail order with 2n not dividing L, a
sharded head dim), and planted faults that must fail: the head-tail declaration missing (the mask
built in natural order; per algorithm) and the labels' load-balance permutation missing (a global
causal-LM loss). Uneven blocks, and Ulysses with heads that do not divide over cp (GQA's 2 KV heads
on 4 ranks), run all-gather-KV: the bytes check sees which ran.

Tolerance: float32 defaults (rtol 1e-5, atol 1e-6): each rank's output row is computed by the
same kernel over the same keys as one device; only the blocking of the kernel's online softmax and
the order of the sum of per-rank key/value gradient parts differ (rounding). Ring merges n blocks'
outputs by their log-sum-exp: the weights exp(lse_i - lse) carry a few ulps each, far below 1e-5
relative for outputs of size O(1); Ulysses runs the one-device kernel on all rows of its heads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

hs = pytest.importorskip("hypershard")
from hypershard.parallel.context import head_tail_order, shift_labels  # noqa: E402
from hypershard.testing import Case, Input, current_mesh, run_cases  # noqa: E402

M2 = ((2,), ("cp",))
M4 = ((4,), ("cp",))
M22 = ((2, 2), ("dp", "cp"))
TIMEOUT = 300
B, H, D = 2, 4, 8
FLOAT_BYTES = 4


def cp_axis_and_size():
    mesh = current_mesh()
    axis = list(mesh.mesh_dim_names).index("cp")
    return axis, mesh.shape[axis]


ALGORITHMS = ("all_gather_kv", "ulysses", "ring")


def declare(load_balanced: bool, algorithm: str = "all_gather_kv"):
    """Sets (or clears) the mesh's load-balanced sequence axis and its attention algorithm; every
    case states both, since one launch's cases share the mesh."""
    axis, _ = cp_axis_and_size()
    current_mesh().load_balanced_sequence_axis = axis if load_balanced else -1
    current_mesh().cp_algorithm = algorithm


def seq(placement_cp, mesh):
    """q/k/v placements: dim 2 on cp, dim 0 on dp where the mesh has it."""
    return ["S(0)", placement_cp] if mesh == M22 else [placement_cp]


def cp_size(mesh):
    return mesh[0][mesh[1].index("cp")]


# ------------------------------------------------------------------------------------- functions

def natural(t, order, dims=(2,)):
    """Stored-order `t` back in natural order along `dims` (stored row j is position order[j])."""
    inverse = torch.argsort(order)
    for d in dims:
        t = t.index_select(d, inverse)
    return t


def stored(t, order):
    return t.index_select(2, order)


def attention(causal=False, gqa=False, head_tail=False, mask=False, chunks=None, algorithm="all_gather_kv"):
    """fn: one-device attention in natural order (stored-order inputs converted, the output
    converted back); dist_fn: F.scaled_dot_product_attention on the DTensors as they are, the mesh's
    load-balanced axis declared when `head_tail`. With a mask and causal the call is the aten op
    (F.scaled_dot_product_attention refuses both together): HF builds one 4-D mask instead, which
    the reference does."""
    def reference(q, k, v, *m):
        L = q.shape[2]
        order = head_tail_order(L, chunks) if head_tail else torch.arange(L)
        qn, kn, vn = (natural(t, order) for t in (q, k, v))
        attn_mask = natural(m[0], order, (2, 3)) if m else None
        if causal and m:
            attn_mask = attn_mask + torch.full((L, L), float("-inf")).triu(1)
        out = F.scaled_dot_product_attention(qn, kn, vn, attn_mask=attn_mask, is_causal=causal and not m,
                                             enable_gqa=gqa)
        return stored(out, order)

    def distributed(q, k, v, *m):
        declare(head_tail, algorithm)
        if causal and m:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=m[0])[0]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m[0] if m else None, is_causal=causal,
                                              enable_gqa=gqa)
    return reference, distributed


def padding_mask(L, order, pad):
    """An additive key-padding mask [B, 1, L, L] in stored order: batch 1's last `pad` positions
    are padding (0 where a key is seen, -inf where it is padding)."""
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[1, L - pad:] = False
    m = torch.zeros(B, 1, L, L).masked_fill(~keep[:, None, None, :], float("-inf"))
    return m.index_select(2, order).index_select(3, order)


def expected_bytes(algorithm, mesh, L, hkv):
    """(forward, forward + backward) bytes this rank sends per call, even shards. b_kv: this rank's
    K block (V the same), b_q its query block (output and grad_out the same), b_lse its logsumexp.
    - all-gather-KV: forward all-gathers K and V (each rank sends its blocks to n-1 peers:
      2 (n-1) b_kv); backward gathers them again and reduce-scatters dK and dV ((n-1) b_kv each).
    - ring: forward passes the K/V block n-1 times; backward passes it n-1 times and the dK/dV
      accumulators n times (home again).
    - Ulysses: an all-to-all keeps 1/n of a block and sends the rest; forward q, k, v in, out and
      lse back; backward grad_out, q, k, v, out, lse in, dq, dk, dv back. Heads that do not
      divide over n run all-gather-KV."""
    n = cp_size(mesh)
    b = B // (2 if mesh == M22 else 1)
    b_kv = b * hkv * (L // n) * D * FLOAT_BYTES
    b_q = b * H * (L // n) * D * FLOAT_BYTES
    b_lse = b * H * (L // n) * FLOAT_BYTES
    if algorithm == "ring":
        return 2 * (n - 1) * b_kv, 4 * (n - 1) * b_kv + 2 * n * b_kv
    if algorithm == "ulysses" and H % n == 0 and hkv % n == 0:
        def moved(x):
            return (n - 1) * (x // n)
        forward = moved(b_q) + 2 * moved(b_kv) + moved(b_q) + moved(b_lse)
        backward = 3 * moved(b_q) + 2 * moved(b_kv) + moved(b_lse) + moved(b_q) + 2 * moved(b_kv)
        return forward, forward + backward
    return 2 * (n - 1) * b_kv, 6 * (n - 1) * b_kv


def with_traffic_check(dist, mesh, L, hkv, algorithm="all_gather_kv"):
    """dist_fn that also runs forward + backward on fresh leaves with the traffic counters reset
    and checks the bytes against expected_bytes. Also checks that dK / dV come back laid out like
    K / V (Shard on the sequence)."""
    want_forward, want_total = expected_bytes(algorithm, mesh, L, hkv)

    def run(q, k, v, *m):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        dist(*leaves, *m)  # plans cached
        hs._C.reset_traffic()
        out = dist(*leaves, *m)
        forward = hs._C.traffic()["bytes_sent"]
        grads = torch.autograd.grad(out, leaves, grad_outputs=out.detach())
        total = hs._C.traffic()["bytes_sent"]
        problems = []
        if forward != want_forward:
            problems.append(f"forward sent {forward} bytes, {algorithm} sends {want_forward}")
        if total != want_total:
            problems.append(f"forward + backward sent {total} bytes, {algorithm} sends {want_total}")
        for name, leaf, grad in zip("qkv", leaves, grads):
            if grad.placements != leaf.placements:
                problems.append(f"d{name} placements {grad.placements}, {name} {leaf.placements}")
        if problems:
            raise AssertionError("; ".join(problems))
        return dist(q, k, v, *m)
    return run


def qkv(mesh, L, hkv=H, placement="S(2)"):
    p = seq(placement, mesh)
    return [Input((B, H, L, D), placements=p), Input((B, hkv, L, D), placements=p),
            Input((B, hkv, L, D), placements=p)]


def attention_case(name, mesh, L, causal=False, gqa=False, head_tail=False, pad=0, traffic=False,
                   expect_error=None, algorithm="all_gather_kv"):
    hkv = 2 if gqa else H
    chunks = 2 * cp_size(mesh)
    fn, dist = attention(causal, gqa, head_tail, mask=pad > 0, chunks=chunks, algorithm=algorithm)
    inputs = qkv(mesh, L, hkv)
    if pad:
        order = head_tail_order(L, chunks) if head_tail else torch.arange(L)
        inputs.append(Input((B, 1, L, L), placements=seq("S(2)", mesh), init=padding_mask(L, order, pad),
                            requires_grad=False))
    if traffic:
        dist = with_traffic_check(dist, mesh, L, hkv, algorithm)
    return Case(name, fn, inputs, mesh=mesh, dist_fn=dist, expect_error=expect_error)


# ------------------------------------------------------------------------- the loss (labels)

VOCAB = 11


def loss_cases(mesh, L):
    """The logits [1, L, V] are given in head-tail order; the reference is the one-device causal-LM
    loss written out in natural order (logits of position p against token p + 1, -100 ignored,
    mean over the trained tokens), independent of hypershard.parallel.context's helpers. The
    distributed run gets the labels as parallelize makes them -- shifted over the whole sequence,
    then stored in head-tail order -- and sharded like the logits; it never shifts across shards.
    The planted twin forgets the head-tail permutation of the labels."""
    chunks = 2 * cp_size(mesh)
    order = head_tail_order(L, chunks)
    labels = torch.randint(0, VOCAB, (1, L), generator=torch.Generator().manual_seed(L))
    labels[0, 2] = labels[0, L // 2] = -100
    placements = ["R"] * len(mesh[0])
    placements[mesh[1].index("cp")] = "S(1)"
    logits = Input((1, L, VOCAB), placements=list(placements))

    def reference(lg, _labels):
        natural_logits = lg.index_select(1, torch.argsort(order))
        return F.cross_entropy(natural_logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

    def dist(lg, lb):
        declare(True)
        return F.cross_entropy(lg.flatten(0, 1), lb.flatten(), ignore_index=-100)

    good = Input((1, L), torch.int64, placements=list(placements),
                 init=shift_labels(labels).index_select(1, order))
    planted = Input((1, L), torch.int64, placements=list(placements), init=shift_labels(labels))
    tag = "m22" if mesh == M22 else f"m{cp_size(mesh)}"
    return [Case(f"loss_head_tail_{tag}", reference, [logits, good], mesh=mesh, dist_fn=dist),
            Case(f"planted_labels_not_permuted_{tag}", reference, [logits, planted], mesh=mesh, dist_fn=dist)]


# ----------------------------------------------------------------- linear layers, KV cache

def linear_case(mesh, tag):
    """F.linear on [batch, sequence, hidden] with two sequences per rank and the sequence sharded:
    torch's composite flattens (batch, sequence), which keeps no shard then; hypershard's kernel
    (csrc/ops/composites.cpp) keeps the output sharded like the input, with no forward traffic.
    Gradients of input, weight and bias against one device."""
    placements = seq("S(1)", mesh)

    def run(x, w, b):
        hs._C.reset_traffic()
        out = F.linear(x, w, b)
        sent = hs._C.traffic()["bytes_sent"]
        if out.placements != x.placements or sent:
            raise AssertionError(f"linear: output {out.placements} for input {x.placements}, {sent} bytes sent")
        return out
    batch = 4 if mesh == M22 else 2
    return Case(f"linear_two_sequences_per_rank_{tag}", lambda x, w, b: F.linear(x, w, b),
                [Input((batch, 8, 6), placements=placements), Input((5, 6), placements=["R"] * len(mesh[0])),
                 Input((5,), placements=["R"] * len(mesh[0]))], mesh=mesh, dist_fn=run)


def kv_cache_case(mesh, tag):
    """transformers' DynamicCache concatenates key/value onto a legacy empty tensor: torch.cat
    skips it, and the cat rule keeps the sequence sharded (no gather before attention)."""
    def run(k):
        out = torch.cat([torch.tensor([]), k], dim=-2)
        if out.placements != k.placements:
            raise AssertionError(f"cat: {out.placements} for {k.placements}")
        return out
    return Case(f"kv_cache_first_update_{tag}", lambda k: torch.cat([torch.tensor([]), k], dim=-2),
                [Input((B, H, 8, D), placements=seq("S(2)", mesh))], mesh=mesh, dist_fn=run)


# ---------------------------------------------------------------------------------------- cases

def cases():
    c = []
    for mesh, tag in ((M2, "m2"), (M4, "m4"), (M22, "m22")):
        n = cp_size(mesh)
        L = 4 * n  # 2n chunks of 2
        for algorithm in ALGORITHMS:
            t = tag if algorithm == "all_gather_kv" else f"{algorithm}_{tag}"

            def case(name, length, **kw):
                return attention_case(f"{name}_{t}", mesh, length, algorithm=algorithm, **kw)
            c += [
                case("causal_head_tail", L, causal=True, head_tail=True, traffic=True),
                case("not_causal", L, traffic=True),
                case("causal_natural", L, causal=True, traffic=True),
                case("causal_natural_uneven", 2 * n + 1, causal=True),
                case("not_causal_uneven", 2 * n + 1),
                case("gqa_causal_head_tail", L, causal=True, gqa=True, head_tail=True, traffic=True),
                case("padding_causal_head_tail", L, causal=True, head_tail=True, pad=3),
                case("padding_not_causal", L, pad=3),
                case("head_tail_uneven_refused", 4 * n + 1, causal=True, head_tail=True,
                     expect_error="head-tail order"),
            ]
        c += loss_cases(mesh, 4 * n)
        c += [linear_case(mesh, tag), kv_cache_case(mesh, tag)]
    # a head dim sharded is refused
    fn, dist = attention(causal=True)
    c.append(Case("head_dim_sharded_refused_m2", fn, qkv(M2, 8, placement="S(3)"), mesh=M2, dist_fn=dist,
                  expect_error="needs whole head dims"))
    # planted: head-tail inputs, the mesh not told (the mask built from natural positions)
    for algorithm in ALGORITHMS:
        fn, _ = attention(causal=True, head_tail=True, chunks=4)
        _, undeclared = attention(causal=True, head_tail=False, algorithm=algorithm)
        c.append(Case(f"planted_head_tail_undeclared_{algorithm}_m2", fn, qkv(M2, 8), mesh=M2, dist_fn=undeclared))
    return c


@pytest.fixture(scope="module")
def results():
    return run_cases(cases(), timeout=TIMEOUT)  # the hypershard adapter runs strict


def test_context_parallel_attention(results):
    failures = [r for r in results if not r.passed and not r.name.startswith("planted_")]
    assert not failures and not results.problems, results.summary()


def test_planted_faults_fail(results):
    planted = [r for r in results if r.name.startswith("planted_")]
    assert len(planted) == 3 + 3, [r.name for r in planted]  # 3 meshes' labels, 3 algorithms' masks
    for r in planted:
        assert not r.passed, f"{r.name} passed: the planted fault went unnoticed"
        assert "elements differ" in r.message, r.describe()  # a wrong value, not a crash


def test_head_tail_order_literal():
    """The order the C++ rule assumes (csrc/ops/attention_sequence.cpp, stored_positions), written out:
    4 chunks of 2 -> stored blocks c0 c3 | c1 c2."""
    assert head_tail_order(8, 4).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert shift_labels(torch.tensor([[5, 6, 7]])).tolist() == [[6, 7, -100]]
