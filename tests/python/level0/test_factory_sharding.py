"""Level0: new_* factories keep the source's shards where the new tensor has its extent, and the
summing writes keep their rows sharded with a Partial operand (csrc/ops/tensor_ops.cpp,
along_dims.cpp) -- values and gradients against one device, in strict mode, and no collective
where the model patterns that motivated the rules used to gather (the planner found them in
DeepSeek-V3.2: expand_kv's new_empty filled by slices, the indexer's new_ones(...).scatter mask,
the MoE router's gather whose backward is new_zeros + scatter_add of a Partial gradient).

One launch of 4 ranks, mesh (dp=2, tp=2), uneven sizes."""

import torch

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, in_distributed_run, run_cases
from hypershard.testing.spec import randint

M22 = ((2, 2), ("dp", "tp"))


def _collectives() -> int:
    return hs._C.traffic()["collectives"] if in_distributed_run() else 0


S0, S1, R, P = "Shard(dim=0)", "Shard(dim=1)", "Replicate()", "Partial(sum)"  # as placements print


def _placements(t: torch.Tensor) -> list:
    return [str(p) for p in t.placements]


def _check(ran: int, out: torch.Tensor, placements: list) -> None:
    """In the distributed run: no collective ran and `out` has `placements`."""
    if in_distributed_run():
        assert ran == 0, f"{ran} collective(s) ran"
        assert _placements(out) == placements, (out.placements, placements)


def expand_kv(k_nope, k_rot):
    """DeepSeek-V3.2's expand_kv: a new_empty of the keys' batch / heads / sequence, its last dim
    wider, filled by two slice copies (k_rot broadcast over the heads)."""
    k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
    before = _collectives()
    keys = k_nope.new_empty(*k_nope.shape[:-1], k_nope.shape[-1] + k_rot.shape[-1])
    keys[..., : k_nope.shape[-1]].copy_(k_nope)
    keys[..., k_nope.shape[-1]:].copy_(k_rot)
    _check(_collectives() - before, keys, [S0, S1])
    return keys * 2


def index_mask(topk):
    """The indexer's mask: new_ones of (batch, seq, keys) from the (batch, seq, topk) indices,
    scattered False at the chosen keys."""
    before = _collectives()
    mask = topk.new_ones((topk.shape[0], topk.shape[1], 7), dtype=torch.bool).scatter(-1, topk, False)
    _check(_collectives() - before, mask, [S0, R])
    return mask.to(torch.float32)


def factories(x):
    """Every new_* with the source's shape, a wider last dim, another rank; a Partial source."""
    out = [x.new_full((5, 3), 2.0) + x, x.new_zeros((5, 4)) + 1, x.new_ones((7,)), x.new_empty((5, 3)).fill_(1.5)]
    if in_distributed_run():
        assert [_placements(t) for t in out] == [[S0, S1], [S0, R], [R, R], [S0, S1]]
    return out


def partial_source(x, w):
    """new_ones of a tp-Partial product: the Partial axis is whole, dp keeps the rows."""
    y = x @ w  # (5, 3) @ (3, 4): the contraction sharded over tp -> Partial(sum) on tp
    out = y.new_ones(y.shape)
    if in_distributed_run():
        assert _placements(out) == [S0, R], out.placements
    return out + y


def router_gather_backward(scores, index, w):
    """The MoE router: gather of the top-k scores; the gradient reaching it is Partial over tp (a
    product with tp-sharded columns), so gather's backward (new_zeros + scatter_add) adds a Partial
    gradient into zeros row-sharded over dp: no collective in backward. (The scores are a layer's
    output, not a leaf: a leaf's gradient would be reduced to the leaf's layout.)"""
    scores = scores.detach().requires_grad_() * 1
    out = scores.gather(1, index) @ w
    grad = torch.ones_like(out)
    before = _collectives()
    (g,) = torch.autograd.grad(out, scores, grad)
    _check(_collectives() - before, g, [S0, P])
    return g


def index_add_rows(a, index, v):
    """index_add along dim 0 of a Partial source: dim 1 keeps its dp sharding, Partial passes."""
    before = _collectives()
    out = torch.index_add(a, 0, index, v)
    _check(_collectives() - before, out, [S1, P])
    return out


def cases():
    idx = dict(dtype=torch.int64)
    return [
        Case("expand_kv_new_empty", expand_kv, [Input((5, 4, 6, 3), placements=["S(0)", "S(1)"]),
                                                Input((5, 1, 6, 2), placements=["S(0)", "R"])], M22),
        Case("index_mask_new_ones", index_mask, [Input((5, 6, 2), init=randint(0, 7), placements=["S(0)", "R"],
                                                       **idx)], M22, check_grad=False),
        Case("new_factories", factories, [Input((5, 3), placements=["S(0)", "S(1)"])], M22),
        Case("new_ones_of_partial", partial_source, [Input((5, 3), placements=["S(0)", "S(1)"]),
                                                     Input((3, 4), placements=["R", "S(0)"])], M22),
        Case("router_gather_backward", router_gather_backward,
             [Input((5, 8), placements=["S(0)", "R"]), Input((5, 2), init=randint(0, 8), placements=["S(0)", "R"],
                                                             **idx),
              Input((2, 4), placements=["R", "S(1)"])], M22, check_grad=False),
        Case("index_add_partial_rows", index_add_rows,
             [Input((5, 6), placements=["S(1)", "R"]), Input((7,), init=randint(0, 5), placements=["R", "R"], **idx),
              Input((7, 6), placements=["S(1)", "P"])], M22),
    ]


def test_factories_and_summing_writes_keep_shards():
    assert_all_passed(run_cases(cases(), backend="hypershard", timeout=300))
