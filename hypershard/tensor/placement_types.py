"""Torch-style placements: one per mesh axis (the same names and meaning as
``torch.distributed.tensor``; torch's own placement objects are accepted too)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Partial", "Placement", "Replicate", "Shard"]


class Placement:
    """Base class of Shard, Replicate and Partial."""

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@dataclass(frozen=True)
class Shard(Placement):
    """The tensor dim ``dim`` is split torch.chunk-style over the mesh axis."""

    dim: int

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank of the mesh axis holds the whole (rest of the) tensor."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Each rank holds a part; the value is their reduction ("sum", "avg", "max", "min",
    "prod") over the mesh axis."""

    reduce_op: str = "sum"

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"
