"""hypershard.compile: torch.compile of a function or a model with its hypershard DTensors traced
as TracedDTensors (hypershard/tensor/traced.py), so the local program and its collectives become
the graph (docs/compile.md, "The local program"). With fully_shard, each innermost group (a block)
is compiled and the groups' gathers stay eager hooks around it."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import _C
from ..fsdp.fully_shard import _groups
from ..tensor.traced import from_traced, to_traced
from .dynamo_setup import _prepare_tracing

__all__ = ["compile"]


def _static_shapes(compile_kwargs: dict) -> dict:
    """The compile settings with dynamic=False. A traced program is made for concrete layouts:
    every rank's chunk sizes and offsets are constants in its graph. With dynamic shapes, Dynamo
    recompiled a training forward generically after its second sequence length, and the ranks'
    programs then disagreed on the collectives they issue (gloo: "received data size doesn't
    match"). Each new input shape compiles its own program instead."""
    if compile_kwargs.get("dynamic"):
        raise ValueError(
            "hypershard: compile: dynamic=True: a traced program's layouts have concrete shapes "
            "(each rank's chunk offsets are constants in its graph); allowed: dynamic=False or None "
            "(each new input shape then compiles its own program)"
        )
    return {**compile_kwargs, "dynamic": False}


def _runs_eagerly(values: Any) -> bool:
    """A call where some DTensor has an empty shard on some rank runs eagerly, on every rank. Its
    traced programs would differ between ranks beyond their constants: the compiler drops the
    zero-size work of the empty rank and with it the collectives that only fed that work (a
    LlamaFactory run's one-sequence last micro-batch on dp2 x tp2 left gloo with mismatched
    collectives). Layout.has_empty_shard reads it from the layout alone: the same answer on every
    rank."""
    return any(
        _C.layout_of(v).has_empty_shard
        for v in pytree.tree_leaves(values)
        if isinstance(v, torch.Tensor) and _C.is_dtensor(v)
    )


def compile(target: Any, **compile_kwargs: Any) -> Any:
    """torch.compile(target, **compile_kwargs) with hypershard's DTensors traced (module docstring):
    the local program and its collectives become the graph, forward and backward.

    - A function: returns a callable; its DTensor arguments enter as TracedDTensors and its
      DTensor outputs leave as hypershard DTensors (differentiable both ways).
    - An nn.Module: its forward is compiled and replaced; `target` is returned. Parameters,
      buffers and DTensor arguments enter as TracedDTensors; gradients reach the parameters as
      hypershard DTensors, so grad sync and optimizers see what eager gives them. The module's
      own forward hooks (parallelize's input sharding) run eagerly around the compiled forward;
      its submodules' hooks are traced.
    """
    compile_kwargs = _static_shapes(compile_kwargs)
    if not isinstance(target, torch.nn.Module):
        compiled_fn = torch.compile(target, **compile_kwargs)

        @functools.wraps(target)
        def traced_call(*args: Any, **kwargs: Any) -> Any:
            if _runs_eagerly((args, kwargs)):
                return target(*args, **kwargs)
            _prepare_tracing()
            args, kwargs = pytree.tree_map(to_traced, (args, kwargs))
            return pytree.tree_map(from_traced, compiled_fn(*args, **kwargs))

        return _outside_dynamo(traced_call)

    model = target
    if getattr(model, "_hypershard_compiled", None) == compile_kwargs:
        return model  # compiled already with these settings (HF prepares a model more than once)
    for param in model.parameters():
        if _C.is_dtensor(param) and _C.device_mesh_of(param).load_balanced_sequence_axis >= 0:
            # transformers (with torch < 2.14) builds the causal mask from natural positions
            # whenever Dynamo traces; a head-tail ordered sequence would be masked wrongly
            raise ValueError(
                "hypershard: compile: this model's sequence is sharded in head-tail order "
                "(context parallelism with load balancing), but a compiled forward gets transformers' "
                "causal mask built from natural positions; allowed: parallelize(..., cp_load_balance=False)"
            )
    blocks = _compiled_modules(model)
    for module in blocks:
        _compile_forward(module, compile_kwargs)
    if model not in blocks:  # its forward runs eagerly, around the compiled blocks
        model.forward = _outside_dynamo(_without_training_cache(type(model).forward.__get__(model), model))
    model._hypershard_compiled = dict(compile_kwargs)
    return model


def _compiled_modules(model: torch.nn.Module) -> list:
    """The modules whose forward is compiled: the model itself; with fully_shard, every group that
    holds no other group (the blocks). A group's gather and reduce-scatter are its hooks around its
    forward, which run eagerly (as the model's own hooks do), so each block's gathered parameters
    enter its compiled forward like any parameter, and the groups' memory behaviour and prefetch
    stay eager's. Code outside the blocks (the root's embedding, final norm, head, loss) runs
    eagerly: compiling the root would trace the blocks' hooks, whose collectives are not graph
    ops."""
    groups = _groups(model, recurse=True)
    if not groups:
        return [model]
    return [g.module for g in groups if len(_groups(g.module, recurse=True)) == 1]


def _compile_forward(module: torch.nn.Module, compile_kwargs: dict) -> None:
    """Replaces `module.forward` by one that runs it compiled, with the module's DTensor parameters
    and buffers (as they are at the call: a fully_shard group's gathered ones) and its DTensor
    arguments traced. (A model's blocks of one class share one program: level0
    qwen3_fully_shard_dp2_aot_eager counts one forward and one backward graph for two blocks.)"""
    forward = type(module).forward.__get__(module)
    compiled = torch.compile(forward, **compile_kwargs)
    warned = False

    @functools.wraps(forward)
    def traced_forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal warned
        states = [  # the DTensor parameters and buffers, as the call finds them
            (table, name, value)
            for m in module.modules()
            for table in (m._parameters, m._buffers)
            for name, value in table.items()
            if isinstance(value, torch.Tensor) and _C.is_dtensor(value)
        ]
        if _runs_eagerly([value for _, _, value in states]):
            if not warned:
                warned = True
                warnings.warn(
                    f"hypershard: compile: a parameter or buffer of {type(module).__name__} has an empty shard on "
                    "some rank (a dim smaller than its shard count), so its forward runs eagerly, uncompiled",
                    stacklevel=2,
                )
            return forward(*args, **kwargs)
        if _runs_eagerly((args, kwargs)) or kwargs.get("past_key_values") is not None:
            # (a block handed a cache object, evaluating with one: the cache, not a pytree, would
            # keep the traced tensors it is given)
            return forward(*args, **kwargs)
        _prepare_tracing()
        traced = {}  # a tied parameter gets one TracedDTensor
        for table, name, value in states:
            if id(value) not in traced:
                traced[id(value)] = to_traced(value)
            table[name] = traced[id(value)]
        try:
            args, kwargs = pytree.tree_map(to_traced, (args, kwargs))
            out = compiled(*args, **kwargs)
        finally:
            for table, name, value in states:
                table[name] = value
        return pytree.tree_map(from_traced, out)

    module.forward = _outside_dynamo(_without_training_cache(traced_forward, module))


def _outside_dynamo(fn: Callable) -> Callable:
    """`fn`, which a torch.compile around it runs as it is (a graph break there) instead of tracing
    it. A plain HF Trainer(torch_compile=True) calls torch.compile(model) on a model hs.compile made:
    traced, the wrappers' conversions crashed Dynamo; run as they are, each runs the program
    hs.compile made for it."""
    return torch._dynamo.disable(fn)


def _without_training_cache(forward: Callable, module: torch.nn.Module) -> Callable:
    """`forward` with use_cache=False by default while training: a training forward needs no cache,
    and a cache object (not a pytree) would hand the traced tensors it keeps to the caller."""
    if "use_cache" not in inspect.signature(forward).parameters:
        return forward

    @functools.wraps(forward)
    def training_forward(*args: Any, **kwargs: Any) -> Any:
        if module.training:
            kwargs.setdefault("use_cache", False)
        return forward(*args, **kwargs)

    return training_forward
