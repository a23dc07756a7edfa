"""What a hypershard.compile'd call needs from torch and transformers before Dynamo traces it:
transformers' grouped_mm_fallback gets a traceable backward for TracedDTensors, and Dynamo records
``DTensor.redistribute(mesh, placements)`` on a traced DTensor (docs/compile.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..tensor.traced import TracedDTensor, _traced_placements

# ------------------------------------------------------- transformers' grouped_mm_fallback backward
# transformers' MoE product without aten's _grouped_mm (float32 under torch.compile) is its custom
# op grouped_mm_fallback, whose backward loops over offs.tolist(): values a traced program does not
# have (torch.compile on one device fails there too: GuardOnDataDependentSymNode). For traced
# hypershard DTensors its backward is instead the same maths as two grouped products, with rules
# and a traceable local program (hypershard::grouped_mm_local) -- what hypershard's eager autograd
# kernel for DTensors records (csrc/kernels/external_autograd.cpp). Plain tensors keep
# transformers' backward, unchanged.

_GROUPED_MM_FALLBACK = "transformers::grouped_mm_fallback"


def _grouped_mm_fallback_backward_of(original_setup: Callable, original_backward: Callable) -> tuple:
    def setup_context(ctx, inputs, output):
        ctx.hypershard_traced = isinstance(inputs[1], TracedDTensor)
        if ctx.hypershard_traced:
            ctx.save_for_backward(*inputs)
        elif original_setup is not None:
            original_setup(ctx, inputs, output)

    def backward(ctx, grad):
        if not ctx.hypershard_traced:
            return original_backward(ctx, grad)
        input, weight, offs = ctx.saved_tensors
        # group e's rows of the input gradient: grad's rows times weight[e]^T; weight[e]'s
        # gradient: those rows of input^T times grad
        dinput = torch._grouped_mm(grad, weight.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
        dweight = torch._grouped_mm(input.transpose(0, 1), grad, offs) if ctx.needs_input_grad[1] else None
        return dinput, dweight, None

    backward.hypershard_routes_traced = True
    return setup_context, backward


def _route_grouped_mm_fallback_backward() -> None:
    """Installs the traced backward above on transformers' op, once, when transformers defined it
    as a torch.library custom op (otherwise there is nothing to route and its backward is its own)."""
    try:
        from torch._library.custom_ops import OPDEFS  # torch's registry of torch.library custom ops
    except ImportError:  # another torch: transformers' backward stays (it fails where it reads offs)
        return
    opdef = OPDEFS.get(_GROUPED_MM_FALLBACK)
    if opdef is None or opdef._backward_fn is None or getattr(opdef._backward_fn, "hypershard_routes_traced", False):
        return
    setup_context, backward = _grouped_mm_fallback_backward_of(opdef._setup_context_fn, opdef._backward_fn)
    opdef.register_autograd(backward, setup_context=setup_context)


def _record_redistribute() -> None:
    """Dynamo and DTensor.redistribute(mesh, placements) on a traced hypershard DTensor. Its mesh
    is no graph value, so Dynamo cannot record the call as it records a tensor method (torch 2.13:
    "Failed to convert args/kwargs to proxy"; 2.11 / 2.12's method_redistribute, made for torch
    DTensor, stopped with "UserDefinedObjectVariable(DeviceMesh) is not a constant"). As torch does
    for its own DTensor, the call is recorded as a function of the tensor alone, the mesh and the
    placements bound into it; when AOTAutograd runs that function, TracedDTensor.redistribute
    emits hypershard::redistribute_to. Forms it does not trace (alias notation, `partial=`) break
    the graph and run eagerly. Other tensors keep Dynamo's own handling. Installed once."""
    from torch._dynamo.exc import unimplemented
    from torch._dynamo.utils import proxy_args_kwargs
    from torch._dynamo.variables import UserDefinedObjectVariable
    from torch._dynamo.variables.builder import wrap_fx_proxy
    from torch._dynamo.variables.lists import BaseListVariable
    from torch._dynamo.variables.tensor import TensorVariable

    original = getattr(TensorVariable, "method_redistribute", None)
    if getattr(original, "hypershard_records", False):
        return

    def python_value(tx, variable):
        """The Python value of a constant argument: a list of placements (dataclasses, made in the
        traced code or not), a mesh (an object Dynamo does not know), a number or a string."""
        variable = variable.realize() if hasattr(variable, "realize") else variable
        if isinstance(variable, BaseListVariable):
            items = [python_value(tx, item) for item in variable.items]
            return (
                tuple(items) if isinstance(variable.python_type(), type) and variable.python_type() is tuple else items
            )
        value = getattr(variable, "value", None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = [f.name for f in dataclasses.fields(value) if f.init]
            return type(value)(**{name: python_value(tx, variable.var_getattr(tx, name)) for name in fields})
        if isinstance(variable, UserDefinedObjectVariable):
            return value
        return variable.as_python_constant()

    def method_redistribute(self, tx, *args, **kwargs):
        if not (isinstance(self.python_type(), type) and issubclass(self.python_type(), TracedDTensor)):
            return original(self, tx, *args, **kwargs) if original is not None else None
        try:
            values = [python_value(tx, a) for a in args]
            keywords = {k: python_value(tx, v) for k, v in kwargs.items()}
            traced = self.proxy.node.meta["example_value"]  # the fake TracedDTensor: its spec is real
            traceable = _traced_placements(traced, *values, **keywords) is not None
        except (NotImplementedError, TypeError):  # no constant value; not redistribute's arguments
            traceable = False
        if not traceable:
            unimplemented(
                gb_type="hypershard DTensor redistribute",
                context=f"redistribute({args}, {kwargs})",
                explanation="this form of hypershard's redistribute runs eagerly between compiled graphs",
                hints=["placement objects (Shard, Replicate, Partial) on the DTensor's own mesh are traced"],
            )

        def prim_redistribute(x):
            return x.redistribute(*values, **keywords)

        return wrap_fx_proxy(
            tx=tx, proxy=tx.output.create_proxy("call_function", prim_redistribute, *proxy_args_kwargs([self], {}))
        )

    method_redistribute.hypershard_records = True
    TensorVariable.method_redistribute = method_redistribute


def _prepare_tracing() -> None:
    """What a compiled call needs from torch and transformers before Dynamo traces it."""
    _record_redistribute()
    _route_grouped_mm_fallback_backward()  # every call: transformers may be imported later
