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

Tensor parallelism wider than the KV heads (``num_key_value_heads`` not divisible by tp, e.g. 2 KV
heads on tp=4): the ``k_proj``/``v_proj`` colwise entries become ``replicate`` -- every rank keeps
every KV head, as Megatron replicates them, and the attention rule cuts the repeated heads its
query heads need locally. A ``num_attention_heads`` that tp does not divide is refused up front.

MoE experts (Qwen3.5-MoE, DeepSeek-V3, ...): ``experts.gate_up_proj`` packed_colwise,
``experts.down_proj`` rowwise and ``experts`` moe_tp_experts make the experts' grouped products
column- then row-parallel over the intermediate dim, each rank summing its part of every expert's
output (one all-reduce at the experts' output), as transformers does. transformers splits the
packed weight with a strided shard (each rank a matching slice of gate AND of up); a hypershard
Layout chunks a dim into one block per rank (torch.chunk), so here the packed dim is sharded in
blocks and the model's ``chunk(2, dim=-1)`` of the gate_up product gathers that product's last dim
(the views rule), after which the row-parallel down projection cuts its input locally again: the
same values and parameter layouts' memory, one all-gather of the [tokens x top_k, 2 x intermediate]
product more than transformers' local kernels.

Expert parallelism (``base_model_ep_plan``) on an ``ep`` axis: ``grouped_gemm`` shards the experts
weights on dim 0 (the experts) and the experts module runs as transformers runs it under EP, on
LOCAL tensors: this rank's experts (its shard of the weights), every token of its data-parallel
shard, and the routing remapped to local expert ids (tokens routed to other ranks' experts get the
sentinel id ``num_local_experts``, which transformers' implementations skip, and weight 0). Its
output, this rank's part of the sum over ep, becomes a DTensor Partial(sum) over ep, which
``moe_tp_experts`` reduces (one all-reduce at the experts' output). ``ep_router`` leaves the router
Replicate and its outputs unchanged: the routing stays global (GLOBAL expert ids). No per-op rule
sees the experts' intermediate products (their zeros in other ranks' rows are not a Layout), so
strict mode trains MoE models on dp x ep meshes; the gradients come back Partial over ep (the
experts' inputs) and over the token axes (the weights) and the usual reductions sum them. Used
when the mesh has ``ep`` (``ep_axis``) and the model an EP plan; with both ``tp`` and ``ep`` the EP
plan's keys win.
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

__all__ = ["parallelize", "tp_plan_of", "ep_plan_of", "STYLES"]


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


# style -> the tensor dim its parameters are sharded on over the style's axis (None: Replicate).
_PARAM_DIM = {
    "colwise": _out_dim, "colwise_gather_output": _out_dim, "packed_colwise": _out_dim,
    "rowwise": _in_dim, "rowwise_split_input": _in_dim,
    "embedding_rowwise": _weight(0), "vocab": _weight(0), "embedding_colwise": _weight(1),
    "moe_tp_experts": _none, "mla_kv_a_proj": _none, "replicated_with_grad_allreduce": _none,
    "sequence_parallel": _none, "gather": _none, "local": _none, "local_colwise": _none,
    "local_rowwise": _none, "local_packed_rowwise": _none, "isolated": _none, "replicate": _none,
    "grouped_gemm": _experts_dim, "ep_router": _none,
}
# Styles whose module output is made Replicate on the axis (Partial reduced, shards gathered).
_OUTPUT_REPLICATE = {"colwise_gather_output", "rowwise", "rowwise_split_input", "embedding_rowwise",
                     "vocab", "embedding_colwise", "moe_tp_experts", "mla_kv_a_proj"}
# Styles whose module tensor inputs are made Replicate on the axis.
_INPUT_REPLICATE = {"moe_tp_experts"}
STYLES = tuple(sorted(_PARAM_DIM))


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


def _replicate_tensor_on(t, axis: int):
    if isinstance(t, torch.Tensor) and _C.is_dtensor(t):
        layout = _C.layout_of(t)
        if layout.is_partial(axis) or layout.is_sharded(axis):
            dims = [[a for a in axes if a != axis] for axes in layout.dim_axes]
            partial = [None if a == axis else op for a, op in enumerate(layout.partial)]
            return _C.redistribute(t, _C.Layout.create(layout.mesh, layout.global_shape, dims, partial))
    return t


def _replicate_on(axis: int):
    def hook(module, inputs, output):
        if isinstance(output, tuple):
            return tuple(_replicate_tensor_on(t, axis) for t in output)
        return _replicate_tensor_on(output, axis)
    return hook


def _replicate_inputs_on(axis: int):
    def hook(module, args, kwargs):
        return (tuple(_replicate_tensor_on(a, axis) for a in args),
                {k: _replicate_tensor_on(v, axis) for k, v in kwargs.items()})
    return hook


# ---------------------------------------------------------------------------------- local experts

def _with_partial(layout, axes) -> "_C.Layout":
    partial = list(layout.partial)
    for a in axes:
        partial[a] = _C.ReduceOp.Sum
    return _C.Layout.create(layout.mesh, layout.global_shape, layout.dim_axes, partial)


class _LocalPartialGrad(torch.autograd.Function):
    """DTensor -> its local tensor; the local gradient comes back as a DTensor of the same
    layout, Partial(sum) over `axes`: this rank's part of a sum over those axes (its experts'
    contributions over ep, its tokens' over dp)."""

    @staticmethod
    def forward(ctx, t, axes):
        ctx.layout, ctx.mesh, ctx.axes = _C.layout_of(t), _C.device_mesh_of(t), axes
        return _C.local_of(t).detach()

    @staticmethod
    def backward(ctx, grad):
        return _C.from_local(grad.contiguous(), ctx.mesh, _with_partial(ctx.layout, ctx.axes)), None


def _local(t, axes):
    return _LocalPartialGrad.apply(t, tuple(axes)) if t.requires_grad else _C.local_of(t)


def _local_experts(mesh, ep_axis: int):
    """Expert parallelism on local tensors, as transformers runs it: the experts module gets this
    rank's experts (its shard of the [experts, ...] weights), every token of its data-parallel
    shard, and the routing remapped to local expert ids -- tokens routed to other ranks' experts
    get the sentinel id `num_local_experts` (which transformers' expert implementations skip) and
    weight 0. Its output is this rank's part of the sum over ep (Partial(sum) on ep), which the
    moe_tp_experts style then reduces. Nothing inside the module is a DTensor, so no per-op rule
    sees the experts' [tokens, 2 x intermediate] products (whose zeros in other ranks' rows no
    Layout can say); gradients come back Partial over ep (inputs) and over the token axes
    (weights), and the usual reductions sum them."""
    ep_size = mesh.shape[ep_axis]
    ep_rank = mesh.get_local_rank(ep_axis)
    saved: dict = {}

    def pre(module, args, kwargs):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        values = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
        if len(values) != 3 or not all(_C.is_dtensor(v) for v in values):
            return None  # not a call this hook understands (plain tensors): transformers' own path
        hidden, index, weights = values
        num_experts = module.num_experts
        local_count = num_experts // ep_size
        token_axes = sorted({a for axes in _C.layout_of(hidden).dim_axes for a in axes})
        saved[id(module)] = (num_experts, getattr(module, "_is_expert_parallel", None), _C.layout_of(hidden),
                             dict(module._parameters))
        for name, param in list(module._parameters.items()):
            if param is not None and _C.is_dtensor(param):
                _C.install_grad_hook(param)  # it reaches no op itself: its Partial gradient needs the hook
                module._parameters[name] = _local(param, token_axes)
        module.num_experts = local_count
        module._is_expert_parallel = True  # transformers' implementations then mask the sentinel rows
        index = _C.local_of(index)
        mine = torch.div(index, local_count, rounding_mode="floor") == ep_rank
        index = torch.where(mine, index - ep_rank * local_count, torch.full_like(index, local_count))
        weights = _local(weights, [ep_axis]).masked_fill(~mine, 0.0)
        return (_local(hidden, [ep_axis]), index, weights), {}

    def post(module, args, kwargs, output):
        if id(module) not in saved:
            return output
        num_experts, expert_parallel, layout, params = saved.pop(id(module))
        module.num_experts = num_experts
        if expert_parallel is None:
            del module._is_expert_parallel
        else:
            module._is_expert_parallel = expert_parallel
        module._parameters.update(params)
        return _C.from_local(output, _C.device_mesh_of(next(p for p in params.values() if p is not None)),
                             _with_partial(layout, [ep_axis]))

    return pre, post


# Forward arguments whose dim 0 is not the batch: a vision model's patches of all images and
# their grid sizes. They stay Replicate (every data-parallel rank runs the vision tower on all of
# them); the text-side tensors are split over dp.
_NOT_BATCH_INPUTS = frozenset({"pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw"})


def _shard_inputs(mesh, dp_axis: Optional[int]):
    def distribute(t, batch: bool = True):
        if not isinstance(t, torch.Tensor) or _C.is_dtensor(t) or t.dim() == 0:
            return t
        placements: list = [Replicate()] * mesh.ndim
        if dp_axis is not None and batch:
            placements[dp_axis] = Shard(0)
        return distribute_tensor(t, mesh, placements)

    def hook(module, args, kwargs):
        return (tuple(distribute(a) for a in args),
                {k: distribute(v, k not in _NOT_BATCH_INPUTS) for k, v in kwargs.items()})
    return hook


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def _kv_heads_replicated(model: nn.Module, tp_size: int) -> bool:
    """Whether the key/value projections must stay whole on the tp axis: fewer KV heads than tp
    ranks (or a count tp does not divide) cannot be split into whole heads, so each rank keeps
    every KV head (Megatron replicates them the same way; the attention rule then cuts the
    repeated heads each rank's query heads need, locally). Query heads that tp does not divide
    are refused here, naming the config field, rather than deep inside a forward."""
    text = _text_config(model)
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None)
    if tp_size <= 1 or heads is None:
        return False
    if heads % tp_size:
        raise ValueError(f"hypershard: parallelize: config.num_attention_heads={heads} is not divisible by the "
                         f"tensor-parallel size {tp_size}; allowed: a tp size that divides it")
    return kv is not None and kv % tp_size != 0


def _fail(name: str, style: str, why: str):
    raise ValueError(f"hypershard: parallelize: module {name!r}: plan style {style!r} {why}")


def _check(model: nn.Module, name: str, module: nn.Module, style: str) -> None:
    """Raises (before any forward) when `style` cannot be honoured on `module`."""
    if style == "mla_kv_a_proj":
        text = _text_config(model)
        rope = getattr(text, "qk_rope_head_dim", None)
        weight = getattr(module, "weight", None)
        if rope is None:
            _fail(name, style, "needs the model config's qk_rope_head_dim (the MLA projection's rope part); "
                               "the config has none")
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] <= rope:
            _fail(name, style, f"needs a linear projection whose output [kv_lora_rank + qk_rope_head_dim] "
                               f"is wider than qk_rope_head_dim={rope}; got weight "
                               f"{None if weight is None else list(weight.shape)}")


def _check_param(full_name: str, style: str, param: torch.Tensor, dim: Optional[int], axis_size: int) -> None:
    if style == "packed_colwise" and dim is not None and param.shape[dim] % 2:
        _fail(full_name, style, f"needs an even packed dim ([gate; up] halves); got size {param.shape[dim]} "
                                f"in dim {dim}")
    if style == "grouped_gemm" and dim is not None and param.shape[dim] % axis_size:
        _fail(full_name, style, f"cannot shard {param.shape[dim]} experts evenly over the {axis_size} "
                                f"expert-parallel ranks")


def parallelize(model: nn.Module, mesh, plan: Optional[Mapping[str, str]] = None, *,
                tp_axis: str = "tp", dp_axis: str = "dp", ep_axis: str = "ep",
                ep_plan: Optional[Mapping[str, str]] = None, shard_inputs: bool = True) -> nn.Module:
    """Distributes `model`'s parameters over `mesh` (in place) and returns the model.

    `plan` maps module or parameter name patterns ("model.layers.*.mlp.up_proj") to styles; None
    uses the model's own plan. `ep_plan` (None: the model's ``base_model_ep_plan``) is applied on
    `ep_axis` the same way. Axes named `tp_axis` / `dp_axis` / `ep_axis` that the mesh lacks are
    simply not used. With `shard_inputs`, tensor arguments of forward are sharded on dim 0 over
    `dp_axis` (Replicate elsewhere); pass DTensors yourself for other layouts.

    Every style of the plans is checked before anything is distributed: an unknown style, or one
    the module cannot take (see the module docstring), raises a ValueError naming the module."""
    names = list(mesh.mesh_dim_names)
    tp = names.index(tp_axis) if tp_axis in names else None
    dp = names.index(dp_axis) if dp_axis in names else None
    ep = names.index(ep_axis) if ep_axis in names else None
    tp_plan = (tp_plan_of(model) if plan is None else dict(plan)) if tp is not None else {}
    ep_plan = (ep_plan_of(model) if ep_plan is None else dict(ep_plan)) if ep is not None else {}
    if tp is not None and tp_plan and _kv_heads_replicated(model, mesh.shape[tp]):
        tp_plan = {pattern: ("replicate" if pattern.rsplit(".", 1)[-1] in ("k_proj", "v_proj")
                             and style.startswith("colwise") else style)
                   for pattern, style in tp_plan.items()}
    # pattern -> (style, mesh axis); the EP plan's keys first (they win where both name a module).
    entries = {pattern: (style, ep) for pattern, style in ep_plan.items()}
    for pattern, style in tp_plan.items():
        entries.setdefault(pattern, (style, tp))
    for pattern, (style, _) in entries.items():
        if style not in _PARAM_DIM:
            matched = [n for n, _ in model.named_modules() if fnmatch.fnmatchcase(n, pattern)]
            matched += [n for n, _ in model.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
            where = repr(matched[0]) if matched else f"pattern {pattern!r}"
            raise ValueError(f"hypershard: parallelize: module {where}: unknown plan style {style!r}; "
                             f"allowed: {list(STYLES)}")

    # Decide every layout (and check it) before distributing anything.
    decided = []  # (module, param_name, param, placements); a shared (tied) parameter once
    seen: dict = {}
    hooks = []    # (module, style, axis)
    for module_name, module in model.named_modules():
        module_entry = _style_for(module_name, entries)
        if module_entry is not None:
            style, axis = module_entry
            _check(model, module_name, module, style)
            hooks.append((module, style, axis))
        for param_name, param in module._parameters.items():
            if param is None or _C.is_dtensor(param):
                continue
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            if id(param) in seen:
                decided.append((module, param_name, param, None))
                continue
            seen[id(param)] = full_name
            entry = _style_for(full_name, entries) or module_entry
            dim = axis = None
            if entry is not None:
                style, axis = entry
                dim = _PARAM_DIM[style](module, param_name, param)
                if dim is not None and not 0 <= dim < param.dim():
                    dim = None
                _check_param(full_name, style, param, dim, mesh.shape[axis])
            decided.append((module, param_name, param, _placements(mesh, axis, dim)))

    distributed: dict = {}
    for module, param_name, param, placements in decided:
        if id(param) not in distributed:
            dt = distribute_tensor(param.detach(), mesh, placements)
            distributed[id(param)] = nn.Parameter(dt, requires_grad=param.requires_grad)
        module._parameters[param_name] = distributed[id(param)]
    for module, style, axis in hooks:
        if style in _INPUT_REPLICATE:
            module.register_forward_pre_hook(_replicate_inputs_on(axis), with_kwargs=True)
        if style in _OUTPUT_REPLICATE:
            module.register_forward_hook(_replicate_on(axis))
        if style == "moe_tp_experts" and axis is not None and axis == ep and hasattr(module, "num_experts"):
            pre, post = _local_experts(mesh, axis)
            module.register_forward_pre_hook(pre, with_kwargs=True)
            module.register_forward_hook(post, with_kwargs=True, prepend=True)  # before the reduction
    if shard_inputs:
        model.register_forward_pre_hook(_shard_inputs(mesh, dp), with_kwargs=True)
    return model
