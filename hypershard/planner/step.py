"""One training step (forward, backward, clip_grad_norm_, AdamW) of a HuggingFace model on a
hypershard mesh, and the per-rank byte counts of its tensor classes. The planner runs it on the
meta device over a simulated mesh; the validation runs the same code on real tensors over gloo.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

from .. import _C
from ..testing.models import _MODEL_CLASSES  # the model types that are not an AutoModelForCausalLM
from .memory import storage_key

__all__ = [
    "PUBLISHED",
    "RECOMPUTE",
    "REPLICATE_AXIS",
    "apply_recompute",
    "check_hsdp",
    "data_parallel",
    "hsdp_mesh",
    "StepBytes",
    "build_model",
    "load_config",
    "make_batch",
    "shard_model",
    "state_bytes",
    "train_step",
]

# Published configs transformers' defaults do not give. Checked against the published sizes in
# docs/planner.md ("The published configs, checked"): Qwen3.5-0.8B's text model is 0.752 B (the
# card's 0.8B; its checkpoint adds a vision encoder); Qwen3-VL-30B-A3B's text model 30.53 B / 3.35 B
# active, as Qwen3-30B-A3B's card (30.5 B / 3.3 B), plus a 0.54 B vision encoder.
PUBLISHED = {
    "qwen3_5_0_8b": (
        "qwen3_5_text",
        dict(
            vocab_size=248320,
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=24,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            max_position_embeddings=262144,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000.0,
                partial_rotary_factor=0.25,
                mrope_section=[11, 11, 10],
                mrope_interleaved=True,
            ),
        ),
    ),
    "qwen3_vl_30b_a3b": (
        "qwen3_vl_moe",
        dict(
            tie_word_embeddings=False,
            text_config=dict(
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=6144,
                num_hidden_layers=48,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                moe_intermediate_size=768,
                num_experts=128,
                num_experts_per_tok=8,
                decoder_sparse_step=1,
                max_position_embeddings=262144,
                tie_word_embeddings=False,
                rope_parameters=dict(
                    rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True
                ),
            ),
            vision_config=dict(
                depth=27,
                hidden_size=1152,
                intermediate_size=4304,
                num_heads=16,
                patch_size=16,
                spatial_merge_size=2,
                temporal_patch_size=2,
                out_hidden_size=2048,
                num_position_embeddings=2304,
                deepstack_visual_indexes=[8, 16, 24],
            ),
        ),
    ),
}


def load_config(name: str, **overrides):
    """A transformers config: a save_pretrained folder, a PUBLISHED name, or a model_type (its
    transformers default config, e.g. deepseek_v32 = DeepSeek-V3.2 671B). Training settings:
    no KV cache, sdpa attention."""
    from transformers import AutoConfig

    if os.path.isdir(name):
        config = AutoConfig.from_pretrained(name, local_files_only=True, **overrides)
    else:
        model_type, values = PUBLISHED.get(name, (name, {}))
        layers = overrides.get("num_hidden_layers")
        if layers and "layer_types" in values:  # fewer layers (a quicker plan): the pattern's first ones
            values = {**values, "layer_types": values["layer_types"][:layers]}
        config = AutoConfig.for_model(model_type, **{**values, **overrides})
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for c in {id(config): config, id(text): text}.values():
        c.use_cache = False
    config._attn_implementation = "sdpa"
    return config


def _model_class(config):
    import transformers
    from transformers import AutoModelForCausalLM

    if config.model_type in _MODEL_CLASSES:
        return getattr(transformers, _MODEL_CLASSES[config.model_type])
    return AutoModelForCausalLM._model_mapping[type(config)]


def build_model(config, device: str = "meta", dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """The model of `config` in training mode: on meta (nothing allocated, no initialisation, as
    from_pretrained builds it) or on CPU with weights drawn from `seed`."""
    from ..checkpoint.pretrained import _meta_model

    cls = _model_class(config)
    if device == "meta":
        model = _meta_model(cls, config, dtype, "sdpa")
    else:
        torch.manual_seed(seed)
        model = cls._from_config(config, attn_implementation="sdpa").to(dtype)
    return model.train()


RECOMPUTE = ("none", "selective", "full")


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """hs.recompute on every decoder layer: "full" keeps each layer's inputs and reruns its forward in
    backward, "selective" also keeps the outputs of hypershard.parallel.recompute.SELECTIVE_SAVE_OPS (matrix
    products, attention kernels); "none" leaves the model as it is."""
    if mode not in RECOMPUTE:
        raise ValueError(f"hypershard: plan: recompute {mode!r}; allowed: {list(RECOMPUTE)}")
    if mode == "none":
        return model
    from ..parallel.recompute import recompute

    return recompute(model, mode=mode)


# HSDP's replicate axis (hs.fully_shard's `replicate_axis`, docs/fully_shard.md): the parameters
# Replicate across it (nodes), sharded over "dp" (ranks of a node); the batch split over both.
REPLICATE_AXIS = "dp_replicate"


def check_hsdp(shape: dict, fully_shard: bool) -> None:
    """One line (ValueError) for a dp_replicate axis the step cannot run: without fully_shard (then it
    is plain data parallelism: fold it into dp), without a dp axis to shard over, or not outermost
    (it replicates across nodes: the slowest axis, before every other)."""
    if REPLICATE_AXIS not in shape:
        return
    sizes = ",".join(f"{a}={n}" for a, n in shape.items())
    if not fully_shard:
        raise ValueError(
            f"hypershard: plan: mesh {sizes}: {REPLICATE_AXIS} is fully_shard's replicate axis (HSDP) and "
            f"needs --fully-shard; allowed: --fully-shard, or its size folded into dp"
        )
    if shape.get("dp", 1) < 2:
        raise ValueError(
            f"hypershard: plan: mesh {sizes}: HSDP shards over dp, which it lacks; allowed: a dp axis of size >= 2"
        )
    if next(iter(shape)) != REPLICATE_AXIS:
        raise ValueError(
            f"hypershard: plan: mesh {sizes}: {REPLICATE_AXIS} replicates across nodes and comes first; "
            f"allowed: {REPLICATE_AXIS}=R,dp=D,..."
        )


def hsdp_mesh(shape: dict, replicas: int, fully_shard: bool) -> dict:
    """`shape` with its dp axis split into dp_replicate=R (outermost: across nodes) x dp=D/R (plan.py
    --hsdp R); one line (ValueError) when R does not divide dp."""
    dp = shape.get("dp", 1)
    if replicas < 2 or dp % replicas or dp // replicas < 2 or REPLICATE_AXIS in shape:
        raise ValueError(
            f"hypershard: plan: --hsdp {replicas} on dp={dp}: R replicas of a dp/R shard group; allowed: "
            f"R >= 2 dividing dp with dp/R >= 2 ({[r for r in range(2, dp) if dp % r == 0 and dp // r >= 2]}), "
            f"no {REPLICATE_AXIS} axis in --mesh"
        )
    out = {REPLICATE_AXIS: replicas}
    out.update({a: (n // replicas if a == "dp" else n) for a, n in shape.items()})
    check_hsdp(out, fully_shard)
    return out


def data_parallel(shape: dict) -> int:
    """Ranks the batch is split over: dp, times dp_replicate under HSDP."""
    return shape.get("dp", 1) * shape.get(REPLICATE_AXIS, 1)


def shard_model(
    model: nn.Module,
    mesh,
    fully_shard: bool = False,
    compute_dtype: Optional[torch.dtype] = None,
    cp_algorithm: str = "all_gather_kv",
    recompute: str = "none",
) -> nn.Module:
    """parallelize with the model's own TP / EP plans (axes "tp", "ep"; inputs split over "dp"; the
    sequence over "cp" with `cp_algorithm`), then, with `fully_shard`, hs.fully_shard on every
    decoder layer and the root over "dp" (`compute_dtype`: the gathered parameters' dtype, the shards
    staying the master weights; without fully_shard, hs.mixed_precision computes in it from the
    parameters); `recompute`: see apply_recompute. A mesh with a "dp_replicate" axis is HSDP
    (check_hsdp): the inputs split over dp_replicate and dp, fully_shard's `replicate_axis`."""
    from ..checkpoint.pretrained import fully_shard_layers
    from ..fsdp.fully_shard import MixedPrecisionPolicy
    from ..parallel.api import parallelize

    names = list(mesh.mesh_dim_names)
    check_hsdp(dict(zip(names, mesh.shape)), fully_shard)
    hsdp = REPLICATE_AXIS in names
    checks = _C.check_replicas()
    _C.set_check_replicas(False)  # meta tensors have no values to compare
    try:
        parallelize(model, mesh, cp_algorithm=cp_algorithm, dp_axis=(REPLICATE_AXIS, "dp") if hsdp else "dp")
        if fully_shard:
            policy = None
            if compute_dtype is not None:
                policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
            fully_shard_layers(model, mesh, mp_policy=policy, replicate_axis=REPLICATE_AXIS if hsdp else None)
        apply_recompute(model, recompute)  # after fully_shard, before mixed precision (hs.recompute's order)
        if compute_dtype is not None and not fully_shard:  # bf16 compute from fp32 master weights without fully_shard
            from ..fsdp.mixed_precision import mixed_precision

            mixed_precision(model, MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32))
    finally:
        _C.set_check_replicas(checks)
    return model


def _vocab(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.vocab_size


def make_batch(config, batch: int, seq: int, device: str, seed: int = 1) -> tuple:
    """(input_ids, labels) of `batch` sequences of `seq` tokens."""
    if device == "meta":
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        return ids, ids.clone()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, _vocab(config), (batch, seq), generator=g)
    return ids, ids.clone()


def train_step(
    model: nn.Module, batch: tuple, on_phase: Callable[[str], None] = lambda name: None, clip: float = 1.0
) -> torch.optim.Optimizer:
    """One step: forward (the causal-LM loss), backward, clip_grad_norm_, AdamW; `on_phase(name)`
    is called at "forward", "backward", "optimizer" and "end". Returns the optimizer (its state)."""
    ids, labels = batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    on_phase("forward")
    loss = model(input_ids=ids, labels=labels).loss
    on_phase("backward")
    loss.backward()
    del loss
    on_phase("optimizer")
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    on_phase("end")
    return optimizer


@dataclass
class StepBytes:
    """This rank's bytes of each training-state class, each storage counted once."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    keys: dict = field(default_factory=dict)  # class -> set of storage keys


def _unique_bytes(tensors) -> tuple:
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key, storage = storage_key(t)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total, seen


def state_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> StepBytes:
    params = list(model.parameters())
    out = StepBytes()
    out.parameters, out.keys["parameters"] = _unique_bytes(params)
    out.gradients, out.keys["gradients"] = _unique_bytes(p.grad for p in params)
    if optimizer is not None:
        state = [v for s in optimizer.state.values() for v in s.values()]
        out.optimizer, out.keys["optimizer"] = _unique_bytes(state)
    return out
