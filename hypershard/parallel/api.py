"""parallelize(): puts a model's parameters on a mesh following a tensor-parallel plan (the plan
styles: hypershard/parallel/styles.py; experts on ep: experts.py; inputs over dp and cp: inputs.py;
attention heads on tp: attention.py).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Optional, Sequence, Union

from torch import nn

from .. import _C
from ..tensor.axes import note_axes_used, warn_unused_axes_at_first_forward
from ..tensor.dtensor import distribute_tensor
from ..tensor.placement_types import Shard
from .attention import _lay_out_attention
from .context import (
    is_moe_block,
    natural_order_reason,
    tokens_in_rank_order,
    use_causal_lm_loss,
)
from .inputs import CP_ALGORITHMS, _install_linear_attention, _shard_inputs
from .styles import _STYLES, STYLES, _placements, _style_for, ep_plan_of, tp_plan_of

__all__ = ["parallelize"]


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
    decides from the model (hypershard.parallel.context.natural_order_reason): natural order for
    models that read the stored order as natural positions (DeepSeek-V3.2's indexer, vision-language
    models, linear attention, an attention implementation other than sdpa, e.g. eager).

    A model with linear-attention layers (gated delta nets: Qwen3.5, Qwen3-Next) on a cp mesh gets
    their recurrence passed rank to rank (hypershard.parallel.linear_attention) and keeps its sequence in
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
