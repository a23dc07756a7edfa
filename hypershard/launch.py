"""Local multi-rank launches for the command-line tools (make demo, hypershard.coverage).

The test harness (hypershard.testing) has its own launcher with timeouts and hang reports; this
one only starts `world` spawned processes on a free port and returns what rank 0 wrote."""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """"dp=2,tp=2" -> ((2, 2), ("dp", "tp"))."""
    names, shape = [], []
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not size.isdigit() or not name:
            raise argparse.ArgumentTypeError(f"mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...], e.g. dp=2,tp=2")
        names.append(name.strip())
        shape.append(int(size))
    return tuple(shape), tuple(names)


def mesh_size(shape) -> int:
    world = 1
    for size in shape:
        world *= size
    return world


def spawn_local_ranks(target: Callable, world: int, *args: Any) -> dict:
    """Runs ``target(rank, world, port, *args, result_path)`` in `world` spawned processes and
    returns the JSON that rank 0 wrote to result_path."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.start_processes(target, args=(world, port, *args, result), nprocs=world, start_method="spawn")
        return json.loads(Path(result).read_text())
