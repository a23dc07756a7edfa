"""Backend adapters: the few DTensor operations the harness needs, for each DTensor library.

The harness never touches a DTensor API directly; it calls an Adapter:

    check()                                   parent side, before launching: raise if unusable
    make_mesh(device_type, shape, names)      a device mesh over all ranks of the launch
    distribute(tensor, mesh, layout)          a DTensor from a global tensor and a LayoutSpec
    is_dtensor(x) / full(x) / grad_of(x)      recognise, gather to a plain global tensor, .grad
    cotangent(tensor, like, mesh, mode)       a DTensor cotangent laid out like output `like`

Two are built in: "hypershard" (hypershard.init_device_mesh / distribute_tensor / full_tensor /
Shard / Replicate / Partial) and "torch" (torch.distributed.tensor, the reference
implementation, used by the harness's own tests).  Both import their library lazily, inside the
methods, so this module imports without hypershard's runtime.  register_adapter() adds more.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

from .spec import LayoutSpec, PlacementSpec, parse_placement

__all__ = ["Adapter", "HypershardAdapter", "TorchAdapter", "get_adapter", "register_adapter"]


def _is_partial(placement: Any) -> bool:
    method = getattr(placement, "is_partial", None)
    if callable(method):
        return bool(method())
    try:
        return parse_placement(placement).kind == "P"
    except ValueError:
        return False


class Adapter:
    """Base class; subclasses implement the DTensor operations for one library."""

    name = "adapter"

    def check(self) -> None:
        """Raise a clear error, in the parent, when the library cannot run the cases."""

    def setup_rank(self) -> None:
        """Called once in every rank process before its cases run."""

    def make_mesh(self, device_type: str, shape: tuple, names: tuple) -> Any:
        raise NotImplementedError

    def distribute(self, tensor: torch.Tensor, mesh: Any, layout: LayoutSpec) -> Any:
        raise NotImplementedError

    def is_dtensor(self, value: Any) -> bool:
        raise NotImplementedError

    def full(self, value: Any) -> torch.Tensor:
        """The plain global tensor of a DTensor (called under no_grad)."""
        return value.full_tensor()

    def grad_of(self, param: Any) -> Any:
        return param.grad

    def cotangent(self, tensor: torch.Tensor, like: Any, mesh: Any, mode: str) -> Any:
        """`tensor` distributed like output `like`: same placements with Partial -> Replicate
        (mode "match"), or Replicate everywhere (mode "replicate")."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class TorchAdapter(Adapter):
    """torch.distributed.tensor (PyTorch's own DTensor)."""

    name = "torch"

    @staticmethod
    def _dt():
        from torch.distributed import tensor as dt

        return dt

    def make_mesh(self, device_type, shape, names):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))

    def _placement(self, spec: PlacementSpec):
        dt = self._dt()
        if spec.kind == "S":
            return dt.Shard(spec.dim)
        if spec.kind == "P":
            return dt.Partial(spec.op)
        return dt.Replicate()

    def placements(self, layout: LayoutSpec) -> list:
        if layout.kind == "placements":
            return [self._placement(spec) for spec in layout.items]
        # alias -> placements; torch orders the shards of a dim by mesh axis, so a dim split
        # over several axes must list them in mesh order.
        result = [self._dt().Replicate() for _ in layout.mesh_names]
        for dim, axes in enumerate(layout.items):
            positions = [layout.mesh_names.index(axis) for axis in axes]
            if positions != sorted(positions):
                raise ValueError(
                    f"alias layout {layout.raw!r}: torch DTensor cannot shard a dim over mesh axes in non-mesh order"
                )
            for position in positions:
                result[position] = self._dt().Shard(dim)
        return result

    def distribute(self, tensor, mesh, layout):
        return self._dt().distribute_tensor(tensor, mesh, self.placements(layout))

    def is_dtensor(self, value):
        return isinstance(value, self._dt().DTensor)

    def cotangent(self, tensor, like, mesh, mode):
        dt = self._dt()
        mesh = like.device_mesh
        if mode == "replicate":
            placements = [dt.Replicate() for _ in range(mesh.ndim)]
        else:
            placements = [dt.Replicate() if _is_partial(p) else p for p in like.placements]
        return dt.distribute_tensor(tensor, mesh, placements)


class HypershardAdapter(Adapter):
    """hypershard's C++ DTensor runtime."""

    name = "hypershard"
    required = ("init_device_mesh", "distribute_tensor", "Shard", "Replicate", "Partial")

    @staticmethod
    def _hs():
        import hypershard

        return hypershard

    def check(self):
        try:
            hs = self._hs()
        except ImportError as exc:
            raise RuntimeError(
                f"backend 'hypershard': cannot import hypershard ({exc}); build it first, or use backend='torch'"
            ) from exc
        missing = [name for name in self.required if not hasattr(hs, name)]
        if missing:
            raise RuntimeError(
                "backend 'hypershard': this build has no DTensor runtime API "
                f"(missing hypershard.{', hypershard.'.join(missing)}); "
                "use backend='torch' until the runtime lands"
            )

    def setup_rank(self):
        # Rule tests run strict: a missing rule raises instead of hiding behind the fallback.
        self._hs().set_strict(True)

    def make_mesh(self, device_type, shape, names):
        return self._hs().init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))

    def placements(self, layout: LayoutSpec):
        if layout.kind == "alias":
            return layout.raw  # Hyper-Parallel alias tuples go through unchanged
        hs = self._hs()
        result = []
        for spec in layout.items:
            if spec.kind == "S":
                result.append(hs.Shard(spec.dim))
            elif spec.kind == "P":
                result.append(hs.Partial(spec.op))
            else:
                result.append(hs.Replicate())
        return result

    def distribute(self, tensor, mesh, layout):
        return self._hs().distribute_tensor(tensor, mesh, self.placements(layout))

    def is_dtensor(self, value):
        cls = getattr(self._hs(), "DTensor", None)
        if cls is not None:
            return isinstance(value, cls)
        return isinstance(value, torch.Tensor) and hasattr(value, "full_tensor")

    def cotangent(self, tensor, like, mesh, mode):
        hs = self._hs()
        if mode != "replicate" and hs._C.is_dtensor(like):
            # The output's exact sharding (shard order included), Partial axes made Replicate.
            layout = hs._C.layout_of(like)
            target = hs.Layout.create(layout.mesh, layout.global_shape, layout.dim_axes, [None] * layout.mesh.ndim)
            return hs.distribute_tensor(tensor, like.device_mesh, target)
        mesh = getattr(like, "device_mesh", mesh)
        placements = getattr(like, "placements", None)
        if mode == "replicate" or placements is None:
            ndim = getattr(mesh, "ndim", None) or len(mesh.shape)
            placements = [hs.Replicate() for _ in range(ndim)]
        else:
            placements = [hs.Replicate() if _is_partial(p) else p for p in placements]
        return hs.distribute_tensor(tensor, mesh, placements)


class DefaultModeAdapter(HypershardAdapter):
    """hypershard in default mode -- the fallback and implicit redistribution on -- for the tests
    of those (every other hypershard test runs strict). The fallback's once-per-op warnings are
    silenced."""

    name = "hypershard-default-mode"

    def setup_rank(self):
        import warnings

        self._hs().set_strict(False)
        warnings.simplefilter("ignore")


class NoisyPartialAdapter(HypershardAdapter):
    """hypershard, with Partial inputs made of random parts (so an op that treats a Partial as
    "rank 0 holds the value" gives a wrong result): sum -> x / n + noise_i (the noise sums to 0
    over the Partial group), avg -> x + noise_i, prod -> f_i (times x on the group's first rank;
    the f_i multiply to 1), max/min -> x on the group's first rank and something smaller/larger
    on the others (bool: False/True). Integer Partials are distributed as usual."""

    name = "hypershard-noisy-partial"

    def distribute(self, tensor, mesh, layout):
        if (
            layout.kind != "placements"
            or not any(p.kind == "P" for p in layout.items)
            or not (tensor.is_floating_point() or tensor.dtype == torch.bool)
        ):
            return super().distribute(tensor, mesh, layout)
        hs = self._hs()
        placements = self.placements(layout)
        base = [hs.Replicate() if p.kind == "P" else q for p, q in zip(layout.items, placements)]
        local = hs.distribute_tensor(tensor, mesh, base).to_local().clone()
        axes = [a for a, p in enumerate(layout.items) if p.kind == "P"]
        op = layout.items[axes[0]].op
        # Seeded by the coordinates on the sharding axes only: the same on a Partial group.
        key = [mesh.coordinate(a) for a, p in enumerate(layout.items) if p.kind == "S"]
        noise = torch.randn(
            local.shape,
            generator=torch.Generator().manual_seed(
                7919 + sum((c + 1) * 31**k for k, c in enumerate(key)) + local.numel()
            ),
        )
        coords = [mesh.coordinate(a) for a in axes]
        centred = sum(c - (mesh.size(a) - 1) / 2 for c, a in zip(coords, axes))  # sums to 0
        count = 1
        for a in axes:
            count *= mesh.size(a)
        if local.dtype == torch.bool:
            if any(coords):
                local = torch.zeros_like(local) if op == "max" else torch.ones_like(local)
        elif op == "sum":
            local = local / count + noise * centred
        elif op == "avg":
            local = local + noise * centred
        elif op == "product":  # spec normalises "prod" to "product"
            local = (torch.ones_like(local) if any(coords) else local) * torch.exp(0.3 * noise * centred)
        elif any(coords):
            local = local - (1 + noise.abs()) if op == "max" else local + (1 + noise.abs())
        return hs.DTensor.from_local(local.to(tensor.dtype), mesh, placements, shape=list(tensor.shape))


_ADAPTERS: dict[str, Callable[[], Adapter]] = {
    "hypershard": HypershardAdapter,
    "hypershard-noisy-partial": NoisyPartialAdapter,
    "torch": TorchAdapter,
}


def register_adapter(name: str, factory: Callable[[], Adapter]) -> None:
    """Make ``run_cases(..., backend=name)`` use ``factory()``."""
    _ADAPTERS[name] = factory


def get_adapter(backend: Union[str, Adapter]) -> Adapter:
    """An Adapter from its registered name or itself."""
    if isinstance(backend, Adapter):
        return backend
    try:
        return _ADAPTERS[backend]()
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(sorted(_ADAPTERS))}") from None
