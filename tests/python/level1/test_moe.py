"""Level1: MoE models train on dp=2 x tp=2 like one device, in strict mode (every op served by a rule).

A real HuggingFace Qwen3.5-MoE (qwen3_5_moe_text: full + linear attention, 8 routed experts top-2 and a
shared expert) and DeepSeek-V3.2 (deepseek_v32: MLA with the sparse-attention indexer, a dense layer and
a MoE layer with shared experts), tiny configs from hypershard.models.TINY_CONFIGS, random init, no hub,
train 3 steps of AdamW with clip_grad_norm_. parallelize() uses the models' own tensor-parallel plans,
which need the MoE styles: ``experts.gate_up_proj`` packed_colwise, ``experts.down_proj`` rowwise
(3-d expert weights sharded on the intermediate dim), ``experts`` moe_tp_experts (Replicate inputs,
the Partial(sum) experts output reduced) and DeepSeek's ``kv_a_proj_with_mqa`` mla_kv_a_proj.
Compared with the single-device run by hypershard.testing.training: every step's loss (rtol 1e-5),
first-step gradients and final parameters in norm (tolerances argued there). The harness runs every
rank strict, so a fallback op or a refused layout (an implicit redistribution) fails the case.
"""

import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

STEPS = 3
DP2_TP2 = ((2, 2), ("dp", "tp"))


def trainer(model_type, batch=4, seq=16):
    def setup():
        from hypershard.models import make_batches, tiny_config

        config = tiny_config(model_type)
        return config, make_batches(config.vocab_size, STEPS, batch=batch, seq=seq)

    def reference(_dummy):
        from hypershard.models import tiny_model, train

        config, batches = setup()
        return torch.tensor(train(tiny_model(config), batches), dtype=torch.float64)

    def distributed(_dummy):
        import hypershard as hs
        from hypershard.models import tiny_model
        from hypershard.parallel import parallelize
        from hypershard.testing.training import check_training, record_training

        assert hs.is_strict()
        config, batches = setup()
        expected = record_training(tiny_model(config), batches)
        model = parallelize(tiny_model(config), current_mesh())
        for name, p in model.named_parameters():
            assert isinstance(p, hs.DTensor), name
        # The experts' weights really are sharded over tp (axis 1): gate_up [E, 2I, H] on its packed
        # dim, down [E, H, I] on I -- not silently left Replicate.
        experts = model.model.layers[1].mlp.experts
        for weight, dim in ((experts.gate_up_proj, 1), (experts.down_proj, 2)):
            dims = [list(axes) for axes in hs.layout_of(weight).dim_axes]
            assert dims == [[1] if d == dim else [] for d in range(3)], hs.layout_of(weight)
        hs._C.reset_dispatch_stats()
        got = record_training(model, batches)
        stats = hs._C.dispatch_stats()
        assert stats["implicit_calls"] == 0, stats
        problems, _ = check_training(got, expected)
        assert not problems, "\n".join(problems)
        return torch.tensor(got.losses, dtype=torch.float64)

    return reference, distributed


def _case(name, mesh, reference, distributed):
    # The losses the case returns are compared again by the harness (rtol 1e-5, the same
    # LOSS_RTOL); the real checks ran inside `distributed`.
    return Case(name, reference, [Input((1,), requires_grad=False)], mesh, dist_fn=distributed,
                check_grad=False, rtol=1e-5, atol=0.0)


def test_qwen3_5_moe_trains_like_one_device_strict():
    assert_all_passed(run_cases([_case("qwen3_5_moe_text_dp2_tp2", DP2_TP2, *trainer("qwen3_5_moe_text"))],
                                backend="hypershard", timeout=300))


def test_deepseek_v32_trains_like_one_device_strict():
    assert_all_passed(run_cases([_case("deepseek_v32_dp2_tp2", DP2_TP2, *trainer("deepseek_v32"))],
                                backend="hypershard", timeout=300))



# Qwen3-VL-MoE (qwen3_vl_moe: Qwen3VLMoeForConditionalGeneration, a MoE text decoder with 8 experts top-4
# in every layer and M-RoPE, plus a one-block vision tower), text-only batches. Its own tp plan shards the
# attention (q/k/v colwise, o rowwise); the experts (transformers gives them only an ep plan) and the vision
# tower stay Replicate on tp.
def vl_text_trainer():
    def setup():
        from hypershard.models import make_batches, tiny_config

        config = tiny_config("qwen3_vl_moe")
        return config, make_batches(config.vocab_size, STEPS)

    def reference(_dummy):
        from hypershard.models import tiny_model, train

        config, batches = setup()
        return torch.tensor(train(tiny_model(config), batches), dtype=torch.float64)

    def distributed(_dummy):
        import hypershard as hs
        from hypershard.models import tiny_model
        from hypershard.parallel import parallelize
        from hypershard.testing.training import check_training, record_training

        assert hs.is_strict()
        config, batches = setup()
        expected = record_training(tiny_model(config), batches)
        model = parallelize(tiny_model(config), current_mesh())
        for name, p in model.named_parameters():
            assert isinstance(p, hs.DTensor), name
        # Attention really is sharded over tp (axis 1): q_proj [out, in] on out, o_proj on in.
        attn = model.model.language_model.layers[0].self_attn
        for weight, dim in ((attn.q_proj.weight, 0), (attn.o_proj.weight, 1)):
            dims = [list(axes) for axes in hs.layout_of(weight).dim_axes]
            assert dims == [[1] if d == dim else [] for d in range(2)], hs.layout_of(weight)
        hs._C.reset_dispatch_stats()
        got = record_training(model, batches)
        stats = hs._C.dispatch_stats()
        assert stats["implicit_calls"] == 0, stats
        problems, _ = check_training(got, expected)
        assert not problems, "\n".join(problems)
        return torch.tensor(got.losses, dtype=torch.float64)

    return reference, distributed


def test_qwen3_vl_moe_text_trains_like_one_device_strict():
    assert_all_passed(run_cases([_case("qwen3_vl_moe_text_dp2_tp2", DP2_TP2, *vl_text_trainer())],
                                backend="hypershard", timeout=300))
