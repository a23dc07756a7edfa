"""Level1: a tiny HuggingFace Qwen3.5 text model (hypershard.testing.models' "qwen3_5_text": one
full-attention layer, "sdpa", and one linear-attention layer, the gated delta net with its causal
depthwise conv1d) trains 3 steps of AdamW with clip_grad_norm_ with its sequence sharded over a
context-parallel axis (cp2, dp2 x cp2 and tp2 x cp2 with all-gather-KV attention; cp2 with ring
and dp2 x cp2 with Ulysses, two sequences per dp rank), parallelize, strict mode, against one device
(hypershard.testing.training's checks: every step's loss rtol 1e-5, first-step gradients and final
parameters with the tolerances argued there), with 0 fallback and 0 implicit calls, every
attention call run by the chosen algorithm (hypershard._C.cp_attention_calls). dt_bias's and
A_log's gradients are sums over tokens that nearly cancel: the one-device float32 run is itself
5.5e-5 of their norm from the exact gradient, so the gradients are checked against the same run in
float64 (check_training's `exact`; on tp2 x cp2 the distributed run is 4.5e-5 from it, the two
float32 runs 6.7e-5 from each other). A right-padded batch on dp2 x cp2 (the mask replaced by all
ones) against the one-device run with the mask, which zeroes the pads' inputs to the gated delta
net: the pads come after every real token, so no real token reads them.

parallelize keeps such a model's sequence in NATURAL order (no load-balance declaration): the gated
delta rule's state goes rank to rank (hypershard.parallel.linear_attention) and the conv's halo exchange
reads the previous block (docs/context_parallel.md). SEQ = 128 = 2 x 64: each cp rank's block is one
whole chunk of transformers' chunked rule, as on one device, so the rule's arithmetic is the
one device's. Other lengths (16, 100, 127 tried) pass the loss and gradient checks too, but at 16
and 100 the parameter check fails on dt_bias and A_log alone (1.6e-2 and 2.6e-2 of their update,
allowed 1e-2): 8-element parameters whose gradients are sums of per-token terms that nearly
cancel, so an element at the rounding-noise level takes AdamW's sign-like step either way and
carries 1/8 of the update's norm (the case training.py describes, on a parameter too small for
the 1 % allowance).

Planted faults that must fail the same checks: the recurrent state not passed (every rank's block
starts from zeros), and the head-tail order kept as for softmax-only models (the mesh declared
load-balanced, the inputs permuted: the attention is right, the recurrence and the conv read the
wrong neighbours)."""

import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

STEPS = 3
SEQ = 128


def forget_received_state(model, mesh, axis):
    """The planted fault: every gated delta net's block starts from zeros (the module's forward
    re-bound, as parallelize does, to the cp-aware rule around a function that drops the state)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from hypershard.parallel.linear_attention import _forward_with, context_parallel_chunk_gated_delta_rule

    def forgetful(*args, initial_state=None, **kwargs):
        return torch_chunk_gated_delta_rule(*args, initial_state=None, **kwargs)

    rule = context_parallel_chunk_gated_delta_rule(forgetful, mesh, axis)
    for module in model.modules():
        if type(module).__name__ == "Qwen3_5GatedDeltaNet":
            module.forward = _forward_with(module, "torch_chunk_gated_delta_rule", rule)


def parallelize_keeping_head_tail(model, mesh, algorithm):
    """The planted fault: parallelize as for a softmax-only model (the mesh declared load-balanced,
    the inputs in head-tail order), the gated delta nets' rule installed all the same."""
    from unittest import mock

    from hypershard.parallel import api

    with mock.patch.object(api, "natural_order_reason", lambda model: None):  # the name parallelize reads
        return api.parallelize(model, mesh, cp_algorithm=algorithm)


def trainer(batch, fault=None, algorithm="all_gather_kv", padded=False):
    def config():
        from hypershard.testing.models import tiny_config
        return tiny_config("qwen3_5_text", max_position_embeddings=SEQ)

    def batches(config):
        from hypershard.testing.models import make_batches, right_padded
        plain = make_batches(config.vocab_size, STEPS, batch=batch, seq=SEQ)
        # every odd sample's last 40 tokens masked, labels -100: parallelize replaces the mask by
        # all ones; the one-device run zeroes the pads' inputs to the gated delta net
        return right_padded(plain, 40) if padded else plain

    def reference(_dummy):
        from hypershard.testing.models import tiny_model, train
        return torch.tensor(train(tiny_model(config()), batches(config())), dtype=torch.float64)

    def distributed(_dummy):
        from hypershard.parallel import parallelize
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import check_training, record_cp_training, record_training

        expected = record_training(tiny_model(config()), batches(config()))
        exact = record_training(tiny_model(config()).double(), batches(config()))
        mesh = current_mesh()
        cp = list(mesh.mesh_dim_names).index("cp")
        if fault == "head_tail_kept":
            model = parallelize_keeping_head_tail(tiny_model(config()), mesh, algorithm)
            assert mesh.load_balanced_sequence_axis == cp
        else:
            model = parallelize(tiny_model(config()), mesh, cp_algorithm=algorithm)
            assert mesh.load_balanced_sequence_axis == -1  # natural order for linear attention
        assert mesh.cp_algorithm == algorithm
        if fault == "state_not_passed":
            forget_received_state(model, mesh, cp)
        got, stats, calls = record_cp_training(model, batches(config()), mesh)
        problems, worst = check_training(got, expected, exact)
        if fault is None:
            assert not problems, "\n".join(problems)
            assert stats["implicit_calls"] == 0 and stats["fallback_calls"] == 0, stats
            # one full-attention layer: forward and backward of every step ran the chosen algorithm
            assert calls == {name: 2 * STEPS if name == algorithm else 0 for name in calls}, calls
            return torch.tensor(got.losses, dtype=torch.float64)
        assert problems, f"planted fault {fault!r} was NOT caught; worst ratios {worst}"
        return torch.tensor(expected.losses, dtype=torch.float64)

    return reference, distributed


def _case(name, mesh, reference, distributed):
    return Case(name, reference, [Input((1,), requires_grad=False)], mesh, dist_fn=distributed,
                check_grad=False, rtol=1e-5, atol=0.0)


def test_qwen3_5_trains_on_cp_like_one_device():
    cases = [
        _case("qwen3_5_cp2", ((2,), ("cp",)), *trainer(1)),
        _case("qwen3_5_dp2_cp2", ((2, 2), ("dp", "cp")), *trainer(2)),
        _case("qwen3_5_tp2_cp2", ((2, 2), ("tp", "cp")), *trainer(1)),
        _case("qwen3_5_dp2_cp2_right_padded", ((2, 2), ("dp", "cp")), *trainer(4, padded=True)),
        _case("qwen3_5_cp2_ring", ((2,), ("cp",)), *trainer(1, algorithm="ring")),
        _case("qwen3_5_dp2_cp2_ulysses_two_sequences_per_dp_rank", ((2, 2), ("dp", "cp")),
              *trainer(4, algorithm="ulysses")),
        _case("qwen3_5_cp2_planted_state_not_passed_is_caught", ((2,), ("cp",)),
              *trainer(1, fault="state_not_passed")),
        _case("qwen3_5_cp2_planted_head_tail_kept_is_caught", ((2,), ("cp",)),
              *trainer(1, fault="head_tail_kept")),
    ]
    assert_all_passed(run_cases(cases, backend="hypershard", timeout=600))
