"""Tensors in and out of files (as torch.distributed.checkpoint): sharded checkpoints through DCP
with atomic saves and resume (api.py), from_pretrained's shard-wise HF loading (pretrained.py)
over the safetensors reader (safetensors_io.py), and HF export. Reads the DTensor core and the
parallel and fsdp floors (from_pretrained applies their plans)."""

from .api import (
    COMPLETE,
    SaveError,
    checkpoint_bytes,
    complete_checkpoints,
    export_hf,
    incomplete_reason,
    is_complete,
    latest,
    load,
    load_hf,
    model_state_dict,
    optimizer_state_dict,
    partial_checkpoints,
    partial_dir,
    read_extra,
    resume_point,
    save,
    set_optimizer_state_dict,
    skipped_message,
    step_dir,
)
from .pretrained import from_pretrained, load_into

__all__ = [
    "COMPLETE",
    "SaveError",
    "checkpoint_bytes",
    "complete_checkpoints",
    "export_hf",
    "from_pretrained",
    "incomplete_reason",
    "is_complete",
    "latest",
    "load",
    "load_hf",
    "load_into",
    "model_state_dict",
    "optimizer_state_dict",
    "partial_checkpoints",
    "partial_dir",
    "read_extra",
    "resume_point",
    "save",
    "set_optimizer_state_dict",
    "skipped_message",
    "step_dir",
]
