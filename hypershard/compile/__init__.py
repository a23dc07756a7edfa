"""hypershard.compile: torch.compile with hypershard DTensors traced (docs/compile.md). The traced
DTensor itself (TracedDTensor) is part of the DTensor core, hypershard/tensor/traced.py."""

from .api import compile  # noqa: A004  (hypershard.compile, as torch.compile)

__all__ = ["compile"]
