"""hypershard.pipelining: pipeline parallelism for HuggingFace decoder models over a mesh's pp axis,
with torch.distributed.pipelining's stages and schedules (docs/pipelining.md)."""

from .api import Pipeline, StageModule, hold_grad_sync, pipeline
from .split import SCHEDULES, PipelineError, StageSpec, check_model, check_schedule, split_model, stage_model

__all__ = [
    "Pipeline",
    "PipelineError",
    "SCHEDULES",
    "StageModule",
    "StageSpec",
    "check_model",
    "check_schedule",
    "hold_grad_sync",
    "pipeline",
    "split_model",
    "stage_model",
]
