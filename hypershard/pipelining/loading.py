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
    stream. `fully_shard=True`, `recompute` and `mixed_precision` are hs.pipeline's (each stage's
    layers and root fully sharded over dp on meta, so each rank reads only its 1/dp of them; then
    recomputation and mixed precision); `mp_policy` is refused with pp (``mixed_precision=policy``
    there). Returns the Pipeline (eval mode, as transformers' from_pretrained) with
    ``hs_load_report`` (the LoadReport of this rank's stages together)."""
    if mesh is None or pp_axis not in (mesh.mesh_dim_names or ()):
        return pretrained.from_pretrained(directory, mesh, **options)
    if n_microbatches is None:
        raise pretrained._error(f"a mesh with a {pp_axis!r} axis builds a pipeline; allowed: n_microbatches=N")
    if callable(options.get("fully_shard")):
        raise pretrained._error(
            "a callable fully_shard with a pp axis; allowed: fully_shard=True (each stage's layers, then its root)"
        )
    if options.get("mp_policy") is not None:
        raise pretrained._error(
            "mp_policy with a pp axis; allowed: mixed_precision=<policy> (hs.mixed_precision on every stage)"
        )
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
    stage_options = {
        k: options[k] for k in ("fully_shard", "recompute", "mixed_precision", "max_shapes") if k in options
    }
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
            **stage_options,
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
            dp_axis = layout.get("dp_axis", "dp")
            pretrained._materialize(stage, pipe.submesh, sources, reader, dp_axis, None, report)
            _rebuild_root_group(module, pipe.submesh, dp_axis)
            stage.eval()
        report.bytes_read, report.largest_slice = reader.bytes_read, reader.largest_slice
    report.unused_keys = sorted(unused)  # keys no stage of this rank read: the other stages'
    pipe.hs_load_report = report
    return pipe


def _rebuild_root_group(module: nn.Module, mesh, dp_axis: str) -> None:
    """With fully_shard, a StageModule's root group (its embeddings, norm and head: hs.pipeline's
    _fully_shard_stage) lies outside the stage model the reader materialised, so it still holds the
    meta shards: it is rebuilt on the real ones, which the reader put in their owners' places.
    (Every group under the StageModule is rebuilt; the layers' again, which allocates nothing.)"""
    if not hasattr(module, "_hs_fully_shard"):
        return
    current: dict = {}
    for sub in module.modules():
        group = getattr(sub, "_hs_fully_shard", None)
        for param, owners in zip(group.params, group.entries) if group is not None else ():
            owner, name = owners[0]
            current[id(param)] = owner._parameters[name]
    pretrained._rebuild_fully_shard_groups(module, current, mesh, dp_axis)
