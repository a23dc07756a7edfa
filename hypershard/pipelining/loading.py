"""hs.from_pretrained with a pp axis: the HF folder read straight into this rank's pipeline stages.

On a mesh without the pp axis this is hypershard.checkpoint.from_pretrained itself. With it, the
model is built on meta and split into stages, each stage laid out on the mesh without pp by
hs.pipeline (on meta: no memory), then each of this rank's stages is filled from the files like a
model of its own with the checkpoint floor's reader -- a stage is a pruned copy of the model whose
names are the full model's, so the checkpoint's names match and only its layers' (and its
embeddings' / head's) shards are read. It lives here, above hypershard/checkpoint/, because it builds
pipelines (docs/architecture.md: imports run downward)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .. import _C
from ..checkpoint import pretrained
from ..checkpoint.safetensors_io import DEFAULT_STAGING_BYTES, Reader, read_index
from .api import pipeline

__all__ = ["from_pretrained"]


def from_pretrained(
    directory,
    mesh,
    *,
    pp_axis: str = "pp",
    n_microbatches: Optional[int] = None,
    schedule: str = "1f1b",
    stages_per_rank: Optional[int] = None,
    **options,
) -> nn.Module:
    """hypershard.checkpoint.from_pretrained (every option as there), and on a mesh with a `pp_axis`
    ``hs.pipeline``'s Pipeline (`n_microbatches`, `schedule`, `stages_per_rank` as there) whose
    stages each rank fills with only its stages' shards on the mesh without pp. Every tensor must
    be in the files: initialising a missing one as one device does needs the whole model's random
    stream. Returns the Pipeline (eval mode, as transformers' from_pretrained) with
    ``hs_load_report`` (the LoadReport of this rank's stages together)."""
    if mesh is None or pp_axis not in (mesh.mesh_dim_names or ()):
        return pretrained.from_pretrained(directory, mesh, **options)
    if n_microbatches is None:
        raise pretrained._error(f"a mesh with a {pp_axis!r} axis builds a pipeline; allowed: n_microbatches=N")
    if options.get("fully_shard"):
        raise pretrained._error("fully_shard inside pipeline stages is not supported yet; allowed: fully_shard=False")
    directory = Path(directory)
    config = pretrained._config(directory)
    model = pretrained._meta_model(
        pretrained._model_class(config, options.get("model_class")),
        config,
        options.get("dtype", torch.float32),
        options.get("attn_implementation", "sdpa"),
    )
    entries = read_index(directory)
    pretrained._match(model, entries, init_missing=False)  # every tensor in the files (on every rank alike)
    layout = {k: options[k] for k in ("plan", "ep_plan", "tp_axis", "dp_axis", "ep_axis") if k in options}
    checks = _C.check_replicas()
    _C.set_check_replicas(False)  # the debug checks compare values (a collective); meta tensors have none
    try:
        pipe = pipeline(
            model,
            mesh,
            pp_axis=pp_axis,
            n_microbatches=n_microbatches,
            schedule=schedule,
            stages_per_rank=stages_per_rank,
            **layout,
        )
    finally:
        _C.set_check_replicas(checks)
    unused = set(entries)
    report = pretrained.LoadReport()
    with Reader(options.get("staging_bytes", DEFAULT_STAGING_BYTES)) as reader:
        for module in pipe.modules:
            stage = module.model
            sources, stage_unused = pretrained._match(stage, entries, init_missing=False)
            unused &= set(stage_unused)
            pretrained._materialize(stage, pipe.submesh, sources, reader, layout.get("dp_axis", "dp"), None, report)
            stage.eval()
        report.bytes_read, report.largest_slice = reader.bytes_read, reader.largest_slice
    report.unused_keys = sorted(unused)  # keys no stage of this rank read: the other stages'
    pipe.hs_load_report = report
    return pipe
