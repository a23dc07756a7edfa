"""Mixed precision on every mesh: ``hs.mixed_precision(model, policy)``.

    model = hs.parallelize(model, mesh)               # tp / ep / dp (gradient buckets), or none
    hs.fully_shard(...)                                # optional, before mixed_precision
    model = hs.mixed_precision(model)                  # bf16 compute, fp32 masters, fp32 grad sums
    optimizer = torch.optim.AdamW(model.parameters())  # fp32 parameters, so fp32 optimizer state

The standard recipe, with the names of fully_shard's policy (``MixedPrecisionPolicy``, as torch
FSDP2's): the parameters the model holds stay in their own dtype (fp32: the MASTER weights the
optimizer updates, and with them its state); every module computes with ``param_dtype`` copies of
them, made in a forward pre-hook of the module that owns them and dropped after its forward;
gradients are summed over the data-parallel axes in ``reduce_dtype`` and land in ``.grad`` in the
masters' dtype.

Why a cast per owning module and per call, and not one bf16 copy kept between steps: a kept copy
must be refreshed after every optimizer step (forgetting it trains nothing: the planted fault of
the level1 test), and a copy made at the module's own call is made again when activation
checkpointing recomputes that module in backward, so the recomputation sees the same values and
its gradients reach the master. The copy is an autograd op, so the gradient flows back through
it: ``ToCopyBackward`` turns the bf16 gradient into the master's dtype BEFORE the leaf's hook sees
it, so a gradient still Partial(sum) over dp (or tp, ep) reaches the data-parallel buckets
(csrc/runtime/grad_sync.cpp) in fp32 and is summed there in fp32 -- no C++ change. A
``reduce_dtype`` other than the masters' dtype (fp32 masters, bf16 sums: the cheaper, less
accurate choice) reduces that Partial where the gradient still has that dtype (`_ToCompute`),
then casts.

Modules that fully_shard groups own are left to the group: ``mixed_precision`` gives a group
without a policy this one (its gathers then run in param_dtype, its reduce-scatters in
reduce_dtype, docs/fully_shard.md) and refuses a group whose policy differs. 0-dim parameters,
which fully_shard keeps out of its groups, are cast here like any other. Integer parameters and
buffers are never cast (rotary ``inv_freq`` stays fp32; transformers computes the angles in fp32
and casts cos/sin to the activations' dtype).

With ``cast_forward_inputs`` the root's floating inputs are cast to param_dtype (pixel values,
inputs_embeds); ``output_dtype`` casts the root's floating outputs. transformers computes the loss
in fp32 from the bf16 logits either way.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from .. import _C
from .fully_shard import MixedPrecisionPolicy, _cast_floating, _groups

__all__ = ["BF16", "MixedPrecisionPolicy", "mixed_precision", "mixed_precision_policy"]

# The standard recipe: bf16 compute, fp32 gradient sums (the masters stay what they are: fp32).
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _error(message: str) -> ValueError:
    return ValueError(f"hypershard: mixed_precision: {message}")


def _check_policy(policy: Any) -> MixedPrecisionPolicy:
    if not isinstance(policy, MixedPrecisionPolicy):
        raise _error(f"policy {policy!r} is a {type(policy).__name__}; allowed: a hypershard.MixedPrecisionPolicy")
    floating = "a floating dtype (torch.bfloat16, torch.float16, torch.float32, ...)"
    if policy.param_dtype is None or not (
        isinstance(policy.param_dtype, torch.dtype) and policy.param_dtype.is_floating_point
    ):
        raise _error(f"param_dtype={policy.param_dtype!r} gives nothing to compute in; allowed: {floating}")
    for field in ("reduce_dtype", "output_dtype"):
        value = getattr(policy, field)
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise _error(f"{field}={value!r} is not a floating dtype; allowed: None or {floating}")
    return policy


class _ToCompute(torch.autograd.Function):
    """master -> its param_dtype copy; backward: the gradient summed in `reduce_dtype` (its
    Partial axes reduced here, where it has that dtype), then cast to the master's dtype. Only
    used when reduce_dtype differs from the master's dtype; otherwise a plain ``.to`` is enough
    (the buckets then sum the master-dtype gradient)."""

    @staticmethod
    def forward(ctx, master, param_dtype, reduce_dtype):
        ctx.master_dtype, ctx.reduce_dtype = master.dtype, reduce_dtype
        ctx.layout = _C.layout_of(master) if _C.is_dtensor(master) else None
        return master.to(param_dtype)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.to(ctx.reduce_dtype)
        if ctx.layout is not None and _C.is_dtensor(grad) and _C.layout_of(grad) != ctx.layout:
            grad = _C.redistribute(grad, ctx.layout)  # the sum over dp / tp / ep, in reduce_dtype
        return grad.to(ctx.master_dtype), None, None


class _OwnedCasts:
    """The forward pre- and post-hook of one module that owns parameters to cast: its parameters
    `names` are replaced by param_dtype copies for the duration of its forward."""

    def __init__(self, names: list, policy: MixedPrecisionPolicy):
        self.names = names
        self.param_dtype = policy.param_dtype
        self.reduce_dtype = policy.reduce_dtype or policy.param_dtype
        self.saved: list = []  # one dict per forward in progress (a module may call itself)

    def _cast(self, master: torch.Tensor) -> torch.Tensor:
        if _C.is_dtensor(master) and master.requires_grad:
            # The copy, not the master, reaches the ops: the master's gradient hook (the layout
            # policy and the buckets) is attached here.
            _C.install_grad_hook(master)
        if self.reduce_dtype == master.dtype or not (torch.is_grad_enabled() and master.requires_grad):
            return master.to(self.param_dtype)
        return _ToCompute.apply(master, self.param_dtype, self.reduce_dtype)

    def pre(self, module: nn.Module, args: tuple) -> None:
        params = module._parameters
        saved = {}
        if not self.saved:
            for name in self.names:
                master = params.get(name)
                if master is None:
                    continue
                if not isinstance(master, nn.Parameter):
                    raise _error(
                        f"{type(module).__name__}.{name} is not a parameter when its forward starts "
                        f"(fully_shard or another hook put a tensor there); allowed: mixed_precision "
                        f"applied last, after parallelize and fully_shard"
                    )
                saved[name] = master
                params[name] = self._cast(master)
        self.saved.append(saved)

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        saved = self.saved.pop()
        module._parameters.update(saved)


def mixed_precision_policy(module: nn.Module) -> Optional[MixedPrecisionPolicy]:
    """The policy `mixed_precision` gave `module` (the module it was called on), or None."""
    return getattr(module, "_hs_mixed_precision", None)


def mixed_precision(module: nn.Module, policy: Optional[MixedPrecisionPolicy] = None) -> nn.Module:
    """Makes `module` compute in ``policy.param_dtype`` from its own (master) parameters, in
    place, and returns it (see the module docstring). `policy` defaults to ``BF16`` (bf16
    compute, fp32 gradient sums). Apply it last: after parallelize and fully_shard. Every check
    runs before anything is changed."""
    policy = _check_policy(BF16 if policy is None else policy)
    for sub in module.modules():
        if hasattr(sub, "_hs_mixed_precision"):
            raise _error(
                f"{type(sub).__name__} is already under mixed precision; allowed: one mixed_precision call per model"
            )
    groups = _groups(module, True)
    for group in groups:
        if group.mp is not None and group.mp != policy:
            raise _error(
                f"{type(group.module).__name__} was fully sharded with {group.mp}, not {policy}; "
                f"allowed: fully_shard without mp_policy, or with this one"
            )
        if group.cgroup.gathered or group.cgroup.gather_in_flight:
            raise _error(
                f"{type(group.module).__name__}'s parameters are gathered (a forward or backward in "
                f"progress); allowed: between steps"
            )
    in_groups = {id(p) for group in groups for p in group.params}
    owners = []  # (module, names of its parameters to cast)
    for module_name, sub in module.named_modules():
        names = []
        for name, param in sub._parameters.items():
            if param is None or id(param) in in_groups or not param.is_floating_point():
                continue
            where = f"{module_name}.{name}" if module_name else name
            if param.dtype.itemsize <= policy.param_dtype.itemsize:
                raise _error(
                    f"parameter {where} is {param.dtype}, no wider than param_dtype={policy.param_dtype}: "
                    f"there would be no master copy to step in full precision; allowed: parameters "
                    f"wider than param_dtype (model.float() before parallelize)"
                )
            names.append(name)
        if names:
            owners.append((sub, names))
    if not owners and not groups:
        raise _error(f"{type(module).__name__} has no floating parameters to compute in {policy.param_dtype}")

    for group in groups:
        if group.mp is None:
            group.set_mp(policy)
    for sub, names in owners:
        casts = _OwnedCasts(names, policy)
        # prepend: before the module's other pre-hooks (expert parallelism's reads the weights).
        sub.register_forward_pre_hook(casts.pre, prepend=True)
        sub.register_forward_hook(casts.post, always_call=True)
    if policy.cast_forward_inputs:
        module.register_forward_pre_hook(
            lambda m, args, kwargs: _cast_floating((args, kwargs), policy.param_dtype), with_kwargs=True
        )
    if policy.output_dtype is not None:
        module.register_forward_hook(lambda m, args, output: _cast_floating(output, policy.output_dtype))
    module._hs_mixed_precision = policy
    return module
