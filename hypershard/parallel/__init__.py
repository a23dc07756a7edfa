"""Parallel styles (as torch.distributed.tensor.parallel and its experimental context parallel):
parallelize() and its plan styles (styles.py), experts on an ep axis (experts.py), the forward
inputs over dp and cp (inputs.py), attention heads on tp (attention.py), context parallelism
(context.py) and linear attention on cp (linear_attention.py), activation recomputation
(recompute.py). Reads the DTensor core (hypershard.tensor)."""

from .api import parallelize
from .inputs import CP_ALGORITHMS
from .styles import STYLES, Style, ep_plan_of, style, tp_plan_of

__all__ = ["CP_ALGORITHMS", "STYLES", "Style", "ep_plan_of", "parallelize", "style", "tp_plan_of"]
