"""parallelize(): puts a model's parameters on a mesh following a tensor-parallel plan.

With no plan, a HuggingFace model's own plan is used (``model._tp_plan``, built by transformers
from ``config.base_model_tp_plan``) on the ``tp`` axis; every other parameter is Replicate, and the
model's tensor inputs are sharded on their batch dim over ``dp``. Parameters become DTensor
parameters in place, so torch optimizers, ``clip_grad_norm_`` and state dicts work unchanged.
Only module boundaries run Python (hooks); every op inside runs through hypershard's C++ path.

Plan styles (HuggingFace names):

| style | weight | bias | output |
|---|---|---|---|
| colwise | Shard(0) | Shard(0) | sharded on the last dim |
| colwise_gather_output | Shard(0) | Shard(0) | gathered to Replicate |
| rowwise | Shard(1) | Replicate | reduced to Replicate |
| rowwise_split_input | Shard(1) | Replicate | reduced to Replicate |
| replicated_with_grad_allreduce | Replicate | Replicate | unchanged (grads summed in the gradient buckets) |
| embedding_rowwise / vocab | Shard(0) (vocabulary) | - | reduced to Replicate |
| embedding_colwise | Shard(1) (hidden) | - | gathered to Replicate |
| sequence_parallel, gather, local*, isolated | Replicate | Replicate | unchanged |
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Optional

import torch
from torch import nn

from . import _C
from .dtensor import distribute_tensor
from .placement_types import Replicate, Shard

__all__ = ["parallelize", "tp_plan_of"]

_WEIGHT_DIM = {"colwise": 0, "colwise_gather_output": 0, "rowwise": 1, "rowwise_split_input": 1,
               "embedding_rowwise": 0, "vocab": 0, "embedding_colwise": 1}
_BIAS_SHARDED = {"colwise", "colwise_gather_output"}
_OUTPUT_REPLICATE = {"colwise_gather_output", "rowwise", "rowwise_split_input", "embedding_rowwise",
                     "vocab", "embedding_colwise"}
_UNCHANGED = {"replicated_with_grad_allreduce", "sequence_parallel", "gather", "local", "local_colwise",
              "local_rowwise", "local_packed_rowwise", "isolated", "replicate"}


def tp_plan_of(model: nn.Module) -> dict:
    """The model's own tensor-parallel plan (module pattern -> style), fully qualified."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        config = getattr(model, "config", None)
        base = getattr(config, "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        plan = {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}
    return plan


def _style_for(name: str, plan: Mapping[str, str]) -> Optional[str]:
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def _placements(mesh, axis: Optional[int], dim: Optional[int]) -> list:
    out: list = [Replicate()] * mesh.ndim
    if axis is not None and dim is not None:
        out[axis] = Shard(dim)
    return out


def _replicate_on(axis: int):
    def hook(module, inputs, output):
        def fix(t):
            if isinstance(t, torch.Tensor) and _C.is_dtensor(t):
                layout = _C.layout_of(t)
                if layout.is_partial(axis) or layout.is_sharded(axis):
                    dims = [[a for a in axes if a != axis] for axes in layout.dim_axes]
                    partial = [None if a == axis else op for a, op in enumerate(layout.partial)]
                    return _C.redistribute(t, _C.Layout.create(layout.mesh, layout.global_shape, dims, partial))
            return t
        if isinstance(output, tuple):
            return tuple(fix(t) for t in output)
        return fix(output)
    return hook


def _shard_inputs(mesh, dp_axis: Optional[int]):
    def distribute(t):
        if not isinstance(t, torch.Tensor) or _C.is_dtensor(t) or t.dim() == 0:
            return t
        placements: list = [Replicate()] * mesh.ndim
        if dp_axis is not None:
            placements[dp_axis] = Shard(0)
        return distribute_tensor(t, mesh, placements)

    def hook(module, args, kwargs):
        return tuple(distribute(a) for a in args), {k: distribute(v) for k, v in kwargs.items()}
    return hook


def parallelize(model: nn.Module, mesh, plan: Optional[Mapping[str, str]] = None, *,
                tp_axis: str = "tp", dp_axis: str = "dp", shard_inputs: bool = True) -> nn.Module:
    """Distributes `model`'s parameters over `mesh` (in place) and returns the model.

    `plan` maps module name patterns ("model.layers.*.mlp.up_proj") to styles; None uses the
    model's own plan. Axes named `tp_axis` / `dp_axis` that the mesh lacks are simply not used.
    With `shard_inputs`, tensor arguments of forward are sharded on dim 0 over `dp_axis`
    (Replicate elsewhere); pass DTensors yourself for other layouts."""
    names = list(mesh.mesh_dim_names)
    tp = names.index(tp_axis) if tp_axis in names else None
    dp = names.index(dp_axis) if dp_axis in names else None
    plan = tp_plan_of(model) if plan is None else dict(plan)
    if tp is None:
        plan = {}
    for module_name, module in model.named_modules():
        style = _style_for(module_name, plan)
        if style is not None and style not in _WEIGHT_DIM and style not in _UNCHANGED:
            raise ValueError(f"hypershard: parallelize: module {module_name!r}: unknown plan style {style!r}; "
                             f"allowed: {sorted(set(_WEIGHT_DIM) | _UNCHANGED)}")
        for param_name, param in list(module._parameters.items()):
            if param is None or _C.is_dtensor(param):
                continue
            dim = None
            if style in _WEIGHT_DIM:
                if param_name == "weight":
                    dim = _WEIGHT_DIM[style]
                elif param_name == "bias" and style in _BIAS_SHARDED:
                    dim = 0
            if dim is not None and dim >= param.dim():
                dim = None
            dt = distribute_tensor(param.detach(), mesh, _placements(mesh, tp, dim))
            module._parameters[param_name] = nn.Parameter(dt, requires_grad=param.requires_grad)
        if style in _OUTPUT_REPLICATE and tp is not None:
            module.register_forward_hook(_replicate_on(tp))
    if shard_inputs:
        model.register_forward_pre_hook(_shard_inputs(mesh, dp), with_kwargs=True)
    return model
