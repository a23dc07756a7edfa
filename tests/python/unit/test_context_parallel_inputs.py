"""UT: what parallelize does to a forward's inputs on a context-parallel mesh before sharding them
(hypershard.parallel._head_tail_inputs, docs/context_parallel.md): labels shifted over the whole
natural-order sequence, then input ids, position ids and labels put in head-tail order; refusals
for a length 2 x cp does not divide, a left-padding or 4-D mask and an unknown cp_algorithm
(a right-padding mask is replaced by all ones when no target sits on a pad) (parallelize's and
the mesh's); the causal-LM loss parallelize installs on a cp mesh (causal_lm_loss) against
transformers' ForCausalLMLoss. No processes."""

import pytest
import torch

from hypershard.parallel import CP_ALGORITHMS, parallelize
from hypershard.parallel.context import from_head_tail, head_tail_order, to_head_tail
from hypershard.parallel.inputs import _head_tail_inputs


def test_inputs_in_head_tail_order_with_global_shift():
    ids = torch.arange(8).reshape(1, 8) + 10
    labels = ids.clone()
    labels[0, 5] = -100
    out = _head_tail_inputs({"input_ids": ids, "labels": labels, "attention_mask": torch.ones(1, 8)}, chunks=4)
    order = [0, 1, 6, 7, 2, 3, 4, 5]
    assert out["input_ids"].tolist() == [[10 + p for p in order]]
    assert out["position_ids"].tolist() == [order]
    # position p's target is token p + 1 (-100 after the last, and where labels had -100)
    natural_targets = [11, 12, 13, 14, -100, 16, 17, -100]
    assert out["shift_labels"].tolist() == [[natural_targets[p] for p in order]]
    assert torch.equal(out["labels"], out["shift_labels"])
    # always all ones (the caller's all-ones mask too): without a mask transformers would read the
    # head-tail position ids as packed sequences (use_cache=False)
    assert out["attention_mask"].tolist() == [[1] * 8]
    assert _head_tail_inputs({"input_ids": ids}, chunks=4)["attention_mask"].tolist() == [[1] * 8]


def test_right_padding_mask_is_replaced_by_all_ones():
    """A right-padding mask is dropped (all ones passed) when nothing trains on a pad position:
    the model is causal, so no real token sees a later pad. The last real token's target may be
    anything (its output does not change); a pad's target must be -100."""
    ids = torch.arange(16).reshape(2, 8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0  # row 1: 5 real tokens, 3 pads
    labels = ids.clone()
    labels[1, 6:] = -100  # labels[1, 5] (a pad's token) is the last real token's target: allowed
    out = _head_tail_inputs({"input_ids": ids, "labels": labels, "attention_mask": mask}, chunks=4)
    assert out["attention_mask"].tolist() == [[1] * 8] * 2
    with pytest.raises(ValueError, match="trained target on a pad position"):
        labels[1, 7] = 3  # the target of pad position 6
        _head_tail_inputs({"input_ids": ids, "labels": labels, "attention_mask": mask}, chunks=4)
    # no labels (inference): the pads' outputs may differ, nothing trains on them
    assert _head_tail_inputs({"input_ids": ids, "attention_mask": mask}, chunks=4)["attention_mask"].all()

    class RouterLoss(torch.nn.Module):
        config = type("Config", (), {"output_router_logits": True})()
    with pytest.raises(ValueError, match="auxiliary router loss"):
        _head_tail_inputs({"input_ids": ids, "attention_mask": mask}, chunks=4, module=RouterLoss())
    # the forward's argument wins over the config, either way
    with pytest.raises(ValueError, match="auxiliary router loss"):
        _head_tail_inputs({"input_ids": ids, "attention_mask": mask, "output_router_logits": True}, chunks=4)
    off = {"input_ids": ids, "attention_mask": mask, "output_router_logits": False, "position_ids": ids * 0}
    assert _head_tail_inputs(off, chunks=4, module=RouterLoss())["attention_mask"].all()
    # a caller's shift_labels win over labels (transformers' ForCausalLMLoss), in the check too
    pads_trained = labels.clone()
    out = _head_tail_inputs({"input_ids": ids, "labels": pads_trained, "shift_labels": labels * 0 - 100,
                             "attention_mask": mask}, chunks=4)
    assert (out["shift_labels"] == -100).all() and (out["labels"] == -100).all()


def test_round_trip():
    x = torch.randn(2, 12, 3)
    assert torch.equal(from_head_tail(to_head_tail(x, 1, 6), 1, 6), x)
    assert sorted(head_tail_order(12, 6).tolist()) == list(range(12))


def test_refusals():
    with pytest.raises(ValueError, match="cannot be stored in head-tail order of 4 chunks"):
        _head_tail_inputs({"input_ids": torch.zeros(1, 6, dtype=torch.long)}, chunks=4)
    ids = torch.zeros(2, 8, dtype=torch.long)
    left = torch.ones(2, 8)
    left[1, 0] = 0
    with pytest.raises(ValueError, match="must pad on the right"):
        _head_tail_inputs({"input_ids": ids, "attention_mask": left}, chunks=4)
    with pytest.raises(ValueError, match="4-D attention_mask"):
        _head_tail_inputs({"input_ids": ids, "attention_mask": torch.ones(2, 1, 8, 8).tril()}, chunks=4)
    with pytest.raises(ValueError, match="head-tail chunks"):
        head_tail_order(6, 4)
    assert CP_ALGORITHMS == ("all_gather_kv", "ulysses", "ring")

    class Mesh:
        mesh_dim_names = ("cp",)
        shape = (2,)
    with pytest.raises(ValueError, match="cp_algorithm 'pass_q' is not implemented"):
        parallelize(torch.nn.Linear(2, 2), Mesh(), cp_algorithm="pass_q")


def test_natural_order_reasons():
    """Which models keep natural order on a cp mesh, and parallelize refusing head-tail order for
    them: sdpa Qwen3 alone may be load-balanced."""
    from hypershard.parallel.context import natural_order_reason
    from hypershard.testing.models import tiny_config, tiny_model

    reasons = {
        name: natural_order_reason(tiny_model(tiny_config(model_type, **overrides)))
        for name, model_type, overrides in [
            ("sdpa", "qwen3", {}),
            ("eager", "qwen3", {"attn_implementation": "eager"}),
            ("indexer", "deepseek_v32", {}),
            ("images", "qwen3_vl_moe", {}),
            ("linear attention", "qwen3_5_text", {}),
        ]
    }
    assert reasons["sdpa"] is None, reasons
    assert "'eager' attention adds a causal mask" in reasons["eager"]
    assert "lightning indexer" in reasons["indexer"]
    assert "image features" in reasons["images"]
    assert "linear-attention recurrence" in reasons["linear attention"]

    class Mesh:
        mesh_dim_names = ("cp",)
        shape = (2,)
    with pytest.raises(ValueError, match=r"cp_load_balance=True: this model must keep natural order \(its 'eager'"):
        parallelize(tiny_model(tiny_config("qwen3", attn_implementation="eager")), Mesh(), cp_load_balance=True)


def test_mesh_cp_algorithm():
    """The DeviceMesh property the attention expand reads per call: every name parallelize accepts
    round-trips, an unknown one is refused with the allowed names."""
    from hypershard.testing.planning import PlanningMesh

    mesh = PlanningMesh({"cp": 2}).device_mesh
    assert mesh.cp_algorithm == "all_gather_kv"
    for name in CP_ALGORITHMS:
        mesh.cp_algorithm = name
        assert mesh.cp_algorithm == name
    with pytest.raises(ValueError, match="cp_algorithm 'pass_q' is not known; allowed: all_gather_kv, ulysses, ring"):
        mesh.cp_algorithm = "pass_q"


@pytest.mark.parametrize("given", ["labels", "shift_labels", "num_items_tensor", "num_items_int", "ignore_index"])
def test_causal_lm_loss_is_transformers_loss_without_the_flatten(given):
    """causal_lm_loss (logits as [B, V, L]) gives ForCausalLMLoss's value and logits gradient:
    bfloat16 logits upcast, labels shifted inside or shift_labels taken as given, sum over
    num_items_in_batch or the mean over non-ignored tokens, another ignore_index. Both sum the
    same 24 float32 terms in another order: a few ulps, rtol 1e-6 (~17 u) on the loss and the
    gradient (each gradient element is one softmax row scaled by the same count)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from hypershard.parallel.context import causal_lm_loss, shift_labels

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, 11, generator=g).to(torch.bfloat16)
    ignore = -7 if given == "ignore_index" else -100
    labels = torch.randint(0, 11, (3, 8), generator=g)
    labels[torch.rand(3, 8, generator=g) < 0.25] = ignore
    kwargs = {"ignore_index": ignore}
    if given == "shift_labels":
        kwargs["shift_labels"] = shift_labels(labels, ignore)
        labels = torch.full_like(labels, 3)  # not read when shift_labels are given
    if given.startswith("num_items"):
        kwargs["num_items_in_batch"] = torch.tensor(29) if given == "num_items_tensor" else 29
    results = []
    for loss_fn in (ForCausalLMLoss, causal_lm_loss):
        x = logits.clone().requires_grad_()
        loss = loss_fn(logits=x, labels=labels, vocab_size=11, **kwargs)
        loss.backward()
        results.append((loss, x.grad))
    (want, want_grad), (got, got_grad) = results
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape == ()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=1e-6, atol=0)


def test_causal_lm_loss_refusal_and_installation():
    from hypershard.parallel.context import causal_lm_loss, use_causal_lm_loss
    from hypershard.testing.models import tiny_config, tiny_model

    with pytest.raises(ValueError, match="do not end in vocab_size 12"):
        causal_lm_loss(torch.zeros(1, 4, 11), torch.zeros(1, 4, dtype=torch.long), 12)
    model = tiny_model(tiny_config("qwen3"))
    use_causal_lm_loss(model)
    assert model.loss_function is causal_lm_loss
    assert type(model)(model.config).loss_function is not causal_lm_loss  # this instance only

    def custom(**kwargs):
        return torch.zeros(())

    model.loss_function = custom
    use_causal_lm_loss(model)  # a loss other than ForCausalLMLoss is left alone
    assert model.loss_function is custom
    linear = torch.nn.Linear(2, 2)
    use_causal_lm_loss(linear)  # not a transformers model: nothing to replace
    assert not hasattr(linear, "loss_function")


def test_moe_block_tokens_as_one_run_per_rank():
    """An MoE block's [B, L, H] input with its sequence sharded and two or more sequences per rank
    becomes [1, B x L, H] with the token dim over the batch's axes then the sequence's (every
    rank's tokens one contiguous block), and back; one sequence per rank, a sharded hidden dim
    or a Partial input stay as they are."""
    import hypershard as hs
    from hypershard.parallel.context import _tokens_as_one_run, is_moe_block
    from hypershard.testing.models import tiny_config, tiny_model
    from hypershard.testing.planning import PlanningMesh

    m = PlanningMesh({"dp": 2, "cp": 2}, rank=3)
    hidden = m.dtensor([4, 8, 5], ["S(0)", "S(1)"])
    tokens, back = _tokens_as_one_run(hidden)
    layout = hs._C.layout_of(tokens)
    assert list(layout.global_shape) == [1, 32, 5] and [list(a) for a in layout.dim_axes] == [[], [0, 1], []]
    assert list(hs._C.local_of(tokens).shape) == [1, 8, 5]
    assert hs._C.layout_of(back(tokens)) == hs._C.layout_of(hidden)
    assert _tokens_as_one_run(m.dtensor([2, 8, 5], ["S(0)", "S(1)"])) is None  # one sequence per rank
    assert _tokens_as_one_run(m.dtensor([5, 8, 5], ["S(0)", "S(1)"])) is None  # uneven: decided globally
    assert _tokens_as_one_run(m.dtensor([4, 8, 6], ["S(1)", "S(2)"])) is None  # hidden sharded
    assert _tokens_as_one_run(m.dtensor([4, 8, 5], ["R", "R"])) is None  # sequence whole
    assert _tokens_as_one_run(m.dtensor([4, 8, 5], [hs.Partial(), "S(1)"])) is None  # Partial over dp
    blocks = [type(x).__name__ for x in tiny_model(tiny_config("qwen3_5_moe_text")).modules() if is_moe_block(x)]
    assert blocks and set(blocks) == {"Qwen3_5MoeSparseMoeBlock"}
