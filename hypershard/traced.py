"""hypershard's local program compiled: `hypershard.compile` (docs/compile.md, "The local program").

torch.compile cannot trace a hypershard DTensor (a storage-less C++ TensorImpl). Inside a
`hypershard.compile`d call its DTensors are therefore seen as `TracedDTensor`s: a traceable
wrapper subclass (``__tensor_flatten__`` / ``__torch_dispatch__``, as torch DTensor is) around
the same local tensor, with the same layout and mesh. Dynamo and AOTAutograd trace through its
``__torch_dispatch__``, which runs hypershard's own C++ operator flow (`_C.traced_call`: the rule,
the redistribution, the local op, the output layout) on the traced locals; every collective it
needs is emitted as a functional collective (``_c10d_functional``), so the graph holds the whole
local program with its collectives, forward and backward, and inductor compiles it.

The rules are not re-implemented here: the subclass only moves a call into C++ and back. Its
Python runs while tracing; the compiled program runs no Python per op.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree

from . import _C
from .dtensor import _placements_of
from .layout import make_layout

__all__ = ["TracedDTensor", "compile", "to_traced", "from_traced"]


_LIVE_SPECS: dict = {}


@functools.lru_cache(maxsize=None)
def _build_identity() -> str:
    """This build of hypershard's traced path: its C++ library and this file. The traced program
    comes from code no Dynamo graph shows (the rules, the redistributions, the dispatch below), so
    torch's compile caches, keyed on that graph, must also see the build: a program compiled by
    another build is never reused."""
    digest = hashlib.sha256()
    for path in (_C.__file__, __file__):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


_LIVE_MESHES: dict = {}  # the process groups' names of a mesh -> the mesh (meshes live as long as their groups)


def _live_spec(key: tuple, recipe: tuple = ()) -> "_Spec":
    """The spec a pickled one names (a compile cache's entry). One this process has not made yet (an
    entry written by an earlier run: a backward's intermediate layout) is made again from its
    recipe on the live mesh of the same process groups and rank; without one, the KeyError makes
    the cache miss and the program is compiled anew."""
    spec = _LIVE_SPECS.get(key)
    if spec is None and recipe:
        mesh = _LIVE_MESHES.get(key[1])
        if mesh is not None and mesh.rank == key[2] and _build_identity() == key[3]:
            global_shape, dim_axes, partial = recipe
            spec = _Spec(_C.Layout.create(mesh.mesh, list(global_shape), dim_axes, partial), mesh)
    if spec is None or spec.key != key:
        raise KeyError(key)
    return spec


class _Spec:
    """What a traced DTensor carries besides its local: its layout and mesh (the flatten context
    Dynamo guards on, compared by value)."""

    __slots__ = ("layout", "mesh", "key")

    def __init__(self, layout: _C.Layout, mesh: _C.DeviceMesh):
        self.layout, self.mesh = layout, mesh
        # names it across processes (inductor's and AOTAutograd's caches pickle it): the layout,
        # the mesh's process groups (their names are unique) and this rank's place in the mesh --
        # the traced program is each rank's own (its chunk offsets are constants in the graph),
        # so two ranks must never share a cached program; nor two builds (_build_identity)
        self.key = (
            str(layout),
            tuple(mesh.group(a).group_name for a in range(len(layout.partial))),
            mesh.rank,
            _build_identity(),
        )
        _LIVE_SPECS.setdefault(self.key, self)
        _LIVE_MESHES.setdefault(self.key[1], mesh)

    def __reduce__(self):
        recipe = (tuple(self.layout.global_shape), self.layout.dim_axes, self.layout.partial)
        return _live_spec, (self.key, recipe)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Spec) and self.layout == other.layout and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"_Spec({self.layout})"

    def __deepcopy__(self, memo: dict) -> "_Spec":  # Dynamo's guards keep a copy; both parts are immutable
        return self


class TracedDTensor(torch.Tensor):
    """A hypershard DTensor as torch.compile traces it: global shape and strides outside, this
    rank's local tensor inside (see the module docstring)."""

    _local: torch.Tensor
    _spec: _Spec

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: _Spec, shape, strides, requires_grad: bool = False):
        out = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=strides, dtype=local.dtype, device=local.device, requires_grad=requires_grad
        )
        out._local, out._spec = local, spec
        return out

    def __repr__(self) -> str:
        return f"TracedDTensor(local={self._local!r}, layout={self._spec.layout})"

    def __tensor_flatten__(self):
        return ["_local"], self._spec

    def _stable_hash_for_caching(self) -> str:
        """AOTAutograd's cache key for this input, which torch asks traceable subclasses for (without
        it torch warns on every compile and hashes the flattened parts itself): the spec's
        cross-process key (layout, the mesh's process groups, this rank, this build) and the outer
        and local tensors' metadata. Values are not part of it, as for a plain tensor input."""
        local = self._local
        payload = (
            self._spec.key,
            tuple(self.shape),
            tuple(self.stride()),
            str(self.dtype),
            self.requires_grad,
            tuple(local.shape),
            tuple(local.stride()),
            str(local.device),
        )
        return hashlib.blake2b(repr(payload).encode(), digest_size=16).hexdigest()

    @staticmethod
    def __tensor_unflatten__(inner: dict, spec: _Spec, outer_size, outer_stride):
        return TracedDTensor(inner["_local"], spec, outer_size, outer_stride)

    def __coerce_tangent_metadata__(self):
        """The gradient AOTAutograd should expect for this output: its layout with Partial axes
        Replicate (the gradient of a sum of partial values is the same on every rank)."""
        return torch.ops.hypershard.redistribute_like(self, self)

    def __coerce_same_metadata_as_tangent__(self, expected: _Spec, expected_type=None):
        """A gradient that arrives at run time in another layout than the traced one, moved there."""
        if expected_type not in (None, TracedDTensor):
            return None
        if expected.layout == self._spec.layout:
            return self
        return _from_hypershard(_C.redistribute(_hypershard_of(self), expected.layout))

    # hypershard's DTensor methods (hypershard/dtensor.py) on the DTensor this one stands for, as
    # ops of the graph (hypershard::to_local / full_tensor / redistribute_to below: this rank's
    # local; the whole, and a redistribution, through functional collectives), differentiable as
    # eagerly. redistribute() to placement objects on the DTensor's own mesh is traced (Dynamo
    # records it through _record_redistribute); any other form (alias notation, `partial=`)
    # breaks the graph and runs eagerly. The layout properties are data.
    def to_local(self) -> torch.Tensor:
        return torch.ops.hypershard.to_local(self)

    def full_tensor(self) -> torch.Tensor:
        return torch.ops.hypershard.full_tensor(self)

    def redistribute(self, device_mesh: Any = None, placements: Any = None, **kwargs: Any) -> "TracedDTensor":
        names = _traced_placements(self, device_mesh, placements, **kwargs)
        if names is None:
            return self._redistribute_eagerly(device_mesh, placements, **kwargs)
        return torch.ops.hypershard.redistribute_to(self, names)

    @torch._disable_dynamo
    def _redistribute_eagerly(self, device_mesh: Any = None, placements: Any = None, **kwargs: Any):
        if is_fake(self._local):
            raise RuntimeError(
                "hypershard: this redistribute() inside a hypershard.compile'd function is not traced; "
                "allowed: placement objects on the DTensor's own mesh, or the call outside the "
                "compiled function"
            )
        return to_traced(from_traced(self).redistribute(device_mesh, placements, **kwargs))

    placements = property(lambda self: _placements_of(self._spec.layout))
    device_mesh = property(lambda self: self._spec.mesh)
    sharding = property(lambda self: self._spec.layout)

    @classmethod
    @torch._disable_dynamo  # runs eagerly when a graph break leaves an op to eager code (as torch DTensor's)
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        wrappers: dict = {}  # id of a hypershard DTensor made here -> the TracedDTensor it stands for

        def to_hypershard(t: TracedDTensor) -> torch.Tensor:
            dt = _hypershard_of(t)
            wrappers[id(dt)] = (t, dt)
            return dt

        args, kwargs = pytree.tree_map_only(TracedDTensor, to_hypershard, (args, kwargs))
        handler = _SPECIAL.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
        else:
            schema = func._schema
            out = _C.traced_call(schema.name, schema.overload_name, *args, **kwargs)

        def back(value: Any) -> Any:
            if not (isinstance(value, torch.Tensor) and _C.is_dtensor(value)):
                return value
            known = wrappers.get(id(value))
            if known is not None and known[1] is value:  # a written argument: the caller's tensor
                traced = known[0]
                traced._local, traced._spec = _C.local_of(value), _Spec(_C.layout_of(value), traced._spec.mesh)
                return traced
            return _from_hypershard(value)

        return pytree.tree_map(back, out)


def _traced_placements(traced: TracedDTensor, device_mesh: Any = None, placements: Any = None, **kwargs: Any):
    """The placements of `traced.redistribute(device_mesh, placements, **kwargs)` as
    make_layout's strings ("S(0)", "R", "P(sum)"), the graph's constant arguments, when the call
    is one the graph holds: placement objects (hypershard's or torch's) on the DTensor's own mesh.
    None for any other form (alias notation, `partial=`, another mesh): it runs eagerly."""
    own_mesh = device_mesh is None or getattr(device_mesh, "mesh", None) == traced._spec.layout.mesh
    if kwargs or not own_mesh or not isinstance(placements, (list, tuple)):
        return None
    names = []
    for p in placements:
        if not all(hasattr(p, name) for name in ("is_shard", "is_partial")):
            return None
        if p.is_shard():
            names.append(f"S({p.dim})")
        elif p.is_partial():
            names.append(f"P({p.reduce_op})")
        else:
            names.append("R")
    return names


def _hypershard_of(t: TracedDTensor) -> torch.Tensor:
    """A hypershard DTensor around `t`'s local (the same memory; not differentiable)."""
    return _C.wrap_local(t._local, t._spec.mesh, t._spec.layout, list(t.stride()), t.storage_offset())


def _without_partial(layout: _C.Layout) -> _C.Layout:
    return _C.Layout.create(layout.mesh, layout.global_shape, layout.dim_axes, [None] * len(layout.partial))


def _from_hypershard(dt: torch.Tensor, requires_grad: bool = False) -> TracedDTensor:
    return TracedDTensor(
        _C.local_of(dt), _Spec(_C.layout_of(dt), _C.device_mesh_of(dt)), dt.shape, dt.stride(), requires_grad
    )


# ------------------------------------------------------------------------- traced redistribution
# parallelize's hooks make a module's input or output Replicate on an axis; in a traced program
# they call this op, which Dynamo records like any other (its layout arithmetic runs in
# __torch_dispatch__, which Dynamo does not trace).

_LIB = torch.library.Library("hypershard", "FRAGMENT")  # noqa: TOR901 -- an op namespace of our own
_LIB.define("replicate_on(Tensor self, int axis) -> Tensor")
_LIB.define("redistribute_like(Tensor grad, Tensor like) -> Tensor")
# DTensor.to_local() / full_tensor() in a traced program, and their gradients: a local as a DTensor
# laid out like `like`, and a whole (Replicate) tensor cut to `like`'s layout (Partial axes
# Replicate, as redistribute_like)
_LIB.define("to_local(Tensor self) -> Tensor")
_LIB.define("full_tensor(Tensor self) -> Tensor")
_LIB.define("local_as_like(Tensor local, Tensor like) -> Tensor")
_LIB.define("whole_as_like(Tensor whole, Tensor like) -> Tensor")
# DTensor.redistribute(mesh, placements) in a traced program (make_layout's placement strings);
# its gradient is redistribute_like's
_LIB.define("redistribute_to(Tensor self, str[] placements) -> Tensor")
_TRACED_OPS = (
    "replicate_on",
    "redistribute_like",
    "to_local",
    "full_tensor",
    "local_as_like",
    "whole_as_like",
    "redistribute_to",
)


def _refuse_plain(*args, **kwargs):
    raise RuntimeError(f"hypershard: {', '.join(_TRACED_OPS)} take a traced hypershard DTensor")


for _name in _TRACED_OPS:
    _LIB.impl(_name, _refuse_plain, "CompositeExplicitAutograd")


def _replicate_on(dt: torch.Tensor, axis: int) -> torch.Tensor:
    return _C.traced_redistribute(dt, _C.layout_of(dt).without_axis(axis))


def _redistribute_like(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`grad` in `like`'s layout with its Partial axes Replicate: the gradient of a redistribution."""
    return _C.traced_redistribute(grad, _without_partial(_C.layout_of(like)))


def _as_replicate(whole: torch.Tensor, mesh: _C.DeviceMesh) -> torch.Tensor:
    """A plain tensor (the same on every rank) as a Replicate DTensor of `mesh`, as hypershard
    takes plain operands (an alias, no communication)."""
    return _C.from_local(whole.contiguous(), mesh, _C.Layout.replicate(mesh.mesh, list(whole.shape)))


def _to_local(dt: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.alias(_C.local_of(dt))  # a view of this rank's local, as eagerly


def _full_tensor(dt: torch.Tensor) -> torch.Tensor:
    layout = _C.layout_of(dt)
    return _C.local_of(_C.traced_redistribute(dt, _C.Layout.replicate(layout.mesh, layout.global_shape)))


def _local_as_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """to_local's gradient: this rank's local gradient in `like`'s layout, Partial axes Replicate
    (as hypershard's eager to_local)."""
    return _C.from_local(local, _C.device_mesh_of(like), _without_partial(_C.layout_of(like)))


def _whole_as_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """full_tensor's gradient: the whole gradient (every rank's the same) cut to `like`'s layout,
    Partial axes Replicate (a local chunk, no communication), as eagerly."""
    return _C.traced_redistribute(_as_replicate(whole, _C.device_mesh_of(like)), _without_partial(_C.layout_of(like)))


def _redistribute_to(dt: torch.Tensor, names: list) -> torch.Tensor:
    layout = _C.layout_of(dt)
    return _C.traced_redistribute(dt, make_layout(layout.mesh, layout.global_shape, list(names)))


def _view_keeping_shards(op_name: str) -> Callable:
    """aten::view / _unsafe_view in a traced program, planned as reshape: eagerly, hypershard's
    reshape kernel (at the DTensor's autograd key) redistributes a tensor whose view would cut a
    shard, then views it; a traced DTensor reaches its __torch_dispatch__ after torch's composite
    reshape already chose the view, so the redistribution happens here. A compiled program is
    functional (AOTAutograd functionalizes it, writes through views included), so a view of the
    redistributed tensor aliases nothing anyone observes; run for real (Dynamo's eager backend,
    code between graphs) it is a copy, as hypershard's default mode makes of such a view. Without
    it, strict mode refused in the compiled program what eager ran (matmul's flattening of
    sharded heads, DeepSeek-V3.2 tp2)."""

    def view(dt: torch.Tensor, size: Any) -> torch.Tensor:
        layout = _C.layout_of(dt)
        source = _C.view_source_layout(layout, [int(s) for s in size])
        if source != layout:
            dt = _C.traced_redistribute(dt, source)
        return _C.traced_call(op_name, "", dt, size)

    return view


_SPECIAL = {
    torch.ops.aten.view.default: _view_keeping_shards("aten::view"),
    torch.ops.aten._unsafe_view.default: _view_keeping_shards("aten::_unsafe_view"),
    torch.ops.hypershard.replicate_on.default: _replicate_on,
    torch.ops.hypershard.redistribute_like.default: _redistribute_like,
    torch.ops.hypershard.to_local.default: _to_local,
    torch.ops.hypershard.full_tensor.default: _full_tensor,
    torch.ops.hypershard.local_as_like.default: _local_as_like,
    torch.ops.hypershard.whole_as_like.default: _whole_as_like,
    torch.ops.hypershard.redistribute_to.default: _redistribute_to,
}


@torch.ops.aten.linear.default.py_impl(torch._C.DispatchKey.CompositeImplicitAutograd)
def _linear_keeping_sequence_shards(input: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> torch.Tensor:
    """aten::linear while torch traces (its Python dispatcher; eager calls never come here). A traced
    3-D input with its dim 1 sharded (a sequence under context parallelism) and more than one row in
    dim 0 takes the batched product eager hypershard's linear kernel takes (csrc/ops/composites.cpp):
    torch's composite flattens (batch, sequence) into rows, which the traced view could only plan by
    gathering the sequence. Every other call: torch's own composite."""
    if (
        isinstance(input, TracedDTensor)
        and input.dim() == 3
        and weight.dim() == 2
        and input.shape[0] > 1
        and input._spec.layout.dim_axes[1]
    ):
        out = torch.bmm(input, weight.t().unsqueeze(0).expand(input.shape[0], weight.shape[1], weight.shape[0]))
        return out if bias is None else out + bias
    # torch's C++ composite itself (OpOverload.decompose would call this kernel again)
    return torch.ops.aten.linear.default._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, input, weight, bias)


def _replicate_on_backward(ctx, grad):
    return torch.ops.hypershard.redistribute_like(grad, ctx.saved_tensors[0]), None


def _save_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


torch.library.register_autograd("hypershard::replicate_on", _replicate_on_backward, setup_context=_save_input, lib=_LIB)

torch.library.register_autograd(
    "hypershard::to_local",
    lambda ctx, grad: torch.ops.hypershard.local_as_like(grad, ctx.saved_tensors[0]),
    setup_context=_save_input,
    lib=_LIB,
)
torch.library.register_autograd(
    "hypershard::redistribute_to",
    lambda ctx, grad: (torch.ops.hypershard.redistribute_like(grad, ctx.saved_tensors[0]), None),
    setup_context=_save_input,
    lib=_LIB,
)
torch.library.register_autograd(
    "hypershard::full_tensor",
    lambda ctx, grad: torch.ops.hypershard.whole_as_like(grad, ctx.saved_tensors[0]),
    setup_context=_save_input,
    lib=_LIB,
)


# ------------------------------------------------------------------- eager <-> traced boundaries


class _ToTraced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt):
        return _from_hypershard(dt)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, TracedDTensor):
            return _hypershard_of(grad)
        if grad is not None and not grad.any():
            # AOTAutograd's plain zeros for a DTensor input its graph gives no gradient (DeepSeek-V3.2's
            # indexer only feeds a top-k's indices): no gradient, as eagerly. A zero .grad would differ
            # (AdamW decays a parameter that has one) and a fully_shard group cannot reduce a plain one.
            return None
        return grad


class _FromTraced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, traced):
        ctx.layout = _without_partial(traced._spec.layout)  # the gradient the traced backward expects
        ctx.mesh = traced._spec.mesh
        return _hypershard_of(traced)

    @staticmethod
    def backward(ctx, grad):
        if not _C.is_dtensor(grad):  # an output the loss did not use: autograd's zeros
            local = grad.new_zeros(ctx.layout.local_shape_at(ctx.mesh.position))
            grad = _C.wrap_local(local, ctx.mesh, ctx.layout, list(grad.stride()), 0)
        elif _C.layout_of(grad) != ctx.layout:
            grad = _C.redistribute(grad, ctx.layout)
        return _from_hypershard(grad)


def _plain_tangent_as_traced(self: torch.Tensor, expected: Any, expected_type: Any = None):
    """AOTAutograd's hook for a gradient whose type differs from the traced one: autograd hands a
    compiled output that the loss did not use (HF's logits) a plain zeros tensor. A plain tensor
    is taken as Replicate, as hypershard takes plain operands, and cut to the expected layout
    (a local chunk, no communication). Other expected types keep torch's error (None)."""
    if expected_type is not TracedDTensor or not isinstance(expected, _Spec):
        return None
    return _from_hypershard(_C.redistribute(_as_replicate(self, expected.mesh), expected.layout))


# torch.Tensor has no such hook; this one answers only for TracedDTensor tangents.
torch.Tensor.__coerce_same_metadata_as_tangent__ = _plain_tangent_as_traced


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


def to_traced(value: Any) -> Any:
    """A hypershard DTensor as a TracedDTensor (differentiable; the same local memory)."""
    if isinstance(value, torch.Tensor) and _C.is_dtensor(value):
        if value.requires_grad and value.is_leaf:
            _C.install_grad_hook(value)  # as its first use in an op would (gradient layout, grad sync)
        return _ToTraced.apply(value)
    return value


def from_traced(value: Any) -> Any:
    """A TracedDTensor back as a hypershard DTensor (differentiable)."""
    return _FromTraced.apply(value) if isinstance(value, TracedDTensor) else value


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
    from .fully_shard import _groups  # (fully_shard imports this module)

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
