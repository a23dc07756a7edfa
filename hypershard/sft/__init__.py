"""hypershard.sft: LlamaFactory-style supervised fine-tuning on a mesh (``python -m hypershard.sft``).

data.py: alpaca / sharegpt records -> chat messages -> token ids and labels, batches, order, LR schedule;
train.py: the loop every rank runs; cli.py: the command line and the launch. See docs/sft.md."""

from .cli import main

__all__ = ["main"]
