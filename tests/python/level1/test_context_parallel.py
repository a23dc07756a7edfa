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
hypershard.context_parallel.causal_lm_loss, which keeps both dims: dp2 x cp2 runs with one and
with two sequences per dp rank. Planted faults that must fail the same checks: the mesh not told
about the head-tail order (the causal mask built from natural positions); on dp2 x cp2 with two
sequences per dp rank, the loss normalised by each rank's own count of trained tokens (the mean
of the per-rank means instead of the global mean). The loss refuses distributed labels without
shift_labels. One run without a KV cache (use_cache=False: transformers then reads the position
ids for packed sequences, which parallelize's all-ones attention mask prevents). Each run checks
that every attention call ran the chosen algorithm (hypershard._C.cp_attention_calls)."""

import pytest
import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

STEPS = 3
SEQ = 16


def local_count_loss(world):
    """The planted fault: each rank's summed token losses over its OWN count of trained tokens,
    averaged over the `world` ranks (the sum is a Partial over them; dividing each part by its
    rank's number keeps it one)."""
    from hypershard.context_parallel import causal_lm_loss

    def loss(logits, labels, vocab_size, ignore_index=-100, shift_labels=None, **kwargs):
        summed = causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=1, ignore_index=ignore_index,
                                shift_labels=shift_labels)
        local = int((shift_labels.to_local() != ignore_index).sum())
        return summed / (max(local, 1) * world)

    return loss


def trainer(batch, fault=None, algorithm="all_gather_kv", use_cache=True):
    def batches(config):
        from hypershard.models import make_batches
        return make_batches(config.vocab_size, STEPS, batch=batch, seq=SEQ)

    def config():
        from hypershard.models import tiny_config
        return tiny_config("qwen3")  # "sdpa" attention

    def reference(_dummy):
        from hypershard.models import tiny_model, train
        return torch.tensor(train(tiny_model(config()), batches(config())), dtype=torch.float64)

    def distributed(_dummy):
        import hypershard as hs
        from hypershard.context_parallel import causal_lm_loss
        from hypershard.models import tiny_model
        from hypershard.parallel import parallelize
        from hypershard.testing.training import check_training, record_training

        expected = record_training(tiny_model(config()), batches(config()))
        mesh = current_mesh()
        model = parallelize(tiny_model(config()), mesh, cp_algorithm=algorithm)
        # without a KV cache transformers would take head-tail position ids for packed sequences
        # unless parallelize passes its all-ones attention mask
        model.config.use_cache = use_cache
        assert mesh.load_balanced_sequence_axis == list(mesh.mesh_dim_names).index("cp")
        assert mesh.cp_algorithm == algorithm
        assert model.loss_function is causal_lm_loss  # HF's flattening loss replaced
        if fault == "head_tail_undeclared":
            mesh.load_balanced_sequence_axis = -1
        if fault == "local_count":
            model.loss_function = local_count_loss(mesh.size())
        hs._C.reset_dispatch_stats()
        hs._C.reset_cp_attention_calls()
        got = record_training(model, batches(config()))
        stats = hs._C.dispatch_stats()
        calls = hs._C.cp_attention_calls()
        mesh.load_balanced_sequence_axis = -1
        mesh.cp_algorithm = "all_gather_kv"  # the cases of one launch share the mesh
        problems, worst = check_training(got, expected)
        if fault is None:
            assert not problems, "\n".join(problems)
            assert stats["implicit_calls"] == 0 and stats["fallback_calls"] == 0, stats
            # every attention call (2 layers, forward and backward, every step) ran the chosen algorithm
            assert calls == {name: 4 * STEPS if name == algorithm else 0 for name in calls}, calls
            # stored rows are in head-tail order: shifting distributed labels would pick wrong targets
            labels = hs.distribute_tensor(torch.zeros(batch, SEQ, dtype=torch.long), mesh)
            with pytest.raises(ValueError, match="distributed labels without shift_labels"):
                causal_lm_loss(torch.zeros(batch, SEQ, config().vocab_size), labels, config().vocab_size)
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
        _case("qwen3_cp2_planted_head_tail_undeclared_is_caught", ((2,), ("cp",)),
              *trainer(1, fault="head_tail_undeclared")),
        _case("qwen3_dp2_cp2_planted_local_count_is_caught", ((2, 2), ("dp", "cp")),
              *trainer(4, fault="local_count")),
    ]
    assert_all_passed(run_cases(cases, backend="hypershard", timeout=600))
