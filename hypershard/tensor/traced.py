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

import functools
import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree

from .. import _C
from .dtensor import _placements_of
from .layout import make_layout

__all__ = ["TracedDTensor", "to_traced", "from_traced"]


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

    # hypershard's DTensor methods (hypershard/tensor/dtensor.py) on the DTensor this one stands for, as
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
    input that eager hypershard's linear kernel would take through the batched product (a 3-D input
    with its dim 1 sharded -- a sequence under context parallelism -- and more than one row in dim 0)
    takes it here too: the rule and the product are that kernel's (csrc/ops/composites.cpp, through
    _C). torch's composite flattens (batch, sequence) into rows, which the traced view could only
    plan by gathering the sequence. Every other call: torch's own composite."""
    if isinstance(input, TracedDTensor) and _C.linear_keeps_sequence_shards(input._spec.layout, weight.dim()):
        return _C.linear_batched(input, weight, bias)
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
