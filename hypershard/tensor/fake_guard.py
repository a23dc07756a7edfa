"""torch.compile on hypershard DTensors: Dynamo graph-breaks at every DTensor (see docs/compile.md).

A hypershard DTensor is a plain ``torch.Tensor`` whose C++ ``DTensorImpl`` has no storage. To
trace a tensor, Dynamo first converts it to a FakeTensor (``FakeTensorConverter.from_real_tensor``
-> ``MetaConverter``), which reads its storage and died with ``NotImplementedError: Cannot access
storage of hypershard::DTensorImpl`` -- an internal error, even with ``backend="eager"``.

Dynamo has one clean way out for a tensor it cannot fake: ``UnsupportedFakeTensorException``,
which its ``wrap_fake_exception`` turns into a graph break ("Fake tensor propagation exception").
torch has no registration point for a C++ TensorImpl that cannot be faked, so hypershard wraps the
one converter every fakeification goes through (Dynamo, AOTAutograd, export, FakeTensorMode) and
raises that exception for a DTensor before anything reads its storage. The code around the
DTensor still compiles; each instruction that touches a DTensor runs eagerly, through hypershard's
dispatcher, so results and gradients are eager's. ``fullgraph=True`` raises that graph break.

``torch._subclasses.fake_tensor`` is loaded by ``import torch`` already, so this costs nothing at
import (``torch._dynamo`` itself, ~1 s to import, is not imported here).
"""

from __future__ import annotations

import functools
import logging

from torch._subclasses import fake_tensor

from .. import _C

# The reason Dynamo prints with the graph break (TORCH_LOGS=graph_breaks, torch._dynamo.explain).
GRAPH_BREAK_REASON = (
    "hypershard DTensor: Dynamo cannot fake a hypershard DTensor (a storage-less "
    "C++ TensorImpl); the code that uses it runs eagerly through hypershard's "
    "dispatcher (docs/compile.md)"
)

# How many times a DTensor was refused (each is a graph break, or a skipped frame when it is the
# frame's first instruction); tests read it to see that Dynamo really met a DTensor.
counts = {"refused": 0}


class _FirstRefusalOnly(logging.Filter):
    """torch logs a WARNING for every refusal (once per traced frame: hundreds in a model); the
    first one per process is enough to say what happens, the rest are counted in counts."""

    def filter(self, record: logging.LogRecord) -> bool:
        if GRAPH_BREAK_REASON not in record.getMessage():
            return True
        counts["logged"] = counts.get("logged", 0) + 1
        return counts["logged"] == 1


def install() -> None:
    """Makes fakeification of a hypershard DTensor an UnsupportedFakeTensorException (a graph break
    in Dynamo) instead of a NotImplementedError. Idempotent."""
    converter = fake_tensor.FakeTensorConverter
    original = converter.from_real_tensor
    if getattr(original, "_hypershard_guard", False):
        return

    @functools.wraps(original)
    def from_real_tensor(self, fake_mode, t, *args, **kwargs):
        if _C.is_dtensor(t):
            counts["refused"] += 1
            raise fake_tensor.UnsupportedFakeTensorException(GRAPH_BREAK_REASON)
        return original(self, fake_mode, t, *args, **kwargs)

    from_real_tensor._hypershard_guard = True
    converter.from_real_tensor = from_real_tensor
    # the logger of torch/_dynamo/utils.py: wrap_fake_exception; naming it imports nothing
    logging.getLogger("torch._dynamo.utils").addFilter(_FirstRefusalOnly())
