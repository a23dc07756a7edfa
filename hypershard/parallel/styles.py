"""parallelize(): puts a model's parameters on a mesh following a tensor-parallel plan.

With no plan, a HuggingFace model's own plan is used (``model._tp_plan``, built by transformers
from ``config.base_model_tp_plan``) on the ``tp`` axis; every other parameter is Replicate, and the
model's tensor inputs are sharded on their batch dim over ``dp``. Parameters become DTensor
parameters in place, so torch optimizers, ``clip_grad_norm_`` and state dicts work unchanged.
Only module boundaries run Python (hooks); every op inside runs through hypershard's C++ path.

A plan key names a module ("model.layers.*.mlp.up_proj": its parameters and its forward) or a
single parameter ("model.layers.*.mlp.experts.gate_up_proj": that parameter's layout only), as in
transformers; a parameter's own key wins over its module's. "out" is a weight's output-features
dim (dim -2: dim 0 of a Linear weight [out, in], dim 1 of an experts weight [experts, out, in]),
"in" its input-features dim (dim -1); a bias (a 1-d parameter, or one named ``*bias``) has its
features in its last dim.

Plan styles (HuggingFace names):

| style | weight | bias | module input / output |
|---|---|---|---|
| colwise | Shard(out) | Shard(last) | output stays sharded on its last dim |
| colwise_gather_output | Shard(out) | Shard(last) | output gathered to Replicate |
| packed_colwise | Shard(out) (packed [gate; up]) | Shard(last) | output sharded on its last dim (see below) |
| rowwise | Shard(in) | Replicate | Partial(sum) output reduced to Replicate |
| rowwise_split_input | Shard(in) | Replicate | Partial(sum) output reduced to Replicate |
| moe_tp_experts | its own keys; others Replicate | - | inputs Replicate on the axis; Partial(sum) output reduced |
| mla_kv_a_proj | Replicate | Replicate | output Replicate (its rope part's Partial gradient is summed) |
| replicated_with_grad_allreduce | Replicate | Replicate | unchanged (grads summed in the gradient buckets) |
| embedding_rowwise / vocab | Shard(0) (vocabulary) | - | reduced to Replicate |
| embedding_colwise | Shard(1) (hidden) | - | gathered to Replicate |
| sequence_parallel, gather, local*, isolated | Replicate | Replicate | unchanged |
| grouped_gemm (ep) | Shard(0) (the experts) | Replicate | - |
| ep_router (ep) | Replicate | Replicate | unchanged: the routing stays global |

``colwise``/``rowwise`` on an ``nn.Embedding`` shard its weight on dim 1 / dim 0 (transformers' rule).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from types import MethodType
from typing import Callable, Optional

import torch
from torch import nn

from .. import _C
from ..tensor.placement_types import Replicate, Shard
from ..tensor.traced import TracedDTensor
from .experts import _experts_forward, _local_experts

__all__ = ["tp_plan_of", "ep_plan_of", "STYLES", "Style", "style"]


def _text_config(model: nn.Module):
    """The text model's config (a vision-language config's text part)."""
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


# ------------------------------------------------------------------------------- parameter dims
# (module, parameter name, parameter) -> the dim a style shards over its axis, or None: Replicate.


def _is_bias(name: str, param: torch.Tensor) -> bool:
    return param.dim() == 1 or name == "bias" or name.endswith("_bias")


def _out_dim(module, name, param):
    if _is_bias(name, param):
        return param.dim() - 1
    if isinstance(module, nn.Embedding):
        return 1
    return param.dim() - 2


def _in_dim(module, name, param):
    if isinstance(module, nn.Embedding):
        return 0 if name == "weight" else None
    return None if _is_bias(name, param) else param.dim() - 1


def _weight(dim):
    return lambda module, name, param: dim if name == "weight" else None


def _none(module, name, param):
    return None


def _experts_dim(module, name, param):
    return None if param.dim() < 2 else 0


# ---------------------------------------------------------------------------------- style hooks


def _replicate_tensor_on(t, axis: int):
    if isinstance(t, TracedDTensor):  # in hypershard.compile's traced forward: an op Dynamo records
        return torch.ops.hypershard.replicate_on(t, axis)
    if isinstance(t, torch.Tensor) and _C.is_dtensor(t):
        layout = _C.layout_of(t)
        if layout.is_partial(axis) or layout.is_sharded(axis):
            return _C.redistribute(t, layout.without_axis(axis))
    return t


def _replicate_on(axis: int):
    def hook(module, inputs, output):
        if isinstance(output, tuple):
            return tuple(_replicate_tensor_on(t, axis) for t in output)
        return _replicate_tensor_on(output, axis)

    return hook


def _replicate_inputs_on(axis: int):
    def hook(module, args, kwargs):
        return (
            tuple(_replicate_tensor_on(a, axis) for a in args),
            {k: _replicate_tensor_on(v, axis) for k, v in kwargs.items()},
        )

    return hook


# ----------------------------------------------------------------------------------------- styles


class Style:
    """One plan style, everything it means in one place: the dim of each parameter it shards over
    its mesh axis (`param_dim`; None: Replicate), the hooks it puts on its module (`install`) and
    what it checks before anything is distributed (`check_module`, `check_param`, which raise a
    ValueError naming the module and the style).

    `replicate_inputs` / `replicate_output`: the module's tensor inputs / its output are made
    Replicate on the axis (shards gathered, Partial(sum) reduced)."""

    def __init__(
        self, name: str, param_dim: Callable = _none, *, replicate_inputs: bool = False, replicate_output: bool = False
    ):
        self.name = name
        self._param_dim = param_dim
        self.replicate_inputs = replicate_inputs
        self.replicate_output = replicate_output

    def __repr__(self) -> str:
        return f"<plan style {self.name!r}>"

    def param_dim(self, module: nn.Module, name: str, param: torch.Tensor) -> Optional[int]:
        dim = self._param_dim(module, name, param)
        return dim if dim is not None and 0 <= dim < param.dim() else None

    def check_module(self, model: nn.Module, name: str, module: nn.Module) -> None:
        """Raises when the style cannot be honoured on `module` (`model`: for its config)."""

    def check_param(self, name: str, param: torch.Tensor, dim: Optional[int], axis_size: int) -> None:
        """Raises when `param` cannot be sharded on `dim` over `axis_size` ranks as the style needs."""

    def install(self, module: nn.Module, mesh, axis: int, ep_axis: Optional[int]) -> None:
        """Puts the style's hooks on `module`, which the plan places on mesh axis `axis`."""
        if self.replicate_inputs:
            module.register_forward_pre_hook(_replicate_inputs_on(axis), with_kwargs=True)
        if self.replicate_output:
            module.register_forward_hook(_replicate_on(axis))

    def fail(self, name: str, why: str):
        raise ValueError(f"hypershard: parallelize: module {name!r}: plan style {self.name!r} {why}")


class _PackedColwise(Style):
    def check_param(self, name, param, dim, axis_size):
        if dim is not None and param.shape[dim] % 2:
            self.fail(name, f"needs an even packed dim ([gate; up] halves); got size {param.shape[dim]} in dim {dim}")


class _GroupedGemm(Style):
    def check_param(self, name, param, dim, axis_size):
        if dim is not None and param.shape[dim] % axis_size:
            self.fail(
                name, f"cannot shard {param.shape[dim]} experts evenly over the {axis_size} expert-parallel ranks"
            )


class _MlaKvAProj(Style):
    def check_module(self, model, name, module):
        rope = getattr(_text_config(model), "qk_rope_head_dim", None)
        weight = getattr(module, "weight", None)
        if rope is None:
            self.fail(
                name, "needs the model config's qk_rope_head_dim (the MLA projection's rope part); the config has none"
            )
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] <= rope:
            self.fail(
                name,
                f"needs a linear projection whose output [kv_lora_rank + qk_rope_head_dim] "
                f"is wider than qk_rope_head_dim={rope}; got weight "
                f"{None if weight is None else list(weight.shape)}",
            )


class _MoeTpExperts(Style):
    """Inputs Replicate on the axis and the Partial(sum) output reduced; on the ep axis the experts
    module also runs this rank's experts on local tensors (see `_local_experts`) first."""

    def install(self, module, mesh, axis, ep_axis):
        super().install(module, mesh, axis, ep_axis)
        if axis == ep_axis and hasattr(module, "num_experts"):
            pre, post = _local_experts(mesh, axis)
            module.register_forward_pre_hook(pre, with_kwargs=True)
            module.register_forward_hook(post, with_kwargs=True, prepend=True)  # before the reduction
            module.forward = MethodType(_experts_forward, module)


_STYLES: dict = {
    s.name: s
    for s in (
        Style("colwise", _out_dim),
        Style("colwise_gather_output", _out_dim, replicate_output=True),
        _PackedColwise("packed_colwise", _out_dim),
        Style("rowwise", _in_dim, replicate_output=True),
        Style("rowwise_split_input", _in_dim, replicate_output=True),
        Style("embedding_rowwise", _weight(0), replicate_output=True),
        Style("vocab", _weight(0), replicate_output=True),
        Style("embedding_colwise", _weight(1), replicate_output=True),
        _MoeTpExperts("moe_tp_experts", replicate_inputs=True, replicate_output=True),
        _MlaKvAProj("mla_kv_a_proj", replicate_output=True),
        Style("replicated_with_grad_allreduce"),  # Replicate: grads summed in the gradient buckets
        Style("sequence_parallel"),
        Style("gather"),
        Style("local"),
        Style("local_colwise"),
        Style("local_rowwise"),
        Style("local_packed_rowwise"),
        Style("isolated"),
        Style("replicate"),
        _GroupedGemm("grouped_gemm", _experts_dim),
        Style("ep_router"),  # the routing stays global
    )
}
STYLES = tuple(sorted(_STYLES))


def style(name: str) -> Style:
    """The Style object of a plan style name (KeyError for an unknown one)."""
    return _STYLES[name]


# ------------------------------------------------------------------------------------------ plans


def tp_plan_of(model: nn.Module) -> dict:
    """The model's own tensor-parallel plan (module pattern -> style), fully qualified."""
    return _plan_of(model, "_tp_plan", "base_model_tp_plan")


def ep_plan_of(model: nn.Module) -> dict:
    """The model's own expert-parallel plan (``base_model_ep_plan``), fully qualified."""
    return _plan_of(model, "_ep_plan", "base_model_ep_plan")


def _plan_of(model: nn.Module, attribute: str, config_attribute: str) -> dict:
    plan = dict(getattr(model, attribute, None) or {})
    if not plan:
        config = getattr(model, "config", None)
        base = getattr(config, config_attribute, None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        plan = {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}
    return plan


def _style_for(name: str, plan: Mapping[str, tuple]) -> Optional[tuple]:
    for pattern, entry in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return entry
    return None


def _placements(mesh, axis: Optional[int], dim: Optional[int]) -> list:
    out: list = [Replicate()] * mesh.ndim
    if axis is not None and dim is not None:
        out[axis] = Shard(dim)
    return out
