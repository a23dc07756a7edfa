"""Activation recomputation (activation checkpointing): ``hs.recompute``.

    model = hs.parallelize(model, mesh)                  # tp / ep / cp / dp (optional)
    hs.fully_shard(...)                                  # optional
    hs.recompute(model, mode="selective")                # every decoder layer
    hs.mixed_precision(model); hs.compile(model)         # optional, in any order after it

Each recomputed module (by default every decoder layer: the blocks of the model's first
``ModuleList`` named ``*layers``, the grouping fully_shard_layers uses) runs its whole call --
its forward hooks included, so fully_shard's gather and mixed precision's casts -- under
``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``:

- ``mode="full"``: nothing inside the module is kept for backward but its inputs; backward runs
  the module's forward again to rebuild what it needs.
- ``mode="selective"``: the outputs of the ops in ``SELECTIVE_SAVE_OPS`` (the matrix products
  and attention kernels: the costly ops, whose outputs are few) are kept; every other op
  (norms, activations, rotary, casts, views, elementwise) is recomputed. torch's selective
  checkpoint (``create_selective_checkpoint_contexts``) records those outputs in forward and
  hands them back in the recomputation instead of running the op again. The policy is
  torchtitan's op policy, keeping every matrix product (torchtitan keeps every other ``mm``).

What a recomputation does on a mesh: the module's ops run again on the same DTensors, so a
recomputed op that communicates (an all-reduce of a rowwise projection, a cp all-gather of K/V,
an ep all-to-all) communicates again, in the same order on every rank (backward visits the
modules in the same order everywhere). Selective mode keeps the products, so the collectives
that follow a kept product still run when what consumes it is recomputed. Qwen3.5's gated delta
net on cp passes its state rank to rank again in the recomputation; its node rebuilds its local
graph in backward rather than keep one from forward (hypershard.parallel.linear_attention).

fully_shard: a module's parameters are gathered twice per step as without recomputation: in its
forward, and before its backward (the pre-backward hook on its outputs). The recomputation runs
after that second gather; the group's pre-forward hook then finds the parameters gathered and
puts them in place without a collective, and its post-forward hook (in backward) keeps them until
the module's backward has reduce-scattered its gradients. No third gather.

Random ops (dropout) replay the same stream: the CPU and device RNG states at the module's call
are restored for the recomputation (preserve_rng_state). The recomputation stops as soon as it
has rebuilt the last tensor backward needs (torch's early stop), so the module's tail and the
forward hooks after it may not run again; hypershard's hooks allow for that: mixed precision's
post-hook, which puts the master weights back, is registered ``always_call`` (it runs when the
stop is raised through it), and fully_shard puts the shards back in its backward.

The results equal the run without recomputation bit for bit: the same ops run on the same values
in the same order; backward only reads rebuilt tensors instead of kept ones.

HuggingFace's own ``gradient_checkpointing_enable()`` checkpoints the same decoder layers. Both on
one module would recompute it twice over: ``recompute`` refuses a model with it on, and a
recomputed module raises at its call if it was turned on afterwards (on every rank, before any
collective). Use one or the other.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["MODES", "SELECTIVE_SAVE_OPS", "decoder_layers", "is_saved_op", "recompute", "recompute_mode"]

MODES = ("full", "selective")

# The ops whose outputs selective mode keeps, as schema names (every overload counts): matrix
# products, convolutions and attention kernels. CompositeImplicitAutograd ops (linear, matmul,
# scaled_dot_product_attention's math path) never reach the policy themselves -- they decompose
# into mm / addmm / bmm, which are here -- and are listed so that a tracer that sees them (the
# planner, on meta) classifies them the same way.
SELECTIVE_SAVE_OPS: frozenset = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::matmul",
        "aten::linear",
        "aten::_grouped_mm",
        "aten::_scaled_mm",
        "aten::_scaled_grouped_mm",
        "aten::convolution",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_fused_attention_overrideable",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
        "transformers::grouped_mm_fallback",
        "npu::npu_fusion_attention",
    }
)


def _error(message: str) -> ValueError:
    return ValueError(f"hypershard: recompute: {message}")


def is_saved_op(op) -> bool:
    """Whether selective mode keeps the output of `op` (an OpOverload, an OpOverloadPacket or a
    schema name such as "aten::mm" / "aten::mm.default")."""
    if isinstance(op, str):
        name = op.split(".")[0]
    elif isinstance(op, torch._ops.OpOverloadPacket):
        name = op._qualified_op_name
    else:
        schema = getattr(op, "_schema", None)
        name = schema.name if schema is not None else str(op)
    return name in SELECTIVE_SAVE_OPS


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_saved_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_policy)


def decoder_layers(model: nn.Module) -> list:
    """The blocks of the model's first ModuleList whose name ends in ``layers`` (a decoder's
    layers; the grouping fully_shard_layers and the SFT entry point use)."""
    layers = next(
        (m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)), None
    )
    return list(layers) if layers is not None else []


class RecomputedModule:
    """Mixed into the class of every module ``recompute`` wraps: its call (forward hooks and
    forward) runs under torch.utils.checkpoint while training with gradients."""

    def __call__(self, *args, **kwargs):
        mode = self._hs_recompute
        if not (self.training and torch.is_grad_enabled()):
            return super().__call__(*args, **kwargs)
        if getattr(self, "gradient_checkpointing", False):
            raise _error(
                f"{type(self).__name__} has transformers' gradient checkpointing on as well as "
                f"hs.recompute(mode={mode!r}); it would be recomputed twice over; allowed: one of "
                "them (model.gradient_checkpointing_disable(), or no hs.recompute)"
            )
        kwargs = _without_cache(self, kwargs)
        if mode == "selective":
            return checkpoint(
                super().__call__,
                *args,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=_selective_contexts,
                **kwargs,
            )
        # (no context_fn argument at all: torch.compile, tracing a compiled model through this call,
        # accepts only its default, and compares the traced value with it)
        return checkpoint(super().__call__, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")
_warned_cache = False


def _without_cache(module: nn.Module, kwargs: dict) -> dict:
    """`kwargs` without a KV cache, as transformers' own gradient checkpointing does: the
    recomputation would update the cache a second time (and run other ops than the forward did,
    which selective mode refuses). Training needs no cache; a layer that only reads one
    (transformers' ``_can_checkpoint_with_cache``) keeps it."""
    global _warned_cache
    dropped = []
    if kwargs.get("use_cache"):
        kwargs = {**kwargs, "use_cache": False}
        dropped.append("use_cache=False")
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for name in _CACHE_ARGUMENTS:
            if kwargs.get(name) is not None:
                kwargs = {**kwargs, name: None}
                dropped.append(f"{name}=None")
    if dropped and not _warned_cache:
        _warned_cache = True
        warnings.warn(
            f"hypershard: recompute: a KV cache cannot be recomputed; {type(module).__name__} runs with "
            f"{', '.join(dropped)} while training (as with transformers' gradient checkpointing)",
            stacklevel=3,
        )
    return kwargs


_CLASSES: dict = {}


def _recomputed_class(cls: type) -> type:
    if issubclass(cls, RecomputedModule):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Recomputed{cls.__name__}", (RecomputedModule, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def recompute_mode(module: nn.Module) -> Optional[str]:
    """The mode ``recompute`` gave `module`, or None."""
    return getattr(module, "_hs_recompute", None)


def recompute(model: nn.Module, mode: str = "full", modules: Optional[Iterable[nn.Module]] = None) -> nn.Module:
    """Recomputes the activations of `modules` (default: every decoder layer of `model`, see
    ``decoder_layers``) in backward instead of keeping them, in place; returns `model`.

    `mode`: "full" (keep only each module's inputs) or "selective" (also keep the outputs of
    ``SELECTIVE_SAVE_OPS``). Every check runs before any module is changed."""
    if mode not in MODES:
        raise _error(f"mode {mode!r} is not implemented; allowed: {list(MODES)}")
    targets = decoder_layers(model) if modules is None else list(modules)
    if not targets:
        raise _error(
            f"{type(model).__name__} has no ModuleList named '*layers' to recompute; allowed: pass the "
            "modules to recompute (modules=[...])"
        )
    inside = {id(m) for m in model.modules()}
    for module in targets:
        if not isinstance(module, nn.Module) or id(module) not in inside:
            raise _error(f"{module!r:.80} is not a submodule of {type(model).__name__}; allowed: its submodules")
        if recompute_mode(module) is not None:
            raise _error(f"{type(module).__name__} is recomputed already (mode {recompute_mode(module)!r})")
        if getattr(module, "gradient_checkpointing", False):
            raise _error(
                f"{type(module).__name__} has transformers' gradient checkpointing on; it would be "
                "recomputed twice over; allowed: model.gradient_checkpointing_disable() first, or no hs.recompute"
            )
    nested = [m for m in targets for sub in m.modules() if sub is not m and id(sub) in {id(t) for t in targets}]
    if nested:
        raise _error(
            f"{type(nested[0]).__name__} contains another module in `modules`; allowed: modules that do not nest"
        )
    for module in targets:
        module._hs_recompute = mode
        module.__class__ = _recomputed_class(type(module))
    return model
