"""The gated delta net (linear attention: Qwen3.5, Qwen3-Next, ...) on a sequence sharded over a
context-parallel axis (docs/context_parallel.md, "The gated delta net").

The gated delta rule is a recurrence over the sequence: a state S [k_head_dim, v_head_dim] per
(batch, head) is decayed and corrected token by token, and each output reads the state. Within a
rank's block of the sequence transformers' chunked function computes it exactly given the state
the block starts from, so the ranks of the axis form a chain: rank r waits for rank r-1's final
state, runs the function on its LOCAL block with it as ``initial_state`` and sends its own final
state to rank r+1. Backward runs the chain the other way: rank r receives the gradient of the state
it sent from rank r+1 and sends the gradient of the state it received to rank r-1.

Deadlock-freedom: a rank's block is ONE autograd node (_ChainedBlock) whose forward receives and
then sends and whose backward receives and then sends, so every receive a neighbour posts is
answered (with zeros where the local result ignored the state), and every rank builds the same
nodes in the same order (rank 0 receives nothing and the last rank sends nothing, but both have
the node): every rank's backward runs the same sequence of collectives and waits. A rank waits only
for a LOWER rank in forward and a HIGHER rank in backward, and sends before it enters anything
that waits on others again, so the waits form a chain, never a cycle. Every wait uses the
process group's timeout (the launch's ``pg_timeout``) and fails naming this rank, the peer and
what it waited for. Inside a checkpointed module (hs.recompute) the recomputation runs the chain
again in forward order on every rank, and the node rebuilds its local graph in backward instead of
keeping it (_ChainedBlock's docstring says why).

The sequence must be in natural order (rank r holds the r-th block): ``parallelize`` does not
declare a load-balanced (head-tail) axis for a model with these layers (see the docs for why).
"""

from __future__ import annotations

import inspect
import types
from typing import Callable, Optional

import torch
from torch import nn

from .. import _C

__all__ = [
    "context_parallel_chunk_gated_delta_rule",
    "install_context_parallel_linear_attention",
    "route_gated_delta_rule",
    "reset_traffic",
    "traffic",
]

# The module-level function transformers' gated delta net forwards call (transformers 5.x); older
# versions keep it on the instance as ``chunk_gated_delta_rule``.
_FUNCTION_NAME = "torch_chunk_gated_delta_rule"
_INSTANCE_ATTRIBUTE = "chunk_gated_delta_rule"
# Point-to-point tags: the state goes up the chain in forward, its gradient down in backward.
_STATE_TAG = 5301
_STATE_GRAD_TAG = 5302


# What this rank's state chain sent (point-to-point, outside hypershard._C.traffic's collectives).
_TRAFFIC = {"messages": 0, "bytes_sent": 0}


def traffic() -> dict:
    """The messages and bytes this rank's gated delta rules sent since reset_traffic()."""
    return dict(_TRAFFIC)


def reset_traffic() -> None:
    _TRAFFIC.update(messages=0, bytes_sent=0)


def _fail(why: str):
    raise ValueError(f"hypershard: chunk_gated_delta_rule under context parallelism: {why}")


class _Chain:
    """This rank's place in the chain of one call: its neighbours on the cp axis' group."""

    def __init__(self, mesh, axis: int, state_shape: tuple, dtype: torch.dtype, device: torch.device):
        self.group = mesh.group(axis)
        self.position = mesh.coordinate(axis)
        self.size = mesh.shape[axis]
        self.state_shape = state_shape
        self.dtype = dtype
        self.device = device

    @property
    def first(self) -> bool:
        return self.position == 0

    @property
    def last(self) -> bool:
        return self.position == self.size - 1

    def _wait(self, work, what: str, peer: int) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            raise RuntimeError(
                f"hypershard: chunk_gated_delta_rule under context parallelism: cp rank {self.position} "
                f"{what} cp rank {peer} failed (a rank that never reached this layer, or one that "
                f"failed in it, times out the chain): {error}"
            ) from error

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> None:
        tensor = tensor.detach().contiguous()
        self._wait(self.group.send([tensor], peer, tag), f"sending {what} to", peer)
        _TRAFFIC["messages"] += 1
        _TRAFFIC["bytes_sent"] += tensor.numel() * tensor.element_size()

    def receive(self, peer: int, tag: int, what: str) -> torch.Tensor:
        buffer = torch.empty(self.state_shape, dtype=self.dtype, device=self.device)
        self._wait(self.group.recv([buffer], peer, tag), f"receiving {what} from", peer)
        return buffer


def _saved_tensors_hooks_active() -> bool:
    """Whether saved-tensor hooks are installed on this thread: torch.utils.checkpoint's (hs.recompute,
    in forward and in its recomputation), save_on_cpu, ... (torch has no public query; without
    the private one, answer yes: the block is then rebuilt in backward, correct either way)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(True) is not None


class _ChainedBlock(torch.autograd.Function):
    """This rank's block of the recurrence, one autograd node: forward receives the state its
    block starts from (rank r-1's final state; rank 0: the caller's initial state or zeros), runs
    `run` on the local block from it and sends the block's final state to rank r+1. Backward
    receives the gradient of that final state from rank r+1, back-propagates through the local
    block and sends the gradient of the received state to rank r-1.

    One node, so its backward always does both: a rank whose local result ignored the received
    state (or made no use of a gradient) still answers its neighbours, with zeros, instead of
    leaving them waiting. The local graph is built inside forward and differentiated inside
    backward (as checkpointing does, without recomputing).

    Under saved-tensor hooks (a checkpointed module: hs.recompute) the node keeps no local graph:
    that graph's saved tensors would go through the checkpoint's hooks, and differentiating it in
    backward (torch.autograd.grad, a graph task of its own) would make the checkpoint recompute
    the whole module a second time there, with its collectives and this chain's messages, while
    the neighbour waits in this node's receive (both ranks stuck). The node then saves its block's
    inputs and the received state (through the hooks: recomputed like everything else) and
    rebuilds the local graph in backward, with no message, from them."""

    @staticmethod
    def forward(ctx, chain, run, build_graph, initial, *block):
        if not chain.first:
            state = chain.receive(chain.position - 1, _STATE_TAG, "the recurrent state")
        elif initial is not None:
            state = initial.detach().to(chain.dtype, copy=True)
        else:
            state = torch.zeros(chain.state_shape, dtype=chain.dtype, device=chain.device)
        keep_graph = build_graph and not _saved_tensors_hooks_active()
        with torch.set_grad_enabled(keep_graph):
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in block]
            state.requires_grad_(keep_graph)
            output, final_state = run(*leaves, initial_state=state)
        if not chain.last:
            chain.send(final_state, chain.position + 1, _STATE_TAG, "the recurrent state")
        ctx.chain, ctx.has_initial, ctx.run = chain, initial is not None, run
        ctx.graph = (output, final_state, leaves, state) if keep_graph else None
        ctx.rebuild = build_graph and not keep_graph
        if ctx.rebuild:
            ctx.block_requires_grad = [t.requires_grad for t in block]
            ctx.save_for_backward(*block, state.detach())
        return output.detach(), final_state.detach()

    @staticmethod
    def _local_graph(ctx) -> tuple:
        """(output, final_state, leaves, state): the graph forward kept, or the one rebuilt here
        from the saved inputs and state (same ops on the same values: the same results)."""
        if ctx.graph is not None:
            graph, ctx.graph = ctx.graph, None  # the local graph is freed once differentiated
            return graph
        if not ctx.rebuild:
            raise RuntimeError(
                "hypershard: chunk_gated_delta_rule under context parallelism: its backward ran twice "
                "(retain_graph); allowed: one backward per forward"
            )
        ctx.rebuild = False
        *block, state = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(wanted) for t, wanted in zip(block, ctx.block_requires_grad)]
            state = state.detach().requires_grad_(True)
            output, final_state = ctx.run(*leaves, initial_state=state)
        return output, final_state, leaves, state

    @staticmethod
    def backward(ctx, grad_output, grad_final_state):
        chain = ctx.chain
        output, final_state, leaves, state = _ChainedBlock._local_graph(ctx)
        if not chain.last:
            grad_final_state = grad_final_state + chain.receive(
                chain.position + 1, _STATE_GRAD_TAG, "the state's gradient"
            )
        wanted = [t for t in leaves if t.requires_grad] + [state]
        with torch.enable_grad():
            grads = torch.autograd.grad(
                [output, final_state], wanted, [grad_output, grad_final_state], allow_unused=True
            )
        grad_state = grads[-1] if grads[-1] is not None else torch.zeros_like(state)
        if not chain.first:
            chain.send(grad_state, chain.position - 1, _STATE_GRAD_TAG, "the state's gradient")
        by_leaf = iter(grads[:-1])
        block_grads = [next(by_leaf) if t.requires_grad else None for t in leaves]
        grad_initial = grad_state if chain.first and ctx.has_initial else None
        return None, None, None, grad_initial, *block_grads


class _LastRankOnly(torch.autograd.Function):
    """The last rank's final state, zeros on the others: summed over the axis it is the
    sequence's final state. A node on every rank, so the result requires grad on every rank."""

    @staticmethod
    def forward(ctx, final_state, chain):
        ctx.last = chain.last
        return final_state.clone() if chain.last else torch.zeros_like(final_state)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.last else None), None


class _FirstRankLocal(torch.autograd.Function):
    """The caller's initial state (Replicate on the cp axis) as this rank's local tensor. Only
    cp rank 0 reads it, so its gradient is Partial(sum) over the axis: rank 0's part, zeros
    elsewhere (to_local would claim every rank's part is the whole, Replicate)."""

    @staticmethod
    def forward(ctx, state, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        ctx.layout = _C.layout_of(state)
        return _C.local_of(state).detach()

    @staticmethod
    def backward(ctx, grad_local):
        if ctx.mesh.coordinate(ctx.axis) != 0:
            grad_local = torch.zeros_like(grad_local)
        layout = ctx.layout.with_partial(ctx.axis, _C.ReduceOp.Sum)
        return _C.from_local(grad_local.contiguous(), ctx.mesh, layout), None, None


def _sequence_layouts(tensors: dict, axis: int) -> tuple:
    """The one layout of (batch, sequence, heads) every input shares; checks the rest. Every
    check reads only global metadata, so every rank raises the same error before any message."""
    layouts = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not _C.is_dtensor(t):
            _fail(
                f"{name} is a {type(t).__name__}, not a DTensor; allowed: query, key, value, g and beta "
                f"all DTensors on the context-parallel mesh"
            )
        layouts[name] = _C.layout_of(t)
    mesh = layouts["query"].mesh
    for name, layout in layouts.items():
        if layout.mesh != mesh:
            _fail(f"{name} is on another mesh than query; allowed: every input on one mesh")
        if layout.has_partial():
            _fail(f"{name} is Partial ({layout}); allowed: inputs reduced before the recurrence")
    shared = [list(a) for a in layouts["query"].dim_axes[:3]]
    for name, layout in layouts.items():
        if [list(a) for a in layout.dim_axes[:3]] != shared:
            _fail(
                f"{name} is laid out {layout}, query {layouts['query']}; allowed: the batch, sequence and "
                f"head dims (0, 1, 2) sharded alike in every input"
            )
        if layout.ndim == 4 and layout.dim_axes[3]:
            _fail(f"{name}'s head dim (3) is sharded ({layout}); allowed: whole head dims")
    if shared[1] not in ([], [axis]):
        _fail(
            f"the sequence dim (1) is sharded over mesh axes {shared[1]} ({layouts['query']}); allowed: "
            f"only the context-parallel axis {axis}"
        )
    return layouts


def _state_layout(query_layout, mesh, state_shape: list):
    """The layout of a state [batch, heads, k_head_dim, v_head_dim]: batch and heads sharded like
    the query's dims 0 and 2, Replicate on the sequence's axis."""
    axes = query_layout.dim_axes
    return _C.Layout.create(mesh, state_shape, [list(axes[0]), list(axes[2]), [], []], [None] * mesh.ndim)


def context_parallel_chunk_gated_delta_rule(original: Callable, mesh, axis: int) -> Callable:
    """`original` (transformers' chunked gated delta rule, same signature) for DTensor inputs whose
    sequence dim (1) is sharded over mesh axis `axis` in natural order: each rank runs `original`
    on its local block, the recurrent state passed rank to rank (module docstring). Plain tensors
    go to `original` unchanged."""

    def chunk_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        chunk_size: int = 64,
        initial_state: Optional[torch.Tensor] = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs,
    ):
        inputs = dict(query=query, key=key, value=value, g=g, beta=beta)
        if not any(isinstance(t, torch.Tensor) and _C.is_dtensor(t) for t in inputs.values()):
            return original(
                query,
                key,
                value,
                g,
                beta,
                chunk_size=chunk_size,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **kwargs,
            )
        layouts = _sequence_layouts(inputs, axis)
        if layouts["query"].mesh != mesh.mesh:
            _fail("the inputs are on another mesh than the one parallelize installed this function for")
        batch, _, heads, k_head_dim = layouts["key"].global_shape
        v_head_dim = layouts["value"].global_shape[3]
        state_shape = [batch, heads, k_head_dim, v_head_dim]
        state_layout = _state_layout(layouts["query"], mesh.mesh, state_shape)
        if initial_state is not None:
            if not _C.is_dtensor(initial_state) or _C.layout_of(initial_state) != state_layout:
                _fail(
                    f"initial_state must be a DTensor laid out {state_layout} (batch and heads like the "
                    f"query, Replicate on the context-parallel axis); got "
                    f"{_C.layout_of(initial_state) if _C.is_dtensor(initial_state) else type(initial_state).__name__}"
                )
        locals_ = {name: _C.to_local(t) for name, t in inputs.items()}
        local_state_shape = tuple(state_layout.local_shape_at(mesh.position))
        chain = _Chain(mesh, axis, local_state_shape, torch.float32, locals_["value"].device)
        initial_local = None if initial_state is None else _FirstRankLocal.apply(initial_state, mesh, axis)
        build_graph = torch.is_grad_enabled() and any(
            t.requires_grad for t in [*locals_.values(), *([initial_local] if initial_local is not None else [])]
        )

        def run(q, k, v, g_, beta_, initial_state):
            return original(
                q,
                k,
                v,
                g_,
                beta_,
                chunk_size=chunk_size,
                initial_state=initial_state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **kwargs,
            )

        block = [locals_[name] for name in ("query", "key", "value", "g", "beta")]
        output, final_state = _ChainedBlock.apply(chain, run, build_graph, initial_local, *block)
        output = _C.from_local(output, mesh, layouts["value"])
        if not output_final_state:
            return output, None
        # The sequence's final state is the last rank's: summed over the axis from zeros elsewhere.
        mine = _LastRankOnly.apply(final_state, chain)
        summed = _C.from_local(mine, mesh, state_layout.with_partial(axis, _C.ReduceOp.Sum))
        return output, _C.redistribute(summed, state_layout)

    chunk_gated_delta_rule.__wrapped__ = original
    return chunk_gated_delta_rule


def is_gated_delta_net(module: nn.Module) -> bool:
    """A gated delta net (linear attention) of transformers: Qwen3.5, Qwen3-Next."""
    return type(module).__name__.endswith("GatedDeltaNet")


def _forward_with(module: nn.Module, name: str, function: Callable):
    """`module`'s class forward with the global `name` bound to `function` for this instance only
    (the class, the modeling module and other instances keep transformers' function). The forward
    sees a copy of its module's globals taken now: a later rebinding of another name in the
    modeling module (a hub kernel swapped in) does not reach this instance."""
    forward = inspect.unwrap(type(module).forward)
    namespace = dict(forward.__globals__)
    namespace[name] = function
    rebound = types.FunctionType(
        forward.__code__, namespace, forward.__name__, forward.__defaults__, forward.__closure__
    )
    rebound.__kwdefaults__ = forward.__kwdefaults__
    return types.MethodType(rebound, module)


def _replace_rule(model: nn.Module, make: Callable[[Callable], Callable], caller: str, purpose: str) -> int:
    """Replaces every gated delta net's chunk function by make(its function): the instance attribute
    where transformers keeps one, else the module-level function its forward calls, rebound for that
    instance only. Returns how many it changed; raises for a gated delta net whose forward calls
    neither (another transformers version)."""
    count = 0
    for name, module in model.named_modules():
        if not is_gated_delta_net(module):
            continue
        own = getattr(module, _INSTANCE_ATTRIBUTE, None)
        if callable(own) and not isinstance(own, nn.Module):
            setattr(module, _INSTANCE_ATTRIBUTE, make(own))
        else:
            forward = inspect.unwrap(type(module).forward)
            if _FUNCTION_NAME not in forward.__code__.co_names or _FUNCTION_NAME not in forward.__globals__:
                raise ValueError(
                    f"hypershard: {caller}: module {name!r} ({type(module).__name__}) is a gated delta net "
                    f"whose forward calls neither self.{_INSTANCE_ATTRIBUTE} nor {_FUNCTION_NAME}; its "
                    f"recurrence cannot be {purpose} (unsupported transformers version)"
                )
            module.forward = _forward_with(module, _FUNCTION_NAME, make(forward.__globals__[_FUNCTION_NAME]))
        module._hs_gated_delta_rule = caller  # who replaced it
        count += 1
    return count


def install_context_parallel_linear_attention(model: nn.Module, mesh, axis: int) -> int:
    """Makes every gated delta net of `model` run its chunked recurrence on a sequence sharded over
    mesh axis `axis` (context_parallel_chunk_gated_delta_rule); returns how many it changed."""
    return _replace_rule(
        model,
        lambda original: context_parallel_chunk_gated_delta_rule(original, mesh, axis),
        "parallelize",
        "run on a context-parallel sequence",
    )


# What each tensor of the gated delta rule is laid out on inside a routed region, per mesh axis:
# (dim over dp, dim over tp). q, k, v and the output are [batch, seq, heads, dim], g and beta
# [batch, seq, heads], the state [batch, heads, k_dim, v_dim]; every other axis (cp: the
# recurrence runs over the whole sequence) whole.
_REGION_DIMS = {"qkv": (0, 2), "gate": (0, 2), "state": (0, 1)}


def _region_spec(mesh, kind: str) -> list:
    from ..tensor.placement_types import Replicate, Shard

    dp, tp = _REGION_DIMS[kind]
    return [Shard(dp) if n == "dp" else Shard(tp) if n == "tp" else Replicate() for n in mesh.mesh_dim_names]


def route_gated_delta_rule(model: nn.Module, mesh, kernel: Optional[Callable] = None) -> int:
    """Runs every gated delta net's chunked rule of `model` (parallelized on `mesh`) as a
    hypershard.tensor.local_map region around `kernel` -- flash-linear-attention's chunk_gated_delta_rule on a
    GPU, or any function with transformers' signature; default transformers' own -- on this rank's
    shards: the batch over dp, the heads over tp, the sequence whole (on cp it is gathered for the
    region: the kernel runs the recurrence over the whole sequence, trading the state chain's
    point-to-point messages for an all-gather). The output returns to the layout the query came in.
    Returns how many modules it routed. docs/extending.md."""
    from ..tensor.local_map import local_map

    qkv, gate, state = (_region_spec(mesh, k) for k in ("qkv", "gate", "state"))

    def make(original: Callable) -> Callable:
        region = local_map(
            kernel or original,
            out_placements=(qkv, state),
            in_placements={
                0: qkv,
                1: qkv,
                2: qkv,
                "query": qkv,
                "key": qkv,
                "value": qkv,
                "g": gate,
                "beta": gate,
                "initial_state": state,
            },
            device_mesh=mesh,
            name="gated_delta_rule",
        )

        def routed(query, key, value, *args, **kwargs):
            out, final_state = region(query, key, value, *args, **kwargs)
            if _C.is_dtensor(query):
                placements = [p for p in query.placements]
                out = out.redistribute(mesh, placements)
            return out, final_state

        routed.__wrapped__ = original
        return routed

    return _replace_rule(model, make, "route_gated_delta_rule", "routed through a region")
