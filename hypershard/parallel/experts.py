"""Expert parallelism: the experts module runs on its rank's LOCAL experts (parallelize's ep axis).

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

import torch
from torch import nn

from .. import _C
from ..tensor.traced import TracedDTensor, from_traced, to_traced

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
