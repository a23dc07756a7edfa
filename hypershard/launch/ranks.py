"""Local multi-rank launches for the command-line tools (make demo, python -m hypershard.coverage, the bench).

The test harness (hypershard.testing) has its own launcher (forked ranks, many cases per
launch); this one spawns `world` fresh processes on a free port, sets up gloo in each, runs the
tool's function and returns what every rank returned. It never waits forever: past `timeout`
seconds it dumps the Python stacks of the ranks still running, kills them and raises an error
that names each such rank, the phase it was in (setup, running, shutting down) and the frames it
was at."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

STACK_DUMP_WAIT_S = 1.0  # how long the ranks get to write their stacks before the kill
STACK_LINES = 12  # innermost frames of each thread shown per stuck rank


class RankTimeout(TimeoutError):
    """Some ranks of a local launch did not finish within the launch's timeout."""


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """ "dp=2,tp=2" -> ((2, 2), ("dp", "tp")). Checks the form only; `mesh_argument` also the names."""
    names, shape = [], []
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not size.strip().isdigit() or int(size) < 1 or not name.strip():
            raise argparse.ArgumentTypeError(
                f"mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...] with sizes >= 1, e.g. dp=2,tp=2"
            )
        names.append(name.strip())
        shape.append(int(size))
    return tuple(shape), tuple(names)


def mesh_argument(tool: str, allowed: Optional[Iterable[str]] = None) -> Callable[[str], tuple]:
    """An argparse `type` for --mesh that parses "dp=2,tp=2" and refuses, before any rank starts, an
    axis name `tool` gives no meaning to (default: any outside hypershard.tensor.axes.MESH_AXES): one line
    on stderr, exit status 2 -- not argparse's usage block, which buries the reason."""
    from ..tensor.axes import MeshAxisError, check_axis_names

    def parse(text: str) -> tuple:
        try:
            shape, names = parse_mesh(text)
            check_axis_names(tool, names, allowed)
        except argparse.ArgumentTypeError as exc:
            sys.stderr.write(f"hypershard: {tool}: {exc}\n")
            raise SystemExit(2) from None
        except MeshAxisError as exc:
            sys.stderr.write(f"{exc}\n")
            raise SystemExit(2) from None
        return shape, names

    return parse


def mesh_size(shape) -> int:
    world = 1
    for size in shape:
        world *= size
    return world


def init_torchrun_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """The default process group of a rank torchrun started, with keys of its own for every attempt
    of ``torchrun --max-restarts``: with --standalone the agent's store outlives an attempt, and the
    process groups' keys (their names are counters, the same in every attempt) would otherwise hand
    a restarted rank the dead attempt's addresses (measured: gloo connectFullMesh refused or hung in
    the restarted job's first new_group). Used by hypershard.sft and the LlamaFactory launcher."""
    import torch.distributed as dist

    store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"hypershard/attempt_{attempt}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _phase(tmp: str, rank: int, text: str) -> None:
    Path(tmp, f"rank{rank}.phase").write_text(text)


def _rank_main(rank: int, target: Callable, world: int, port: int, args: tuple, tmp: str, pg_timeout: float) -> None:
    """One spawned rank: stack dumps on SIGUSR1, gloo, target(rank, world, *args), result file."""
    stacks = open(Path(tmp, f"rank{rank}.stacks"), "w")  # noqa: SIM115 -- open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _phase(tmp, rank, "setting up (import torch, init_process_group)")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        _phase(tmp, rank, "running")
        result = target(rank, world, *args)
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
        _phase(tmp, rank, "finished; waiting for the other ranks (barrier)")
        dist.barrier()
    finally:
        _phase(tmp, rank, "shutting down (destroy_process_group, interpreter exit)")
        dist.destroy_process_group()
    _phase(tmp, rank, "exiting")


def _stuck_report(tmp: str, ranks: list) -> str:
    lines = []
    for rank in ranks:
        phase_file, stack_file = Path(tmp, f"rank{rank}.phase"), Path(tmp, f"rank{rank}.stacks")
        # no phase file: the spawned process never reached _rank_main (still unpickling the target
        # and importing its module, e.g. torch, which a CPU-starved machine can stretch past the timeout)
        phase = phase_file.read_text() if phase_file.exists() else "not started (still importing the target's module)"
        lines.append(f"  rank {rank}: {phase}")
        stack = stack_file.read_text().splitlines() if stack_file.exists() else []
        # faulthandler prints innermost frames first under each "Thread ..." header.
        shown = 0
        for line in stack:
            if line.startswith(("Thread", "Current thread")):
                lines.append(f"    {line}")
                shown = 0
            elif shown < STACK_LINES:
                lines.append(f"    {line}")
                shown += 1
        if not stack and phase_file.exists():
            lines.append("    (no Python stack written: stuck outside Python, e.g. in a C++ destructor at exit)")
    return "\n".join(lines)


def spawn_local_ranks(
    target: Callable,
    world: int,
    *args: Any,
    timeout: float = 600.0,
    pg_timeout: float = 120.0,
    env: Optional[dict] = None,
) -> list:
    """Runs ``target(rank, world, *args)`` in `world` spawned processes (gloo initialised, one
    thread each) and returns every rank's return value (JSON-serialisable), in rank order.

    `timeout`: seconds for the whole launch; past it, the ranks still alive have their stacks
    dumped and are killed, and RankTimeout names them. `pg_timeout`: the process group's
    collective timeout (a collective some rank never enters fails after that long). A rank that
    raises fails the launch with its traceback (torch.multiprocessing.ProcessRaisedException).
    `env`: environment variables set for the ranks."""
    import torch.multiprocessing as mp

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory(prefix="hs_ranks_") as tmp:
            ctx = mp.start_processes(
                _rank_main,
                args=(target, world, free_port(), args, tmp, pg_timeout),
                nprocs=world,
                join=False,
                start_method="spawn",
            )
            deadline = time.monotonic() + timeout
            try:
                while not ctx.join(timeout=1.0):
                    if time.monotonic() > deadline:
                        stuck = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                        for r in stuck:
                            os.kill(ctx.processes[r].pid, signal.SIGUSR1)
                        time.sleep(STACK_DUMP_WAIT_S)
                        raise RankTimeout(
                            f"hypershard: ranks {stuck} of {world} still running after {timeout:.0f} s; "
                            f"where they were:\n{_stuck_report(tmp, stuck)}"
                        )
            finally:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                        p.join(5)
            return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
