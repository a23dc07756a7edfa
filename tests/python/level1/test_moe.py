"""Level1: the target models train on dp=2 x tp=2 like one device, in strict mode (every op served by a
rule).

Real HuggingFace models, tiny configs from hypershard.testing.models.TINY_CONFIGS, random init, no hub, train 3
steps of AdamW with clip_grad_norm_; parallelize() uses the models' own tensor-parallel plans:

- Qwen3.5 dense (qwen3_5_text: full attention and Gated DeltaNet linear attention);
- Qwen3.5-MoE (qwen3_5_moe_text: 8 routed experts top-2 and a shared expert) and DeepSeek-V3.2
  (deepseek_v32: MLA with the sparse-attention indexer, a dense layer and a MoE layer with shared
  experts), whose plans need the MoE styles: ``experts.gate_up_proj`` packed_colwise,
  ``experts.down_proj`` rowwise (3-d expert weights sharded on the intermediate dim), ``experts``
  moe_tp_experts (Replicate inputs, the Partial(sum) experts output reduced) and DeepSeek's
  ``kv_a_proj_with_mqa`` mla_kv_a_proj;
- Qwen3-VL-MoE (qwen3_vl_moe: Qwen3VLMoeForConditionalGeneration, a MoE text decoder with 8 experts
  top-4 in every layer and M-RoPE, plus a one-block vision tower), text-only batches. Its own tp plan
  shards the attention (q/k/v colwise, o rowwise); the experts (transformers gives them only an ep
  plan) and the vision tower stay Replicate on tp.

A Qwen3-VL-MoE batch WITH images (one 16-patch image per sample) trains strict on dp=2 x tp=2 too: the
image features merged into the dp-sharded embeddings in GLOBAL order (masked_scatter, boolean-mask
indexing: csrc/ops/masked.cpp).

Each case checks that the weights its plan shards really are sharded (not silently left Replicate),
then compares with the single-device run by hypershard.testing.training: every step's loss (rtol
1e-5), first-step gradients and final parameters in norm (tolerances argued there). The harness runs
every rank strict, so a fallback op fails the case, and the case asserts no implicit redistribution.
"""

import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

STEPS = 3
DP2_TP2 = ((2, 2), ("dp", "tp"))


def sharded_on_tp(weight, dim):
    """`weight` is sharded on `dim` over the tp axis (mesh axis 1) and whole elsewhere."""
    import hypershard as hs

    dims = [list(axes) for axes in hs.layout_of(weight).dim_axes]
    assert dims == [[1] if d == dim else [] for d in range(weight.dim())], hs.layout_of(weight)


def experts_sharded(model):
    # gate_up [E, 2I, H] on its packed dim, down [E, H, I] on I
    experts = model.model.layers[1].mlp.experts
    sharded_on_tp(experts.gate_up_proj, 1)
    sharded_on_tp(experts.down_proj, 2)


def attention_sharded(layers):
    def check(model):
        # q_proj [out, in] on out, o_proj on in
        attention = next(layer.self_attn for layer in layers(model) if hasattr(layer, "self_attn"))
        sharded_on_tp(attention.q_proj.weight, 0)
        sharded_on_tp(attention.o_proj.weight, 1)
    return check


def trainer(model_type, check_layouts, batch=4, seq=16):
    def setup():
        from hypershard.testing.models import make_batches, tiny_config

        config = tiny_config(model_type)
        return config, make_batches(config.vocab_size, STEPS, batch=batch, seq=seq)

    def reference(_dummy):
        from hypershard.testing.models import tiny_model, train

        config, batches = setup()
        return torch.tensor(train(tiny_model(config), batches), dtype=torch.float64)

    def distributed(_dummy):
        import hypershard as hs
        from hypershard.parallel import parallelize
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import check_training, record_training

        assert hs.is_strict()
        config, batches = setup()
        expected = record_training(tiny_model(config), batches)
        model = parallelize(tiny_model(config), current_mesh())
        for name, p in model.named_parameters():
            assert isinstance(p, hs.DTensor), name
        check_layouts(model)
        hs._C.reset_dispatch_stats()
        got = record_training(model, batches)
        stats = hs._C.dispatch_stats()
        assert stats["implicit_calls"] == 0, stats
        problems, _ = check_training(got, expected)
        assert not problems, "\n".join(problems)
        return torch.tensor(got.losses, dtype=torch.float64)

    return reference, distributed


def image_batches(steps=STEPS):
    """Two samples, each with one 16-patch image (grid 1 x 4 x 4, merged 2 x 2 into 4 image tokens)."""
    from hypershard.testing.models import make_image_batches

    return make_image_batches(steps)


def vl_image_trainer():
    """Qwen3-VL-MoE on a batch with images, strict mode: pixel_values and the image grids stay
    Replicate (parallelize keeps them whole: their dim 0 is not the batch), the text side is split
    over dp; the image features land in the dp-sharded embeddings by masked_scatter in GLOBAL order
    and the deepstack merge's boolean-mask index / index_put keep the hidden states sharded
    (csrc/ops/masked.cpp). Matches one device with no fallback and no implicit redistribution."""
    def config():
        from hypershard.testing.models import IMAGE_TOKEN, VISION_START, tiny_config

        return tiny_config("qwen3_vl_moe", image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START)

    def reference(_dummy):
        from hypershard.testing.models import tiny_model, train

        return torch.tensor(train(tiny_model(config()), image_batches()), dtype=torch.float64)

    def distributed(_dummy):
        import hypershard as hs
        from hypershard.parallel import parallelize
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import check_training, record_training

        batches = image_batches()
        expected = record_training(tiny_model(config()), batches)
        assert hs.is_strict()
        model = parallelize(tiny_model(config()), current_mesh())
        hs._C.reset_dispatch_stats()
        got = record_training(model, batches)
        stats = hs._C.dispatch_stats()
        assert stats["implicit_calls"] == 0 and stats["fallback_calls"] == 0, stats
        embeds = model.get_input_embeddings()(hs.distribute_tensor(batches[0][0], current_mesh(), ["S(0)", "R"]))
        assert [list(a) for a in hs.layout_of(embeds).dim_axes][0] == [0]  # the text side stays dp-sharded
        problems, _ = check_training(got, expected)
        assert not problems, "\n".join(problems)
        return torch.tensor(got.losses, dtype=torch.float64)

    return reference, distributed


def _case(name, mesh, reference, distributed):
    # The losses the case returns are compared again by the harness (rtol 1e-5, the same
    # LOSS_RTOL); the real checks ran inside `distributed`.
    return Case(name, reference, [Input((1,), requires_grad=False)], mesh, dist_fn=distributed,
                check_grad=False, rtol=1e-5, atol=0.0)


def _train(model_type, check_layouts):
    assert_all_passed(run_cases([_case(f"{model_type}_dp2_tp2", DP2_TP2, *trainer(model_type, check_layouts))],
                                backend="hypershard", timeout=300))


DP2_EP2 = ((2, 2), ("dp", "ep"))


def experts_sharded_on_ep(model):
    """The model's EP plan: the routed experts' weights sharded on the experts dim over ep (axis 1)."""
    import hypershard as hs

    layer = next(layer for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
        assert [list(axes) for axes in hs.layout_of(weight).dim_axes] == [[1], [], []], hs.layout_of(weight)


def test_moe_models_train_on_dp2_ep2_strict():
    """Expert parallelism: each rank runs its experts on local tensors with the routing remapped (transformers'
    EP), the experts' output reduced over ep; strict mode, no implicit redistribution."""
    cases = [_case(f"{m}_dp2_ep2", DP2_EP2, *trainer(m, experts_sharded_on_ep))
             for m in ("qwen3_5_moe_text", "deepseek_v32")]
    assert_all_passed(run_cases(cases, backend="hypershard", timeout=300))


def test_qwen3_5_dense_trains_like_one_device_strict():
    _train("qwen3_5_text", attention_sharded(lambda m: m.model.layers))


def test_qwen3_5_moe_trains_like_one_device_strict():
    _train("qwen3_5_moe_text", experts_sharded)


def test_deepseek_v32_trains_like_one_device_strict():
    _train("deepseek_v32", experts_sharded)


def test_qwen3_vl_moe_text_trains_like_one_device_strict():
    _train("qwen3_vl_moe", attention_sharded(lambda m: m.model.language_model.layers))


def test_qwen3_vl_moe_image_batch_trains_like_one_device_strict():
    assert_all_passed(run_cases([_case("qwen3_vl_moe_image_dp2_tp2", DP2_TP2, *vl_image_trainer())],
                                backend="hypershard", timeout=300))


# ---------------------------------------------------------------------------------- the matrix

MATRIX_MESHES = {"tp4": ((4,), ("tp",)), "dp2_tp2": DP2_TP2, "dp2_ep2": DP2_EP2}
EXPERTS = ("eager", "grouped_mm", "grouped_mm_fallback")


MATRIX_STEPS = 3


def matrix_trainer(model_type, experts=None, sequence_sharded=False, batch=4, **overrides):
    """One model x mesh x experts implementation, strict: `grouped_mm_fallback` is transformers'
    custom op, forced by making its `_can_use_grouped_mm` say no. `sequence_sharded`: the batches
    enter as DTensors sharded on the sequence dim over the (tp) mesh instead of split over dp."""
    def setup():
        from hypershard.testing.models import make_batches, tiny_config

        values = dict(overrides)
        if experts is not None:
            values["experts_implementation"] = "grouped_mm" if experts == "grouped_mm_fallback" else experts
        config = tiny_config(model_type, **values)
        return config, make_batches(config.vocab_size, MATRIX_STEPS, batch=batch, seq=16)

    def run(model_factory):
        import contextlib
        from unittest import mock

        patch = (mock.patch("transformers.integrations.moe._can_use_grouped_mm", lambda *a, **k: False)
                 if experts == "grouped_mm_fallback" else contextlib.nullcontext())
        with patch:
            return model_factory()

    def reference(_dummy):
        from hypershard.testing.models import tiny_model, train

        config, batches = setup()
        return run(lambda: torch.tensor(train(tiny_model(config), batches), dtype=torch.float64))

    def distributed(_dummy):
        import hypershard as hs
        from hypershard.parallel import parallelize
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import check_training, record_training

        config, batches = setup()

        def both():
            expected = record_training(tiny_model(config), batches)
            mesh = current_mesh()
            model = parallelize(tiny_model(config), mesh, shard_inputs=not sequence_sharded)
            inputs = batches
            if sequence_sharded:
                inputs = [tuple(hs.distribute_tensor(t, mesh, ["S(1)"]) for t in b) for b in batches]
            hs._C.reset_dispatch_stats()
            return expected, record_training(model, inputs), hs._C.dispatch_stats()

        expected, got, stats = run(both)
        assert stats["implicit_calls"] == 0 and stats["fallback_calls"] == 0, stats
        problems, _ = check_training(got, expected)
        assert not problems, "\n".join(problems)
        return torch.tensor(got.losses, dtype=torch.float64)

    return reference, distributed


def matrix_cases():
    cases = []
    for model_type in ("qwen3_5_moe_text", "deepseek_v32", "qwen3_vl_moe"):
        for mesh_name, mesh in MATRIX_MESHES.items():
            for experts in EXPERTS:
                cases.append(_case(f"{model_type}_{mesh_name}_{experts}", mesh, *matrix_trainer(model_type, experts)))
    for mesh_name in ("tp4", "dp2_tp2"):
        cases.append(_case(f"qwen3_5_text_{mesh_name}", MATRIX_MESHES[mesh_name], *matrix_trainer("qwen3_5_text")))
    # fewer KV heads than tp ranks: the KV projections stay whole (Megatron's KV replication)
    cases.append(_case("qwen3_5_text_tp4_2_kv_heads", MATRIX_MESHES["tp4"],
                       *matrix_trainer("qwen3_5_text", num_key_value_heads=2)))
    # the sequence dim sharded over tp=2 on the activations; the MoE blocks flatten [B, S, H] with
    # view(-1, H), which keeps a sequence shard whole only for one sequence per batch
    for model_type, batch in (("qwen3", 2), ("qwen3_5_text", 2), ("qwen3_5_moe_text", 1), ("deepseek_v32", 1)):
        cases.append(_case(f"{model_type}_tp2_sequence_sharded", ((2,), ("tp",)),
                           *matrix_trainer(model_type, sequence_sharded=True, batch=batch)))
    return cases


def test_model_mesh_experts_matrix_strict():
    """Every MoE target on tp=4, dp=2 x tp=2 and dp=2 x ep=2 with each experts implementation transformers
    offers (eager: one_hot/greater/where/index_add_; grouped_mm: torch._grouped_mm; its custom-op fallback),
    Qwen3.5 dense on tp=4 (also with 2 KV heads) and dp=2 x tp=2, and the dense and MoE text models on tp=2
    with the sequence dim sharded: 3 AdamW steps in strict mode, no fallback and no implicit
    redistribution, matching one device (hypershard.testing.training)."""
    assert_all_passed(run_cases(matrix_cases(), backend="hypershard", timeout=600))
