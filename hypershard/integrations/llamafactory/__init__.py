"""LlamaFactory's ``use_hyper_parallel`` contract, implemented by hypershard (docs/llamafactory.md).

    torchrun --nproc-per-node 4 -m hypershard.integrations.llamafactory train cfg.yaml

The launcher (``launcher.py``) makes ``hyper_parallel.integration.llamafactory`` resolve to this
package for that process only, and only when no real Hyper-Parallel is installed. The trainer is
imported lazily: importing it imports LlamaFactory, which the launcher prepares first.
"""

from .args import HyperParallelArguments, HyperParallelConfigError

__all__ = ["HyperParallelArguments", "HyperParallelConfigError", "HyperParallelTrainer"]


def __getattr__(name):
    if name == "HyperParallelTrainer":
        from .trainer import HyperParallelTrainer

        return HyperParallelTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
