"""Level1: a tiny HuggingFace Qwen3ForCausalLM (random init, "sdpa" attention) trains 3 steps of
AdamW with clip_grad_norm_ with its sequence sharded over a context-parallel axis (cp2,
dp2 x cp2 with batch 2 and 4 and tp2 x cp2: heads over tp, the model's own tensor-parallel plan)
with each attention algorithm (parallelize(..., cp_algorithm=...): all-gather-KV on every mesh,
ring and Ulysses on two each), strict mode, against one device
(hypershard.testing.training's checks: every step's loss rtol 1e-5, first-step gradients and final
parameters with the tolerances argued there), with 0 fallback and 0 implicit calls.

parallelize stores the sequence in head-tail order (docs/context_parallel.md): input ids, position
ids and the labels (shifted over the whole sequence first) are permuted and sharded over cp; the
attention all-gathers K/V with the causal mask from global positions. parallelize replaces HF's
loss (which flattens (batch, seq), a whole block per rank only with one sequence per dp rank) by
hypershard.parallel.context.causal_lm_loss, which keeps both dims: dp2 x cp2 runs with one and
with two sequences per dp rank. Planted faults that must fail the same checks: the mesh not told
about the head-tail order (the causal mask built from natural positions); on dp2 x cp2 with two
sequences per dp rank, the loss normalised by each rank's own count of trained tokens (the mean
of the per-rank means instead of the global mean). The loss refuses distributed labels without
shift_labels. The Qwen3 runs pass use_cache=True (the cache's first update must keep K/V
sharded), one passes nothing: parallelize's default in training is no cache, and without one
transformers reads the position ids for packed sequences, which parallelize's all-ones attention
mask prevents. Each run checks that every attention call ran the chosen algorithm
(hypershard._C.cp_attention_calls). Qwen3 with eager attention (matmul, softmax and a causal mask
transformers builds from natural positions) keeps natural order on dp2 x cp2: in head-tail order
it trained wrong silently (losses off by 3e-4, gradients by 0.3 to 0.8 of their norm).
A right-padded batch (every odd sample's last 5 tokens masked, labels -100) on dp2 x cp2 with
ring: parallelize replaces the mask by all ones, against the one-device run with the mask.

DeepSeek-V3.2 (cp2 ring, dp2 x cp2, tp2 x cp2, ep2 x cp2 Ulysses), Qwen3-VL-MoE (an image per sample, its 4 tokens
across the cp boundary, on cp2 ring, dp2 x cp2 Ulysses and tp2 x cp2 all-gather-KV: the image merge
keeps the sequence sharded; text on tp2 x cp2 ring, ep2 x cp2 Ulysses) and Qwen3.5-MoE (ep2 x cp2 ring, its
gated delta nets' state passed rank to rank) keep natural order (hypershard.parallel.context.natural_order_reason).
Their MoE blocks flatten (batch, sequence) into tokens, which cuts through a sharded sequence with
two or more sequences per rank: parallelize hands such a block its tokens as one run per rank
(context_parallel.tokens_in_rank_order); DeepSeek-V3.2 on dp2 x cp2, Qwen3-VL-MoE with images on
dp2 x cp2 and Qwen3.5-MoE on ep2 x cp2 run two sequences per rank."""

import pytest
import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

STEPS = 3
SEQ = 16


def local_count_loss(world):
    """The planted fault: each rank's summed token losses over its OWN count of trained tokens,
    averaged over the `world` ranks (the sum is a Partial over them; dividing each part by its
    rank's number keeps it one)."""
    from hypershard.parallel.context import causal_lm_loss

    def loss(logits, labels, vocab_size, ignore_index=-100, shift_labels=None, **kwargs):
        summed = causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=1, ignore_index=ignore_index,
                                shift_labels=shift_labels)
        local = int((shift_labels.to_local() != ignore_index).sum())
        return summed / (max(local, 1) * world)

    return loss


def trainer(batch, fault=None, algorithm="all_gather_kv", use_cache=True, model_type="qwen3", images=False,
            attention="sdpa", padded=False):
    """Qwen3 ("sdpa" attention) by default; `model_type` another tiny model, `images` a
    Qwen3-VL-MoE batch with one image per sample, `attention` transformers' attn_implementation,
    `padded` every odd sample's last 5 tokens right padding (hypershard.testing.models.right_padded)."""
    def batches(config):
        from hypershard.testing.models import make_batches, make_image_batches, right_padded
        if images:
            # the image's 4 tokens at 6-9 cross the cp2 boundary at 8
            return make_image_batches(STEPS, seq=SEQ, batch=batch, image_at=6)
        plain = make_batches(config.get_text_config().vocab_size, STEPS, batch=batch, seq=SEQ)
        if padded:
            plain = right_padded(plain, 5)
        # parallelize turns the cache off in training unless the caller asks for one: Qwen3 runs
        # ask (K/V must stay sharded through the cache's first update, a cat), one run does not
        if model_type == "qwen3" and use_cache:
            return [(ids, labels, {**(rest[0] if rest else {}), "use_cache": True}) for ids, labels, *rest in plain]
        return plain

    def config():
        from hypershard.testing.models import IMAGE_TOKEN, VISION_START, tiny_config
        if images:
            return tiny_config(model_type, image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START)
        return tiny_config(model_type, attn_implementation=attention)

    def reference(_dummy):
        from hypershard.testing.models import tiny_model, train
        return torch.tensor(train(tiny_model(config()), batches(config())), dtype=torch.float64)

    def distributed(_dummy):
        import hypershard as hs
        from hypershard.parallel import parallelize
        from hypershard.parallel.context import causal_lm_loss
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import check_training, record_cp_training, record_training

        expected = record_training(tiny_model(config()), batches(config()))
        mesh = current_mesh()
        from hypershard.parallel.context import natural_order_reason

        model = parallelize(tiny_model(config()), mesh, cp_algorithm=algorithm)
        # without a KV cache transformers would take head-tail position ids for packed sequences
        # unless parallelize passes its all-ones attention mask
        balanced = natural_order_reason(model) is None  # sdpa Qwen3 only: the others keep natural order
        assert balanced == (model_type == "qwen3" and attention == "sdpa")
        assert mesh.load_balanced_sequence_axis == (list(mesh.mesh_dim_names).index("cp") if balanced else -1)
        assert mesh.cp_algorithm == algorithm
        assert model.loss_function is causal_lm_loss  # HF's flattening loss replaced
        if fault == "head_tail_undeclared":
            mesh.load_balanced_sequence_axis = -1
        if fault == "local_count":
            model.loss_function = local_count_loss(mesh.size())
        got, stats, calls = record_cp_training(model, batches(config()), mesh)
        problems, worst = check_training(got, expected)
        if fault is None:
            assert not problems, "\n".join(problems)
            assert stats["implicit_calls"] == 0 and stats["fallback_calls"] == 0, stats
            # every attention call (2 layers, forward and backward, every step) ran the chosen
            # algorithm; DeepSeek-V3.2's attention (a mask from its indexer) takes sdpa's math path
            # on CPU (matmul, softmax: K gathered by the matmul rule), no attention kernel call; so
            # does eager attention (and its mask, built by transformers from natural positions).
            # With an image, the merge (masked_scatter, the deepstack's x[mask] and x[mask] = v) keeps
            # the sequence sharded, so the attention calls stay sequence-sharded too
            text = config().get_text_config()
            layers = (getattr(text, "layer_types", None) or []).count("full_attention") or text.num_hidden_layers
            want = 0 if model_type == "deepseek_v32" or attention != "sdpa" else 2 * layers * STEPS
            assert calls == {name: want if name == algorithm else 0 for name in calls}, calls
            # stored rows are in head-tail order: shifting distributed labels would pick wrong targets
            vocab = config().get_text_config().vocab_size
            labels = hs.distribute_tensor(torch.zeros(batch, SEQ, dtype=torch.long), mesh)
            with pytest.raises(ValueError, match="distributed labels without shift_labels"):
                causal_lm_loss(torch.zeros(batch, SEQ, vocab), labels, vocab)
            return torch.tensor(got.losses, dtype=torch.float64)
        assert problems, f"planted fault {fault!r} was NOT caught; worst ratios {worst}"
        return torch.tensor(expected.losses, dtype=torch.float64)

    return reference, distributed


def _case(name, mesh, reference, distributed):
    return Case(name, reference, [Input((1,), requires_grad=False)], mesh, dist_fn=distributed,
                check_grad=False, rtol=1e-5, atol=0.0)


def test_qwen3_trains_on_cp_like_one_device():
    cases = [
        _case("qwen3_cp2", ((2,), ("cp",)), *trainer(1)),
        _case("qwen3_dp2_cp2", ((2, 2), ("dp", "cp")), *trainer(2)),
        _case("qwen3_dp2_cp2_two_sequences_per_dp_rank", ((2, 2), ("dp", "cp")), *trainer(4)),
        _case("qwen3_tp2_cp2", ((2, 2), ("tp", "cp")), *trainer(1)),
        # 4 query and KV heads: Ulysses divides them over cp2, and over cp2 after tp2
        _case("qwen3_cp2_ring", ((2,), ("cp",)), *trainer(1, algorithm="ring")),
        _case("qwen3_dp2_cp2_ring_no_cache", ((2, 2), ("dp", "cp")), *trainer(4, algorithm="ring", use_cache=False)),
        _case("qwen3_dp2_cp2_ulysses", ((2, 2), ("dp", "cp")), *trainer(4, algorithm="ulysses")),
        _case("qwen3_tp2_cp2_ulysses", ((2, 2), ("tp", "cp")), *trainer(1, algorithm="ulysses")),
        # eager attention keeps natural order (its causal mask comes from natural positions)
        _case("qwen3_eager_dp2_cp2", ((2, 2), ("dp", "cp")), *trainer(2, attention="eager")),
        # right padding: parallelize replaces the mask by all ones (nothing trains on a pad)
        _case("qwen3_dp2_cp2_ring_right_padded", ((2, 2), ("dp", "cp")), *trainer(4, algorithm="ring", padded=True)),
        # natural order (hypershard.parallel.context.natural_order_reason): DeepSeek-V3.2 (its
        # indexer's mask), Qwen3-VL-MoE with an image per sample (M-RoPE ids from get_rope_index);
        # their MoE blocks flatten (batch, sequence): with two sequences per rank they take the
        # tokens as one run per rank (context_parallel.tokens_in_rank_order)
        _case("deepseek_v32_cp2_ring", ((2,), ("cp",)), *trainer(1, algorithm="ring", model_type="deepseek_v32")),
        _case("deepseek_v32_dp2_cp2_two_sequences_per_dp_rank", ((2, 2), ("dp", "cp")),
              *trainer(4, model_type="deepseek_v32")),
        _case("qwen3_vl_moe_image_cp2_ring", ((2,), ("cp",)),
              *trainer(1, algorithm="ring", model_type="qwen3_vl_moe", images=True)),
        _case("qwen3_vl_moe_image_dp2_cp2_ulysses_two_sequences_per_dp_rank", ((2, 2), ("dp", "cp")),
              *trainer(4, algorithm="ulysses", model_type="qwen3_vl_moe", images=True)),
        _case("qwen3_vl_moe_image_tp2_cp2", ((2, 2), ("tp", "cp")),
              *trainer(1, model_type="qwen3_vl_moe", images=True)),
        # tensor and expert parallelism beside cp
        _case("deepseek_v32_tp2_cp2", ((2, 2), ("tp", "cp")), *trainer(1, model_type="deepseek_v32")),
        _case("deepseek_v32_ep2_cp2_ulysses_two_sequences_per_rank", ((2, 2), ("ep", "cp")),
              *trainer(2, algorithm="ulysses", model_type="deepseek_v32")),
        _case("qwen3_vl_moe_tp2_cp2_ring", ((2, 2), ("tp", "cp")),
              *trainer(1, algorithm="ring", model_type="qwen3_vl_moe")),
        _case("qwen3_vl_moe_ep2_cp2_ulysses", ((2, 2), ("ep", "cp")),
              *trainer(1, algorithm="ulysses", model_type="qwen3_vl_moe")),
        _case("qwen3_5_moe_ep2_cp2_ring_two_sequences_per_rank", ((2, 2), ("ep", "cp")),
              *trainer(2, algorithm="ring", model_type="qwen3_5_moe_text")),
        _case("qwen3_cp2_planted_head_tail_undeclared_is_caught", ((2,), ("cp",)),
              *trainer(1, fault="head_tail_undeclared")),
        _case("qwen3_dp2_cp2_planted_local_count_is_caught", ((2, 2), ("dp", "cp")),
              *trainer(4, fault="local_count")),
    ]
    assert_all_passed(run_cases(cases, backend="hypershard", timeout=600))
