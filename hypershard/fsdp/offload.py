"""CPU offload of the optimizer state: ``hs.offload_optimizer``.

    model = ...                                   # parallelize / fully_shard / HSDP as usual
    optimizer = hs.offload_optimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
    loss.backward(); clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step(); optimizer.zero_grad()

The optimizer's state (AdamW: exp_avg and exp_avg_sq, 8 bytes per fp32 parameter element) and
an fp32 copy of every parameter's LOCAL shard (the master the step updates, 4 bytes) live in host
memory; the step runs on the CPU there. Per step and rank, for N local parameter elements of
the parameters' dtype (b bytes each, b = 4 for fp32):

- device -> host: the local gradients, N * b bytes (into pinned buffers on a GPU/NPU);
- host -> device: the updated local parameters, N * b bytes.

Nothing else moves: the state never leaves the host. With fully_shard, N is the rank's shards
(1/dp of the model, or 1/(dp * tp) with tensor parallelism), so the transfer is 2 * N * b bytes
per step, e.g. 2 * 4 * 0.8e9 / 4 = 1.6 GB per rank per step for a 0.8B model on fully_shard dp4.
The device keeps the parameters and gradients (their shards); it no longer holds the optimizer
state (2/3 of the 16 bytes per parameter of fp32 AdamW training with fp32 gradients: params 4,
grads 4, state 8).

The step on the host is the same torch optimizer on the same values, so the parameters equal
those of the optimizer run on the device elementwise (same single-tensor kernel, same order)
where the device is the CPU; on an accelerator the CPU's AdamW may round differently from the
device's kernels by the float32 unit roundoff per step.

On a CPU-only machine the "device" is the host: the copies are host memcpys, and the offload's
result equals the plain optimizer bit for bit (tests/python/level1/test_recompute.py).

Gradient clipping, gradient accumulation and anything else that reads ``param.grad`` work
before ``step()`` as usual (they see the device gradients). Learning-rate schedulers work: this
is a ``torch.optim.Optimizer`` whose ``param_groups`` are the host optimizer's.

``state_dict()`` has the form the same optimizer on the model's parameters would give: a state
tensor of its parameter's shape (AdamW's exp_avg, exp_avg_sq) is a DTensor in that parameter's
layout whose local shard IS the host tensor (no copy), and "step" is as torch keeps it. So
``hypershard.checkpoint`` saves it like the device optimizer's state: DCP entries keyed by
parameter name, each rank writing only its shards from host memory, and a load reads into the
host tensors in place. A checkpoint saved with offload resumes without it and the reverse, on any
mesh (docs/checkpoint.md). ``load_state_dict`` takes that form (or the device optimizer's, in the
parameters' layouts) and then re-reads the host masters from the parameters, which a checkpoint
load restored first: the masters stand for the parameters and must hold their values, not those
of the model the optimizer was built on.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from .. import _C

__all__ = ["OffloadedOptimizer", "offload_optimizer"]


def _error(message: str) -> ValueError:
    return ValueError(f"hypershard: offload_optimizer: {message}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return _C.local_of(t) if _C.is_dtensor(t) else t


class OffloadedOptimizer(torch.optim.Optimizer):
    """`optimizer_cls` stepping host copies of the parameters' local shards; see the module
    docstring. Made by ``offload_optimizer``."""

    def __init__(self, params: Iterable, optimizer_cls: type, pin_memory: Optional[bool] = None, **kwargs: Any):
        groups = list(params)
        if not groups:
            raise _error("no parameters to optimize")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._pairs: list = []  # (device parameter, host master), in param_groups' order
        self._parameter_of: dict = {}  # id(host master) -> device parameter
        host_groups = []
        for group in groups:
            host = []
            for p in group["params"]:
                if not isinstance(p, torch.Tensor) or not p.is_leaf:
                    raise _error(f"{type(p).__name__} is not a leaf tensor; allowed: the model's parameters")
                if not p.dtype.is_floating_point:
                    raise _error(f"a parameter of dtype {p.dtype}; allowed: floating parameters")
                local = _local(p.detach())
                pin = local.device.type != "cpu" if pin_memory is None else pin_memory
                master = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
                master.copy_(local)
                master.requires_grad_(p.requires_grad)
                self._pairs.append((p, master))
                self._parameter_of[id(master)] = p
                host.append(master)
            host_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": host})
        self.inner = optimizer_cls(host_groups, **kwargs)
        super().__init__([m for _, m in self._pairs], dict(self.inner.defaults))
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise _error("a closure (the loss would be computed on the device); allowed: step() without one")
        for p, master in self._pairs:
            if p.grad is None:
                master.grad = None
                continue
            g = _local(p.grad)
            if master.grad is None:
                master.grad = torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=master.is_pinned())
            master.grad.copy_(g, non_blocking=True)
            self.bytes_to_host += g.numel() * g.element_size()
        if any(p.grad is not None and p.grad.device.type != "cpu" for p, _ in self._pairs):
            torch.accelerator.synchronize()
        self.inner.step()
        for p, master in self._pairs:
            if master.grad is None:
                continue
            local = _local(p)
            local.copy_(master, non_blocking=True)
            self.bytes_to_device += master.numel() * master.element_size()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, master in self._pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    def parameter_of(self, master: torch.Tensor) -> torch.Tensor:
        """The model parameter that the host tensor `master` (one of ``param_groups``' params) stands
        for: hypershard.checkpoint names the optimizer's state by the model's names through it."""
        return self._parameter_of[id(master)]

    def state_dict(self) -> dict:
        """The host optimizer's state_dict with each parameter-shaped state tensor viewed as a DTensor
        in its parameter's layout (see the module docstring); positions number the parameters as
        ``param_groups`` do, as in any torch optimizer."""
        state = self.inner.state_dict()
        return {
            "state": {
                i: {key: self._distributed(self._pairs[i], key, value) for key, value in entry.items()}
                for i, entry in state["state"].items()
            },
            "param_groups": state["param_groups"],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state_dict of ``state_dict()``'s form (DTensors in the parameters' layouts, or
        plain tensors of the local shards), then copies every parameter's local shard into its host
        master (see the module docstring)."""
        state = {
            i: {key: self._host(self._pairs[i], key, value) for key, value in entry.items()}
            for i, entry in state_dict["state"].items()
        }
        self.inner.load_state_dict({**state_dict, "state": state})
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._read_masters()

    @torch.no_grad()
    def _read_masters(self) -> None:
        """Every host master := its parameter's local shard (host <- device, N * b bytes, once)."""
        for p, master in self._pairs:
            master.copy_(_local(p.detach()))

    @staticmethod
    def _is_per_element(pair: tuple, key: str, value: Any) -> bool:
        # torch's own rule (Optimizer._process_value_according_to_param_policy): every tensor but
        # "step" follows its parameter; here, those of the parameter's local shape.
        _, master = pair
        return key != "step" and isinstance(value, torch.Tensor) and value.shape == master.shape

    def _distributed(self, pair: tuple, key: str, value: Any) -> Any:
        p, _ = pair
        if not _C.is_dtensor(p) or _C.is_dtensor(value) or not self._is_per_element(pair, key, value):
            return value
        return _C.from_local(value, _C.device_mesh_of(p), _C.layout_of(p))

    def _host(self, pair: tuple, key: str, value: Any) -> Any:
        p, master = pair
        if not (isinstance(value, torch.Tensor) and _C.is_dtensor(value)):
            return value
        if not _C.is_dtensor(p) or _C.layout_of(value) != _C.layout_of(p):
            raise _error(
                f"state {key!r} of a parameter is a DTensor of layout {_C.layout_of(value)}, the parameter's is "
                f"{_C.layout_of(p) if _C.is_dtensor(p) else 'a plain tensor'}; allowed: the parameter's layout "
                "(hypershard.checkpoint.load reshards a saved state onto any mesh)"
            )
        return _C.local_of(value).detach().to(device="cpu", dtype=master.dtype)


def offload_optimizer(
    params: Iterable, optimizer_cls: type = torch.optim.AdamW, *, pin_memory: Optional[bool] = None, **kwargs: Any
) -> OffloadedOptimizer:
    """`optimizer_cls(params, **kwargs)` with its state and its step on the host (see the module
    docstring). `params`: parameters or param-group dicts, as torch optimizers take them (DTensor
    parameters: their local shards are what is copied and stepped). `pin_memory` (default: when
    the parameters are on an accelerator) pins the host buffers for asynchronous copies."""
    return OffloadedOptimizer(params, optimizer_cls, pin_memory=pin_memory, **kwargs)
