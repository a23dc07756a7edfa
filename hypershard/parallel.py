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

Attention heads on tp are laid out before anything is distributed (``_attention_layout``), so that a
plan ``parallelize`` accepts also runs in strict mode:

- KV heads that tp divides: the plan as written (q/k/v colwise, o rowwise);
- tp a multiple of the KV heads (e.g. 2 KV heads on tp=4): the ``k_proj``/``v_proj`` colwise entries
  become ``replicate`` -- every rank keeps every KV head, as Megatron replicates them, and the
  attention rule reads the one KV head its rank's query heads share;
- otherwise (e.g. 3 KV heads on tp=2: rank 0's query heads 0-2 read KV heads 0 and 1, rank 1's 3-5
  read 1 and 2) the KV heads can be neither split nor read from one group per rank, so every entry
  of that attention module becomes ``replicate``: each tp rank runs every head (a warning says so),
  the rest of the model keeps its plan.

A ``num_attention_heads`` that tp does not divide, or that is not a multiple of
``num_key_value_heads``, is refused up front with the reason.

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
plan's keys win. The experts module itself is never altered during a call: its forward runs on a
shallow view of it that holds the local weights and counts, so an exception inside leaves nothing
to restore.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Mapping
from types import MethodType
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from . import _C
from .axes import note_axes_used, warn_unused_axes_at_first_forward
from .context_parallel import (
    is_moe_block,
    natural_order_reason,
    shift_labels,
    to_head_tail,
    tokens_in_rank_order,
    use_causal_lm_loss,
)
from .dtensor import distribute_tensor
from .placement_types import Replicate, Shard
from .traced import TracedDTensor, from_traced, to_traced

__all__ = ["parallelize", "tp_plan_of", "ep_plan_of", "STYLES", "Style", "style"]


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


# The keyword by which the local-experts pre-hook hands its call to the module's forward and to
# the post-hook (torch passes the pre-hook's kwargs to both); the forward takes it off.
_LOCAL_EXPERTS_CALL = "_hypershard_local_experts"


class _LocalExpertsCall:
    """One expert-parallel call of an experts module: this rank's local weights, its expert count,
    the mesh and layout of the hidden states (the output's, made Partial(sum) over ep), and whether
    the call came from hypershard.compile's traced forward (its output then goes back traced)."""

    def __init__(self, parameters: dict, num_experts: int, mesh, layout, traced: bool):
        self.parameters, self.num_experts, self.mesh, self.layout = parameters, num_experts, mesh, layout
        self.traced = traced

    def view_of(self, module: nn.Module) -> nn.Module:
        """A shallow copy of `module` that sees this rank's experts as transformers' EP sets them
        up (local weights, ``num_experts`` local, ``_is_expert_parallel``). The module itself is
        never touched, so an exception in its forward leaves nothing to restore."""
        view = object.__new__(type(module))
        view.__dict__.update(module.__dict__)
        view.__dict__.pop("forward", None)  # the class's forward, not the dispatching one below
        view.__dict__["_parameters"] = {**module._parameters, **self.parameters}
        view.__dict__["num_experts"] = self.num_experts
        view.__dict__["_is_expert_parallel"] = True  # transformers' implementations then skip the sentinel rows
        return view


@torch._dynamo.disable  # the experts' local program reads its routing (see _local_experts)
def _experts_forward(self, *args, **kwargs):
    """An experts module's forward under expert parallelism: the class's forward, on the view the
    pre-hook's call describes (or on the module itself for a call the pre-hook left alone)."""
    call = kwargs.pop(_LOCAL_EXPERTS_CALL, None)
    return type(self).forward(self if call is None else call.view_of(self), *args, **kwargs)


def _local_experts(mesh, ep_axis: int):
    """Expert parallelism on local tensors, as transformers runs it: the experts module gets this
    rank's experts (its shard of the [experts, ...] weights), every token of its data-parallel
    shard, and the routing remapped to local expert ids -- tokens routed to other ranks' experts
    get the sentinel id `num_local_experts` (which transformers' expert implementations skip) and
    weight 0. Its output is this rank's part of the sum over ep (Partial(sum) on ep), which the
    moe_tp_experts style then reduces. Nothing inside the module is a DTensor, so no per-op rule
    sees the experts' [tokens, 2 x intermediate] products (whose zeros in other ranks' rows no
    Layout can say); gradients come back Partial over ep (inputs) and over the token axes
    (weights), and the usual reductions sum them. The hooks keep no state: the pre-hook's
    `_LocalExpertsCall` travels with the call's kwargs.

    Under hypershard.compile the three hooks run eagerly (torch._dynamo.disable: the experts'
    program reads its routing, as transformers' grouped products read their offsets), on the
    traced DTensors taken back as hypershard DTensors; the output goes back traced."""
    ep_size = mesh.shape[ep_axis]
    ep_rank = mesh.get_local_rank(ep_axis)

    @torch._dynamo.disable
    def pre(module, args, kwargs):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        values = list(args) + [kwargs[n] for n in names[len(args) :] if n in kwargs]
        traced = any(isinstance(v, TracedDTensor) for v in values)
        values = [from_traced(v) for v in values]
        if len(values) != 3 or not all(_C.is_dtensor(v) for v in values):
            return None  # not a call this hook understands (plain tensors): transformers' own path
        hidden, index, weights = values
        local_count = module.num_experts // ep_size
        token_axes = sorted({a for axes in _C.layout_of(hidden).dim_axes for a in axes})
        parameters = {}
        for name, param in module._parameters.items():
            if isinstance(param, TracedDTensor):  # hypershard.compile's swap hooked the parameter itself
                parameters[name] = _local(from_traced(param), token_axes)
            elif param is not None and _C.is_dtensor(param):
                _C.install_grad_hook(param)  # it reaches no op itself: its Partial gradient needs the hook
                parameters[name] = _local(param, token_axes)
        call = _LocalExpertsCall(parameters, local_count, _C.device_mesh_of(hidden), _C.layout_of(hidden), traced)
        index = _C.local_of(index)
        mine = torch.div(index, local_count, rounding_mode="floor") == ep_rank
        index = torch.where(mine, index - ep_rank * local_count, torch.full_like(index, local_count))
        weights = _local(weights, [ep_axis]).masked_fill(~mine, 0.0)
        return (_local(hidden, [ep_axis]), index, weights), {_LOCAL_EXPERTS_CALL: call}

    @torch._dynamo.disable
    def post(module, args, kwargs, output):
        call = kwargs.get(_LOCAL_EXPERTS_CALL)
        if call is None:
            return output
        output = _C.from_local(output, call.mesh, _with_partial(call.layout, [ep_axis]))
        return to_traced(output) if call.traced else output

    return pre, post


# Forward arguments whose dim 0 is not the batch: a vision model's patches of all images and
# their grid sizes. They stay Replicate (every data-parallel rank runs the vision tower on all of
# them); the text-side tensors are split over dp.
_NOT_BATCH_INPUTS = frozenset({"pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw"})


# Context parallelism (docs/context_parallel.md): the algorithms the attention rule plans.
CP_ALGORITHMS = ("all_gather_kv", "ulysses", "ring")
# Forward arguments whose last dim is the sequence (position ids: also M-RoPE's (3, batch, seq)).
_SEQUENCE_INPUTS = frozenset({"input_ids", "labels", "shift_labels", "position_ids", "token_type_ids"})


def _rope_index(module, kwargs: dict):
    """A vision-language model's M-RoPE position ids (3, batch, seq) for the natural-order plain
    inputs, from its own get_rope_index (images and videos get positions from their grids); None
    when the model has none or the batch has no image or video."""
    owner = next((m for m in (module, getattr(module, "model", None)) if hasattr(m, "get_rope_index")), None)
    grids = {k: kwargs.get(k) for k in ("image_grid_thw", "video_grid_thw")}
    if owner is None or all(g is None for g in grids.values()):
        return None
    extra = {k: kwargs[k] for k in ("mm_token_type_ids", "attention_mask") if kwargs.get(k) is not None}
    position_ids, _ = owner.get_rope_index(kwargs["input_ids"], **grids, **extra)
    return position_ids


def _head_tail_inputs(kwargs: dict, chunks: int, module=None) -> dict:
    """The forward's keyword tensors in head-tail order along the sequence (hypershard.context_parallel),
    natural-order work done first: labels shifted by one position over the WHOLE sequence (passed as
    ``shift_labels``, which transformers' ForCausalLMLoss then takes as they are), position ids made
    when the caller gave none, an all-ones attention mask always (see below). A padding mask is
    taken only on the right (_right_padding_dropped); others are refused: transformers builds the
    mask's causal part from natural positions. `chunks` 0: the sequence stays in natural order
    (a model that keeps it, see parallelize)."""
    kwargs = dict(kwargs)
    ids = kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    source = ids if isinstance(ids, torch.Tensor) else embeds
    if not isinstance(source, torch.Tensor) or _C.is_dtensor(source):
        return kwargs
    batch, length = source.shape[0], source.shape[1]
    if chunks and length % chunks:
        raise ValueError(
            f"hypershard: parallelize: a sequence of {length} tokens cannot be stored in head-tail "
            f"order of {chunks} chunks (2 x the context-parallel size); allowed: sequences padded to "
            f"a multiple of {chunks}"
        )
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not _C.is_dtensor(mask) and not bool(mask.bool().all()):
        _right_padding_dropped(mask, kwargs, module)
    # Always an all-ones mask: without one (and without a KV cache, use_cache=False) transformers
    # reads head-tail position ids as packed sequences and masks across their "boundaries"; with
    # one it sees nothing to mask and attention runs is_causal over the global positions.
    kwargs["attention_mask"] = torch.ones(batch, length, dtype=torch.long, device=source.device)
    if kwargs.get("position_ids") is None and module is not None and isinstance(ids, torch.Tensor):
        kwargs["position_ids"] = _rope_index(module, kwargs)
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = torch.arange(length, device=source.device).expand(batch, length)
    targets = _shifted_targets(kwargs)
    if targets is not None:
        kwargs["labels"] = kwargs["shift_labels"] = targets
    if not chunks:  # natural order
        return kwargs
    for name, value in list(kwargs.items()):
        if isinstance(value, torch.Tensor) and not _C.is_dtensor(value) and value.dim() > 0:
            if name in _SEQUENCE_INPUTS:
                kwargs[name] = to_head_tail(value, value.dim() - 1, chunks)
            elif name == "inputs_embeds":
                kwargs[name] = to_head_tail(value, 1, chunks)
    return kwargs


def _shifted_targets(kwargs: dict) -> Optional[torch.Tensor]:
    """Position p's target for every p, as transformers' ForCausalLMLoss takes it: the caller's
    ``shift_labels`` when given, else ``labels`` shifted by one (on the whole natural-order
    sequence); None without either."""
    if isinstance(kwargs.get("shift_labels"), torch.Tensor):
        return kwargs["shift_labels"]
    return shift_labels(kwargs["labels"]) if isinstance(kwargs.get("labels"), torch.Tensor) else None


def _right_padding_dropped(mask: torch.Tensor, kwargs: dict, module) -> None:
    """Checks that padding `mask` [B, L] can be replaced by all ones, else raises: every row
    padded on the right only, no trained target on a pad position, and no auxiliary router loss.
    Then no real token attends to a later pad (the models are causal; a causal conv or
    recurrence reads only earlier tokens), so every real position's output and every trained
    token's loss are the ones the mask gives; only the pads' own outputs differ, and nothing
    trains on them. A left-padded row needs the mask's causal part at global positions, which
    transformers builds from natural ones."""
    if mask.dim() != 2:
        raise ValueError(
            f"hypershard: parallelize: a {mask.dim()}-D attention_mask on a context-parallel mesh (its "
            "positions would be read as natural ones); allowed: a 2-D mask padding on the right, or none"
        )
    keep = mask.bool()
    lengths = keep.sum(-1, keepdim=True)
    positions = torch.arange(keep.shape[-1], device=keep.device)
    if not torch.equal(keep, positions < lengths):
        raise ValueError(
            "hypershard: parallelize: a padding attention_mask on a context-parallel mesh must pad on "
            "the right (transformers builds the causal part of a left-padding mask from natural "
            "positions); allowed: right padding with labels -100 on the pads, packing, or no mask"
        )
    shifted = _shifted_targets(kwargs)
    if shifted is not None and bool((shifted[~keep] != -100).any()):
        raise ValueError(
            "hypershard: parallelize: a right-padding attention_mask on a context-parallel mesh with "
            "a trained target on a pad position (the mask is replaced by all ones, which changes the "
            "pads' own outputs); allowed: labels -100 on every pad token"
        )
    config = _text_config(module) if module is not None else None
    router_loss = kwargs.get("output_router_logits")  # the forward's argument wins over the config
    if router_loss is None:
        router_loss = getattr(config, "output_router_logits", False)
    if router_loss:
        raise ValueError(
            "hypershard: parallelize: a padding attention_mask on a context-parallel mesh with the "
            "auxiliary router loss (output_router_logits): it would count the pad tokens once the "
            "mask is replaced by all ones; allowed: output_router_logits=False, or no padding"
        )


def _shard_inputs(mesh, dp_axis, cp_axis: Optional[int] = None, head_tail: bool = True):
    # dp_axis: None, a mesh axis index, or a list of them (HSDP: the batch split over both data-parallel axes)
    dp_axes = [] if dp_axis is None else [dp_axis] if isinstance(dp_axis, int) else list(dp_axis)

    def distribute(t, batch: bool = True, sequence_dim: Optional[int] = None):
        if not isinstance(t, torch.Tensor) or _C.is_dtensor(t) or t.dim() == 0:
            return t
        placements: list = [Replicate()] * mesh.ndim
        for axis in dp_axes if batch else ():
            # M-RoPE position ids are (3, batch, seq): their batch is dim 1
            placements[axis] = Shard(1 if sequence_dim == 2 and t.dim() == 3 and t.shape[0] == 3 else 0)
        if cp_axis is not None and sequence_dim is not None:
            placements[cp_axis] = Shard(sequence_dim)
        return distribute_tensor(t, mesh, placements)

    def sequence_dim(name: str, t) -> Optional[int]:
        if cp_axis is None or not isinstance(t, torch.Tensor):
            return None
        return t.dim() - 1 if name in _SEQUENCE_INPUTS else 1 if name == "inputs_embeds" else None

    def hook(module, args, kwargs):
        if cp_axis is not None:
            if args:  # a positional input_ids, as HF's forward names it
                kwargs = {"input_ids": args[0], **kwargs}
                args = args[1:]
            kwargs = _head_tail_inputs(kwargs, 2 * mesh.shape[cp_axis] if head_tail else 0, module)
            if module.training:
                # A training forward needs no cache, and a linear-attention layer's cache would
                # copy this rank's conv and recurrent states into whole plain tensors.
                kwargs.setdefault("use_cache", False)
        return (
            tuple(distribute(a) for a in args),
            {k: distribute(v, k not in _NOT_BATCH_INPUTS, sequence_dim(k, v)) for k, v in kwargs.items()},
        )

    return hook


def _install_linear_attention(model: nn.Module, mesh, cp_axis: int) -> int:
    from .linear_attention import install_context_parallel_linear_attention

    return install_context_parallel_linear_attention(model, mesh, cp_axis)


# ------------------------------------------------------------------------------ attention heads


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


# How a tp plan's attention is laid out (see _attention_layout).
HEADS_SHARDED, KV_REPLICATED, ATTENTION_REPLICATED = "heads_sharded", "kv_replicated", "attention_replicated"


def _attention_layout(model: nn.Module, tp_size: int) -> str:
    """How the attention of `model`'s tp plan is laid out on `tp_size` ranks, decided before any
    forward so that strict mode runs what parallelize accepts. Query head i reads KV head
    i // group (group = query heads / KV heads); tp gives each rank a block of query heads.

    - HEADS_SHARDED: tp divides the KV heads, every rank holds whole KV groups (the plan as written);
    - KV_REPLICATED: tp is a multiple of the KV heads, so every rank's query heads lie in one group;
      k_proj / v_proj stay whole and the attention rule reads that group's KV head locally;
    - ATTENTION_REPLICATED: any other KV count (3 KV heads on tp=2: rank 0's query heads 0-2 read KV
      heads 0 and 1, rank 1's 3-5 read 1 and 2 -- neither a block of KV heads per rank nor one group
      per rank, so no layout with sharded query heads runs); the attention runs whole on every tp rank.

    Refused (ValueError naming the config fields): query heads that tp does not divide, and query
    heads that are not a multiple of the KV heads."""
    text = _text_config(model)
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None)
    if tp_size <= 1 or not heads:
        return HEADS_SHARDED
    if heads % tp_size:
        raise ValueError(
            f"hypershard: parallelize: config.num_attention_heads={heads} is not divisible by the "
            f"tensor-parallel size {tp_size}; allowed: a tp size that divides it"
        )
    if kv is None:
        return HEADS_SHARDED
    if kv <= 0 or heads % kv:
        raise ValueError(
            f"hypershard: parallelize: config.num_attention_heads={heads} is not a multiple of "
            f"config.num_key_value_heads={kv}: the query heads cannot be grouped over the key/value "
            f"heads, so no tensor-parallel layout of the attention exists; allowed: "
            f"num_key_value_heads dividing num_attention_heads"
        )
    if kv % tp_size == 0:
        return HEADS_SHARDED
    group, local_heads = heads // kv, heads // tp_size
    return KV_REPLICATED if group % local_heads == 0 else ATTENTION_REPLICATED


def _attention_modules(plan: Mapping[str, str]) -> tuple:
    """The plan's attention module patterns (those with q_proj / k_proj / v_proj entries), each with a trailing dot."""
    return tuple(
        sorted(
            {
                pattern.rsplit(".", 1)[0] + "."
                for pattern in plan
                if pattern.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")
            }
        )
    )


def _lay_out_attention(plan: dict, model: nn.Module, tp_size: int) -> dict:
    """`plan` with its attention entries rewritten for `_attention_layout` (others as they are)."""
    layout = _attention_layout(model, tp_size)
    if layout == KV_REPLICATED:
        return {
            pattern: "replicate"
            if pattern.rsplit(".", 1)[-1] in ("k_proj", "v_proj") and str(name).startswith("colwise")
            else name
            for pattern, name in plan.items()
        }
    modules = _attention_modules(plan)
    if layout == HEADS_SHARDED or not modules:
        return plan
    text = _text_config(model)
    warnings.warn(
        f"hypershard: parallelize: {text.num_key_value_heads} key/value heads (grouped under "
        f"{text.num_attention_heads} query heads) cannot be laid out with the query heads sharded over "
        f"tp={tp_size} (tp neither divides them nor is a multiple of them): the attention modules "
        f"{list(modules)} are replicated on tp (every rank runs every head)",
        stacklevel=3,
    )
    # Unknown styles stay, for the check that names them.
    return {
        pattern: "replicate" if pattern.startswith(modules) and name in _STYLES else name
        for pattern, name in plan.items()
    }


# ------------------------------------------------------------------------------------ parallelize


def parallelize(
    model: nn.Module,
    mesh,
    plan: Optional[Mapping[str, str]] = None,
    *,
    tp_axis: str = "tp",
    dp_axis: Union[str, Sequence[str]] = "dp",
    ep_axis: str = "ep",
    cp_axis: str = "cp",
    cp_algorithm: str = "all_gather_kv",
    cp_load_balance: Optional[bool] = None,
    ep_plan: Optional[Mapping[str, str]] = None,
    shard_inputs: bool = True,
) -> nn.Module:
    """Distributes `model`'s parameters over `mesh` (in place) and returns the model.

    `plan` maps module or parameter name patterns ("model.layers.*.mlp.up_proj") to styles; None
    uses the model's own plan. `ep_plan` (None: the model's ``base_model_ep_plan``) is applied on
    `ep_axis` the same way. Axes named `tp_axis` / `dp_axis` / `ep_axis` that the mesh lacks are
    simply not used. With `shard_inputs`, tensor arguments of forward are sharded on dim 0 over
    `dp_axis` (Replicate elsewhere); pass DTensors yourself for other layouts. `dp_axis` may be
    several axis names (HSDP's replicate and shard axes): the batch is split over each of them,
    the first one major.

    A mesh axis named `cp_axis` shards the sequence (context parallelism, docs/context_parallel.md):
    the mesh is declared load-balanced on it (sequences stored in head-tail order of 2 x its size
    chunks; see `cp_load_balance`), and the forward's input ids, position ids (made when absent: a
    vision-language model's M-RoPE ids from its get_rope_index) and labels (shifted by one position
    over the whole sequence first, passed as ``shift_labels``) are permuted to that order and
    sharded on their sequence dim over it. Parameters are Replicate on cp (their gradients are
    summed over it like data parallelism's). `cp_algorithm`: how attention runs on the sharded
    sequence: "all_gather_kv" (K/V all-gathered, their gradients reduce-scattered, the query
    sharded; the default), "ulysses" (one all-to-all per tensor moves the sharding from the sequence
    to the heads and back; needs every rank's query and KV heads divisible by the cp size) or "ring"
    (K/V blocks passed rank to rank, online-softmax merging, O(S/cp) memory). A call the chosen
    algorithm cannot run (uneven blocks, heads that do not divide) runs all-gather-KV.
    `cp_load_balance`: store sequences in head-tail order (True) or natural order (False); None
    decides from the model (hypershard.context_parallel.natural_order_reason): natural order for
    models that read the stored order as natural positions (DeepSeek-V3.2's indexer, vision-language
    models, linear attention, an attention implementation other than sdpa, e.g. eager).

    A model with linear-attention layers (gated delta nets: Qwen3.5, Qwen3-Next) on a cp mesh gets
    their recurrence passed rank to rank (hypershard.linear_attention) and keeps its sequence in
    NATURAL order: the mesh is not declared load-balanced (docs/context_parallel.md says why).

    Every style of the plans is checked before anything is distributed: an unknown style, or one
    the module cannot take (see the module docstring), raises a ValueError naming the module."""
    names = list(mesh.mesh_dim_names)
    tp = names.index(tp_axis) if tp_axis in names else None
    # a tuple of axis names (HSDP's replicate and shard axes): the batch is split over each of them
    dp_axes = [a for a in ([dp_axis] if isinstance(dp_axis, str) else dp_axis) if a in names]
    ep = names.index(ep_axis) if ep_axis in names else None
    cp = names.index(cp_axis) if cp_axis in names else None
    if cp is not None and cp_algorithm not in CP_ALGORITHMS:
        raise ValueError(
            f"hypershard: parallelize: cp_algorithm {cp_algorithm!r} is not implemented; allowed: {list(CP_ALGORITHMS)}"
        )
    if cp is not None and cp_load_balance and (reason := natural_order_reason(model)) is not None:
        raise ValueError(
            f"hypershard: parallelize: cp_load_balance=True: this model must keep natural order ({reason}); "
            "allowed: cp_load_balance None or False"
        )
    tp_plan = (tp_plan_of(model) if plan is None else dict(plan)) if tp is not None else {}
    ep_plan = (ep_plan_of(model) if ep_plan is None else dict(ep_plan)) if ep is not None else {}
    if tp is not None and tp_plan:
        tp_plan = _lay_out_attention(tp_plan, model, mesh.shape[tp])
    # pattern -> (Style, mesh axis); the EP plan's keys first (they win where both name a module).
    named = {pattern: (name, ep) for pattern, name in ep_plan.items()}
    for pattern, name in tp_plan.items():
        named.setdefault(pattern, (name, tp))
    for pattern, (name, _) in named.items():
        if name not in _STYLES:
            matched = [n for n, _ in model.named_modules() if fnmatch.fnmatchcase(n, pattern)]
            matched += [n for n, _ in model.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
            where = repr(matched[0]) if matched else f"pattern {pattern!r}"
            raise ValueError(
                f"hypershard: parallelize: module {where}: unknown plan style {name!r}; allowed: {list(STYLES)}"
            )
    entries = {pattern: (_STYLES[name], axis) for pattern, (name, axis) in named.items()}

    # Decide every layout (and check it) before distributing anything.
    decided = []  # (module, param_name, param, placements); a shared (tied) parameter once
    seen: dict = {}
    hooks = []  # (module, Style, axis)
    for module_name, module in model.named_modules():
        module_entry = _style_for(module_name, entries)
        if module_entry is not None:
            module_style, axis = module_entry
            module_style.check_module(model, module_name, module)
            hooks.append((module, module_style, axis))
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
                param_style, axis = entry
                dim = param_style.param_dim(module, param_name, param)
                param_style.check_param(full_name, param, dim, mesh.shape[axis])
            decided.append((module, param_name, param, _placements(mesh, axis, dim)))

    distributed: dict = {}
    for module, param_name, param, placements in decided:
        if id(param) not in distributed:
            dt = distribute_tensor(param.detach(), mesh, placements)
            distributed[id(param)] = nn.Parameter(dt, requires_grad=param.requires_grad)
        module._parameters[param_name] = distributed[id(param)]
    for module, module_style, axis in hooks:
        module_style.install(module, mesh, axis, ep)
    balanced = cp is not None and (natural_order_reason(model) is None if cp_load_balance is None else cp_load_balance)
    if cp is not None:
        mesh.load_balanced_sequence_axis = cp if balanced else -1
        mesh.cp_algorithm = cp_algorithm
    if cp is not None:
        # its recurrence's state chain and conv halo keep natural order (natural_order_reason)
        _install_linear_attention(model, mesh, cp)
        # MoE blocks flatten (batch, sequence): with several sequences per rank they take the
        # tokens as one run per rank
        for module in model.modules():
            if is_moe_block(module):
                tokens_in_rank_order(module)
    if shard_inputs:
        model.register_forward_pre_hook(
            _shard_inputs(mesh, [names.index(a) for a in dp_axes], cp, balanced), with_kwargs=True
        )
    if cp is not None:  # a loss that flattens (batch, sequence) needs one sequence per dp rank
        use_causal_lm_loss(model)
    laid_out = {i for *_, placements in decided for i, p in enumerate(placements or ()) if isinstance(p, Shard)}
    laid_out |= {axis for _, _, axis in hooks}
    laid_out |= {cp}
    note_axes_used(mesh, [names[axis] for axis in laid_out if axis is not None] + (dp_axes if shard_inputs else []))
    warn_unused_axes_at_first_forward(model, mesh, "parallelize")
    return model
