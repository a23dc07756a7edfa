"""Running ranks: the command-line tools' local multi-rank launcher and mesh arguments (ranks.py),
and what a failed or hung collective says about its peers (faults.py). Used by the tools above
(sft, planner, integrations, tools, testing); reads only the mesh-axis names below it."""

from .ranks import (
    RankTimeout,
    free_port,
    init_torchrun_process_group,
    mesh_argument,
    mesh_size,
    parse_mesh,
    spawn_local_ranks,
)

__all__ = [
    "RankTimeout",
    "free_port",
    "init_torchrun_process_group",
    "mesh_argument",
    "mesh_size",
    "parse_mesh",
    "spawn_local_ranks",
]
