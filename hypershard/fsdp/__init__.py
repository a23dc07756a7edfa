"""Sharded data parallelism (as torch.distributed.fsdp): fully_shard and its groups, mixed
precision, optimizer offload. Reads the DTensor core (hypershard.tensor)."""

from .fully_shard import FullyShardedModule, MixedPrecisionPolicy, fully_shard
from .mixed_precision import mixed_precision
from .offload import offload_optimizer

__all__ = ["FullyShardedModule", "MixedPrecisionPolicy", "fully_shard", "mixed_precision", "offload_optimizer"]
