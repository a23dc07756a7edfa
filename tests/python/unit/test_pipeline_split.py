"""UT: the pipeline stage split of each target model (hypershard.pipelining.split) -- which modules and
layers on which stage and pp rank -- checked by running the stages in sequence on one process against
the whole model's logits; and every bad-input error, one line in hypershard's format."""

import pytest
import torch

from hypershard.pipelining import PipelineError, StageModule, check_schedule, split_model, stage_model
from hypershard.testing.models import (
    IMAGE_TOKEN,
    VISION_START,
    make_batches,
    make_image_batches,
    tiny_config,
    tiny_model,
)

MODELS = {
    # model type -> (config overrides, the prefix of its decoder's modules)
    "qwen3": ({"num_hidden_layers": 4}, "model"),
    "qwen3_5_text": (
        {"num_hidden_layers": 4, "layer_types": ["full_attention", "linear_attention"] * 2},
        "model",
    ),
    "qwen3_5_moe_text": (
        {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2},
        "model",
    ),
    "deepseek_v32": ({"num_hidden_layers": 4}, "model"),
    "qwen3_vl_moe": ({}, "model.language_model"),
}


def _model(model_type):
    overrides, _ = MODELS[model_type]
    if model_type == "qwen3_vl_moe":
        config = tiny_config(model_type, image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START)
        config.text_config.num_hidden_layers = 4
        config.num_hidden_layers = 4
    else:
        config = tiny_config(model_type, **overrides)
    return tiny_model(config)


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_split_modules_and_ranks(model_type):
    model = _model(model_type)
    prefix = MODELS[model_type][1]
    specs = split_model(model, 2)
    assert [(s.index, s.rank, s.layers) for s in specs] == [(0, 0, (0, 1)), (1, 1, (2, 3))]
    first = [f"{prefix}.embed_tokens"] + (["model.visual"] if model_type == "qwen3_vl_moe" else [])
    assert specs[0].modules == first + [f"{prefix}.rotary_emb", f"{prefix}.layers.0", f"{prefix}.layers.1"]
    assert specs[1].modules == [
        f"{prefix}.rotary_emb",
        f"{prefix}.layers.2",
        f"{prefix}.layers.3",
        f"{prefix}.norm",
        "lm_head",
    ]
    # interleaved: 4 stages of one layer, stage s on pp rank s % 2
    specs = split_model(model, 2, stages_per_rank=2)
    assert [(s.index, s.rank, s.layers) for s in specs] == [(0, 0, (0,)), (1, 1, (1,)), (2, 0, (2,)), (3, 1, (3,))]
    # 3 stages of 4 layers: the first one layer more
    assert [s.layers for s in split_model(model, 3)] == [(0, 1), (2,), (3,)]


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_stages_in_sequence_equal_the_model(model_type):
    """The stage models hold exactly their modules' parameters (names unchanged), and run in sequence
    they give the whole model's logits (masks, rotary, layer types, deepstack as in its forward)."""
    model = _model(model_type)
    names = dict(model.named_parameters())
    specs = split_model(model, 2, stages_per_rank=2)
    parts = [stage_model(model, s) for s in specs]
    held = [set(dict(p.named_parameters())) for p in parts]
    assert set().union(*held) == set(names) and sum(map(len, held)) == len(names)
    for spec, part in zip(specs, parts):
        for name, p in part.named_parameters():
            assert any(name.startswith(m + ".") for m in spec.modules), name
            assert torch.equal(p, names[name])
    if model_type == "qwen3_vl_moe":
        ids, _, images = make_image_batches(1, batch=2)[0]
    else:
        ids, _ = make_batches(model.config.vocab_size, 1, batch=2, seq=16)[0]
        images = {}
    with torch.no_grad():
        expected = model(input_ids=ids, **images).logits
        side = {}
        if images:
            side["position_ids"], _ = model.model.get_rope_index(
                ids, **{k: images[k] for k in ("image_grid_thw", "mm_token_type_ids")}
            )
        x = ids
        for spec, part in zip(specs, parts):
            module = StageModule(part, spec)
            module.side = [dict(side, images=images) if spec.first else dict(side)]
            x = module(x)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)


def test_more_stages_than_layers():
    with pytest.raises(PipelineError) as error:
        split_model(tiny_model(tiny_config("qwen3")), 2, stages_per_rank=2)
    assert str(error.value) == (
        "hypershard: pipeline: 4 stages (pp=2 x 2 per rank) for 2 decoder layers; allowed: at most 2 stages"
    )


def test_deepstack_beyond_the_first_stage():
    config = tiny_config("qwen3_vl_moe")
    config.vision_config.deepstack_visual_indexes = [0, 1]
    with pytest.raises(PipelineError, match="deepstack features go into layers 0..1, but the first stage holds 1"):
        split_model(tiny_model(config), 2)


def test_tied_embeddings_refused():
    with pytest.raises(PipelineError, match="ties lm_head to embed_tokens.*allowed: tie_word_embeddings=False"):
        split_model(tiny_model(tiny_config("qwen3", tie_word_embeddings=True)), 2)


def test_a_model_without_the_expected_modules():
    model = tiny_model(tiny_config("qwen3"))
    del model.model.rotary_emb
    with pytest.raises(PipelineError, match="decoder Qwen3Model has no 'rotary_emb'"):
        split_model(model, 2)


@pytest.mark.parametrize(
    "schedule, pp, per_rank, n, message",
    [
        ("1f1b", 2, 1, 1, "schedule 1f1b on 2 stages needs at least 2 microbatches, got 1; allowed: >= 2"),
        (
            "interleaved_1f1b",
            2,
            2,
            5,
            "schedule interleaved_1f1b on pp=2 runs max(1, 5 // 2) = 2 rounds, which do not divide 5 microbatches",
        ),
        ("gpipe", 2, 2, 4, "2 stages per rank with schedule 'gpipe'; allowed: 1, or schedule interleaved_1f1b"),
        ("zero_bubble", 2, 1, 4, "unknown schedule 'zero_bubble'; allowed: gpipe, 1f1b, interleaved_1f1b"),
    ],
)
def test_schedule_needs_more_microbatches(schedule, pp, per_rank, n, message):
    with pytest.raises(PipelineError) as error:
        check_schedule(schedule, pp, per_rank, n)
    assert message in str(error.value) and str(error.value).startswith("hypershard: pipeline: ")
    assert "\n" not in str(error.value)


def test_torch_agrees_on_the_interleaved_rule():
    """The microbatch counts check_schedule accepts for Interleaved1F1B are the ones torch's
    constructor accepts (its rule: n % max(1, n // pp) == 0)."""
    for n in range(1, 13):
        rounds = max(1, n // 2)
        ok = n % rounds == 0
        try:
            check_schedule("interleaved_1f1b", 2, 2, n)
            accepted = True
        except PipelineError:
            accepted = False
        assert accepted == ok, n
