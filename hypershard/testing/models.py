"""Tiny HuggingFace models and a training loop shared by `make demo`, hypershard.tools.coverage and
the Level1 tests. Models are built from a config with random weights (no hub access)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["TINY_CONFIGS", "make_batches", "tiny_config", "tiny_model", "train"]


def _qwen3_5_text(**mlp) -> dict:
    """The tiny Qwen3.5 text config both qwen3_5_text and qwen3_5_moe_text build on, with its MLP
    sizes `mlp`; a fresh dict each call (no nested dict shared between the two entries)."""
    return dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        layer_types=["full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        linear_conv_kernel_dim=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        **mlp,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10000.0,
            partial_rotary_factor=0.25,
            mrope_section=[2, 1, 1],
            mrope_interleaved=True,
        ),
    )


# Sizes divisible by 2 and 4 (heads, kv heads, intermediate, vocab) unless overridden.
TINY_CONFIGS: dict = {
    "qwen3": dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
    # Qwen3.5 dense: one full-attention (gated q) and one linear-attention (Gated DeltaNet) layer. Rotary on
    # head_dim * 0.25 = 8 dims (4 frequencies = sum(mrope_section)). use_cache=False: with a cache the
    # linear-attention layers copy_ activations into plain cache tensors.
    "qwen3_5_text": _qwen3_5_text(intermediate_size=64),
    # Qwen3.5-MoE: as qwen3_5_text with 8 routed experts (top-2) and a shared expert in every layer.
    "qwen3_5_moe_text": _qwen3_5_text(
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    # DeepSeek-V3.2: MLA, the sparse-attention indexer (index_topk < the sequence length), grouped routing
    # (num_experts_per_tok <= topk_group * n_routed_experts / n_group), layer 0 dense and layer 1 MoE.
    "deepseek_v32": dict(
        use_cache=False,
        vocab_size=128,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        qk_nope_head_dim=32,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=8,
    ),
    # Qwen3-VL-MoE (a Qwen3VLMoeForConditionalGeneration, not an AutoModelForCausalLM; see tiny_model): a MoE
    # text decoder (8 experts top-4 in every layer, mrope on head_dim 8 = 4 frequencies) and a one-block vision
    # tower whose merger outputs the text hidden size. The image/video token ids stay the defaults (outside
    # the tiny vocab) so random text batches hold none; image batches override them below vocab_size.
    "qwen3_vl_moe": dict(
        tie_word_embeddings=False,
        text_config=dict(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=4,
            decoder_sparse_step=1,
            max_position_embeddings=64,
            use_cache=False,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1], mrope_interleaved=True
            ),
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=32,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
    ),
}

# Model types whose model class is not an AutoModelForCausalLM: (transformers class name).
_MODEL_CLASSES = {"qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}


def tiny_config(model_type: str, **overrides: Any):
    """A tiny transformers config of `model_type` (see TINY_CONFIGS), with `overrides`."""
    from transformers import AutoConfig

    values = dict(TINY_CONFIGS.get(model_type, {}))
    values.update(overrides)
    config = AutoConfig.for_model(model_type, **values)
    config._attn_implementation = values.get("attn_implementation", "sdpa")
    if getattr(config, "vocab_size", None) is None and hasattr(config, "text_config"):
        config.vocab_size = config.text_config.vocab_size  # what make_batches draws token ids from
    return config


def tiny_model(config, seed: int = 0) -> torch.nn.Module:
    """The causal-LM model of `config` with weights drawn from `seed` (identical on every rank)."""
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if config.model_type in _MODEL_CLASSES:
        cls = getattr(transformers, _MODEL_CLASSES[config.model_type])
        model = cls._from_config(config, attn_implementation=config._attn_implementation)
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    return model.float().train()


def make_batches(
    vocab_size: int, steps: int, batch: int = 4, seq: int = 16, seed: int = 1, ignore_fraction: float = 0.1
) -> list:
    """`steps` batches of (input_ids, labels) with some labels set to the ignore index -100."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
        labels = ids.clone()
        labels[torch.rand(batch, seq, generator=g) < ignore_fraction] = -100
        batches.append((ids, labels))
    return batches


# Token ids of the tiny vision-language config's image markers (inside its vocab).
IMAGE_TOKEN, VISION_START = 120, 121


def make_image_batches(steps: int, seq: int = 16, batch: int = 2, seed: int = 0, image_at: int = 3) -> list:
    """`steps` batches (input_ids, labels, image inputs) for tiny_config("qwen3_vl_moe",
    image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START): each sample holds one
    16-patch image (grid 1 x 4 x 4, merged 2 x 2 into 4 image tokens at positions `image_at` to
    `image_at` + 3), the text before it unlabelled."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 100, (batch, seq), generator=g)
        ids[:, image_at - 1] = VISION_START
        ids[:, image_at : image_at + 4] = IMAGE_TOKEN
        labels = ids.clone()
        labels[:, : image_at + 4] = -100
        images = {
            "pixel_values": torch.randn(16 * batch, 3 * 2 * 4 * 4, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 4]] * batch),
            "mm_token_type_ids": (ids == IMAGE_TOKEN).long(),
        }
        out.append((ids, labels, images))
    return out


def right_padded(batches: list, pads: int) -> list:
    """`batches` (as make_batches gives them, or with an inputs dict) with every odd sample padded on
    the right: its last `pads` tokens masked out of an ``attention_mask`` and their labels -100."""
    out = []
    for ids, labels, *rest in batches:
        mask = torch.ones_like(ids)
        mask[1::2, -pads:] = 0
        out.append((ids, labels.masked_fill(mask == 0, -100), {**(rest[0] if rest else {}), "attention_mask": mask}))
    return out


def train(
    model: torch.nn.Module,
    batches: list,
    lr: float = 1e-3,
    clip: Optional[float] = 1.0,
    on_step: Optional[Callable[[int, float], None]] = None,
    on_backward: Optional[Callable[[int, torch.nn.Module], None]] = None,
) -> list:
    """AdamW steps (one per batch) with clip_grad_norm_; returns the loss of every step. A batch is
    (input_ids, labels), or (input_ids, labels, inputs) with `inputs` a dict of further model inputs
    (pixel_values, image_grid_thw, ...). `on_backward(step, model)` runs after each backward, before
    clipping and the step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for step, (ids, labels, *rest) in enumerate(batches):
        loss = model(input_ids=ids, labels=labels, **(rest[0] if rest else {})).loss
        optimizer.zero_grad()
        loss.backward()
        if on_backward is not None:
            on_backward(step, model)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        value = float(loss.detach().item())
        losses.append(value)
        if on_step is not None:
            on_step(step, value)
    return losses
