"""What a training step reaches on CUDA and not on CPU (hypershard.testing.cuda_lowering), traced
once per process: the document's "Reached on CUDA" section."""

from __future__ import annotations

import functools
import warnings


@functools.lru_cache(maxsize=None)
def cuda_step_ops() -> tuple:
    """((op, (scenario names), lowered), ...) sorted by op; see cuda_lowering.cuda_step_ops."""
    import torch

    from ...testing import cuda_lowering

    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = cuda_lowering.cuda_step_ops()
    return tuple((op, tuple(names), lowered) for op, (names, lowered) in found.items())


def scenarios() -> tuple:
    from ...testing import cuda_lowering

    return cuda_lowering.SCENARIOS
