"""The parent side: group cases by world size, launch the ranks, watch them, merge results.

One launch = one TCPStore (owned by the parent, on a port the OS picks) + `world_size` rank
processes forked from the caller (fork, so cases may hold lambdas and torch is not imported
again) + one fresh temporary directory.  The parent waits for the ranks with a deadline; on
timeout it dumps every live rank's Python stacks (SIGUSR1 -> faulthandler), kills the ranks'
process groups, and reports "possible hang in case <name>" with what each rank was doing (from
its progress file).  A rank that dies is reported as a crash of the case it was running.  After
a hang or crash the cases that did not run are launched again (resume=True), so one bad case
does not hide the others.  A case that leaves the device unusable (CUDA's AcceleratorError, a
device-side assert) ends its launch on every rank on purpose ("restart"): the rest run in fresh
ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
from typing import Optional, Sequence, Union

import torch.distributed as dist

from .adapters import Adapter, get_adapter
from .results import CaseResult, LaunchInfo, RunResult
from .spec import Case, PreparedCase, prepare
from .worker import LaunchPlan, rank_main

__all__ = ["run_cases"]

CRASH_GRACE_S = 3.0  # after one rank dies, how long the others get to finish on their own
STACK_DUMP_WAIT_S = 1.0  # how long dumped stacks get to reach the logs before the kill
TAIL_LINES = 30
SETUP_RETRIES = 1  # launches that fail before the first case are tried once more


def run_cases(
    cases: Sequence[Case],
    world_size: Optional[int] = None,
    backend: Union[str, Adapter] = "hypershard",
    timeout: float = 300.0,
    collective_timeout: Optional[float] = None,
    device_type: str = "cpu",
    resume: bool = True,
    keep_dir: Optional[bool] = None,
    device_backend: str = "nccl",
) -> RunResult:
    """Run `cases` on local ranks and compare each with its single-process reference.

    device_type "cuda": every rank on GPU rank % device count with `device_backend` for the CUDA
    tensors (NCCL, one GPU per rank; "gloo": ranks may share a GPU, gloo stages through the host
    and orders its work with CUDA events), the inputs, references and cotangents on the GPU too
    (hypershard.testing.gpu_check).
    Cases are grouped by world size (the size of their mesh; `world_size` is the default mesh
    size for cases without one); each group runs in one launch (relaunched for the remaining
    cases after a hang or crash when `resume`).  `timeout`: seconds per launch.
    `collective_timeout`: the process group's timeout, so a collective some rank never enters
    fails instead of hanging (default: timeout / 4, at most 60 s).  `keep_dir`: keep the launch
    directories (logs, progress, results); default from HYPERSHARD_TESTING_KEEP=1.
    Returns a RunResult (see assert_all_passed); never raises for a failing case.
    """
    adapter = get_adapter(backend)
    adapter.check()
    if device_backend not in ("nccl", "gloo"):
        raise ValueError("run_cases: device_backend must be 'nccl' or 'gloo'")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(
            "run_cases: device_type must be 'cpu' (gloo) or 'cuda' (NCCL, one GPU per "
            "rank; the caller must not have initialised CUDA, the ranks are forked)"
        )
    cases = list(cases)
    names = [case.name for case in cases]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"run_cases: duplicate case names {duplicates}")
    if collective_timeout is None:
        collective_timeout = max(1.0, min(60.0, timeout / 4))
    if keep_dir is None:
        keep_dir = os.environ.get("HYPERSHARD_TESTING_KEEP", "") not in ("", "0")

    prepared = [prepare(case, world_size) for case in cases]  # validates before any launch
    groups: dict[int, list[PreparedCase]] = {}
    for pc in prepared:
        groups.setdefault(pc.world_size, []).append(pc)

    merged: dict[str, CaseResult] = {}
    result = RunResult(adapter.name)
    for size, group in groups.items():
        remaining, setup_retries = group, SETUP_RETRIES
        while remaining:
            batch = [dataclasses.replace(pc, index=i) for i, pc in enumerate(remaining)]
            with _launch_directory(size, keep_dir) as directory:
                info, outcome, resume_from = _launch(
                    directory, batch, size, adapter, timeout, collective_timeout, keep_dir, device_type, device_backend
                )
            result.launches.append(info)
            merged.update(outcome)
            if info.case == "<setup>" and setup_retries > 0:
                # Nothing ran: a rendezvous lost to an overloaded machine gets one more try;
                # a real setup error fails the same way twice and is reported then.
                setup_retries -= 1
                continue
            if resume_from is None or not resume:
                break
            remaining = remaining[resume_from:]
    result.cases = {name: merged[name] for name in names}
    return result


# ---------------------------------------------------------------------------------------------
# one launch


def _kill(procs: list) -> None:
    """SIGKILL each rank's process group (the rank and anything it started), then the rank."""
    for proc in procs:
        if proc.pid is None or proc.exitcode is not None:
            continue
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            proc.kill()


def _supervise(procs: list, deadline: float) -> tuple[str, dict]:
    """Wait for the ranks; ("ok" | "crash" | "hang", {rank: exit code at that moment})."""
    crash_since = None
    while True:
        codes = {rank: proc.exitcode for rank, proc in enumerate(procs)}
        live = [procs[rank] for rank, code in codes.items() if code is None]  # same snapshot
        if not live:
            return ("ok" if all(code == 0 for code in codes.values()) else "crash"), codes
        now = time.monotonic()
        if any(code not in (None, 0) for code in codes.values()):
            crash_since = crash_since or now
            if now - crash_since >= CRASH_GRACE_S:
                return "crash", codes
        if now >= deadline:
            return "hang", codes
        multiprocessing.connection.wait([proc.sentinel for proc in live], timeout=max(0.01, min(0.5, deadline - now)))


def _dump_stacks(procs: list, directory: str) -> None:
    for rank, proc in enumerate(procs):
        if proc.exitcode is None:
            with contextlib.suppress(OSError):
                with open(os.path.join(directory, f"rank{rank}.log"), "a") as log:
                    log.write("\n=== stacks at the launch timeout ===\n")
                os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(STACK_DUMP_WAIT_S)


def _read_lines(path: str) -> list:
    with contextlib.suppress(OSError), open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
    return []


def _read_progress(path: str) -> Optional[dict]:
    with contextlib.suppress(OSError, ValueError), open(path) as handle:
        return json.load(handle)
    return None


def _log_tail(directory: str, rank: int, after_marker: bool = False) -> str:
    try:
        with open(os.path.join(directory, f"rank{rank}.log"), errors="replace") as handle:
            text = handle.read()
    except OSError:
        return ""
    marker = "=== stacks at the launch timeout ===\n"
    if not after_marker:
        return "\n".join(text.rstrip().splitlines()[-TAIL_LINES:])
    if marker not in text:
        return ""
    # faulthandler prints innermost frames first; the frames below rank_main are the parent's,
    # inherited through fork, so each thread's stack is cut there.
    lines, skipping = [], False
    for line in text.rsplit(marker, 1)[1].strip().splitlines():
        if line.lstrip().startswith("File "):
            if not skipping:
                lines.append(line)
            skipping = skipping or line.rstrip().endswith(" in rank_main")
        else:
            skipping = False
            lines.append(line)
    return "\n".join(lines[:TAIL_LINES])


def _read_all_progress(directory: str, world_size: int) -> dict:
    return {rank: _read_progress(os.path.join(directory, f"rank{rank}.progress")) for rank in range(world_size)}


def _all_in_setup(progress: dict) -> bool:
    """Whether no rank got past setup ({rank: progress or None})."""
    return all((p or {}).get("phase", "setup") == "setup" for p in progress.values())


def _doing(progress: Optional[dict]) -> str:
    """What a rank was doing, in words, from its progress file."""
    if progress is None or progress.get("phase") == "setup":
        return "setting up (before the first case)"
    name, phase = progress.get("name"), progress.get("phase")
    return {
        "run": f"running case {name!r}",
        "sync": f"waiting for the other ranks after case {name!r}",
        "health": f"checking the process group after an error in case {name!r}",
        "teardown": "tearing down after the last case",
        "done": "finished",
    }.get(phase, f"{phase} {name!r}")


def _merge(pc: PreparedCase, records: dict) -> CaseResult:
    """One CaseResult from every rank's record of a case."""
    statuses = [record["status"] for record in records.values()]
    status = "passed" if all(s == "passed" for s in statuses) else "error" if "error" in statuses else "failed"
    by_message: dict[str, list] = {}
    for rank, record in sorted(records.items()):
        if record["status"] != "passed" or status == "passed":
            by_message.setdefault(record["message"], []).append(rank)
    lines = []
    for message, ranks in by_message.items():
        if not message:
            continue
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        lines.append(f"{who}: {message}")
        if status == "passed":
            break  # one rank's note ("raised as expected: ...") is enough
    notes = {r["group_note"] for r in records.values() if r.get("group_note")}
    lines += sorted(notes)  # the same on every rank: said once
    diffs = [(r.get("max_abs"), r.get("max_rel")) for r in records.values()]
    abs_values = [a for a, _ in diffs if a is not None]
    rel_values = [b for _, b in diffs if b is not None]
    return CaseResult(
        pc.case.name,
        status,
        "\n".join(lines),
        pc.world_size,
        (pc.mesh_shape, pc.mesh_names),
        ranks={rank: {"status": r["status"], "message": r["message"]} for rank, r in records.items()},
        max_abs_diff=max(abs_values) if abs_values else None,
        max_rel_diff=max(rel_values) if rel_values else None,
        duration=max((r.get("duration", 0.0) for r in records.values()), default=0.0),
    )


@contextlib.contextmanager
def _launch_directory(world_size: int, keep_dir: bool):
    """A fresh directory for one launch's files, removed afterwards (also on KeyboardInterrupt)
    unless `keep_dir`."""
    directory = tempfile.mkdtemp(prefix=f"hypershard-testing-{world_size}r-")
    try:
        yield directory
    finally:
        if not keep_dir:
            shutil.rmtree(directory, ignore_errors=True)


def _launch(
    directory: str,
    batch: list,
    world_size: int,
    adapter: Adapter,
    timeout: float,
    collective_timeout: float,
    keep_dir: bool,
    device_type: str = "cpu",
    device_backend: str = "nccl",
) -> tuple[LaunchInfo, dict, Optional[int]]:
    """Run one batch in `directory`; (launch info, {name: CaseResult} for every case of the batch,
    index of the first case to launch again or None)."""
    # The ranks are forked before the store exists: the store's server runs a thread, and a
    # thread that holds a lock while another thread forks leaves that lock held forever in the
    # child (a rank stuck in setup, rarely, under load).  The port follows over a pipe.
    context = multiprocessing.get_context("fork")
    procs: list = []
    pipes: list = []
    start = time.monotonic()
    state, codes = "crash", {}
    store = None
    try:
        for rank in range(world_size):
            receive, send = context.Pipe(duplex=False)
            plan = LaunchPlan(
                world_size,
                "127.0.0.1",
                receive,
                directory,
                batch,
                adapter,
                device_type,
                collective_timeout,
                timeout + 60,
                os.getpid(),
                device_backend,
            )
            proc = context.Process(
                target=rank_main, args=(rank, plan), daemon=True, name=f"hypershard-testing-rank{rank}"
            )
            proc.start()
            receive.close()
            procs.append(proc)
            pipes.append(send)
            with contextlib.suppress(OSError):  # also done by the child; whoever is first wins
                os.setpgid(proc.pid, proc.pid)
        # The parent owns the store: port 0 lets the OS pick a free one, and it outlives any rank.
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout + 60)
        )
        for send in pipes:
            with contextlib.suppress(OSError):  # a rank that already died is reported below
                send.send(store.port)
            send.close()
        state, codes = _supervise(procs, start + timeout)
        if state == "hang" or (state == "crash" and _all_in_setup(_read_all_progress(directory, world_size))):
            _dump_stacks(procs, directory)  # where a live rank is stuck, for the message
    finally:  # also on KeyboardInterrupt: no rank may survive the launch
        _kill(procs)
        for proc in procs:
            proc.join(10)
        del store
    duration = time.monotonic() - start

    records: dict[int, dict] = {}  # case index -> {rank: record}
    fatal: dict[int, str] = {}
    restarts: dict[int, int] = {}  # rank -> the case after which it stopped for a fresh process
    done = set()
    progress = _read_all_progress(directory, world_size)
    for rank in range(world_size):
        for record in _read_lines(os.path.join(directory, f"rank{rank}.jsonl")):
            if record["type"] == "case":
                records.setdefault(record["index"], {})[rank] = record
            elif record["type"] == "fatal":
                fatal[rank] = record["message"]
            elif record["type"] == "restart":
                restarts[rank] = record["index"]
            elif record["type"] == "done":
                done.add(rank)
    if state == "ok" and len(done) < world_size:
        state = "crash"  # a rank exited 0 without finishing (os._exit in a case?)

    outcome: dict[str, CaseResult] = {}
    complete = [pc.index for pc in batch if len(records.get(pc.index, {})) == world_size]
    for pc in batch:
        if pc.index in complete:
            outcome[pc.case.name] = _merge(pc, records[pc.index])
    stuck = next((pc for pc in batch if pc.index not in complete), None)

    info = LaunchInfo(
        world_size,
        [pc.case.name for pc in batch],
        "ok" if state == "ok" else state,
        duration=duration,
        pids=[proc.pid for proc in procs],
        exitcodes=[proc.exitcode for proc in procs],
        directory=directory if keep_dir else None,
    )
    if len(restarts) == world_size and codes and all(code == 0 for code in codes.values()):
        # Every rank stopped on purpose after a case that left the device unusable (the case's
        # own result says why): the remaining cases run in a fresh launch.
        after = next(pc for pc in batch if pc.index == max(restarts.values()))
        info.outcome, info.case = "restart", after.case.name
        info.message = f"the ranks stopped after case {after.case.name!r} left the device unusable"
        return info, outcome, stuck.index if stuck is not None else None
    resume_from = None
    if state != "ok":
        where = "\n".join(
            f"  rank {rank}: {_doing(progress.get(rank))}"
            + (f" (died, exit code {codes[rank]})" if codes.get(rank) not in (None, 0) else "")
            for rank in range(world_size)
        )
        in_setup = stuck is not None and stuck.index == 0 and _all_in_setup(progress)
        if state == "hang":
            culprit = "process-group setup" if in_setup else f"case {stuck.case.name!r}" if stuck else "teardown"
            message = (
                f"possible hang in {culprit}: the launch of {world_size} ranks did not "
                f"finish within {timeout:g} s (collective timeout "
                f"{collective_timeout:g} s); last case per rank:\n{where}"
            )
            for rank, proc in enumerate(procs):
                if codes.get(rank) is None:
                    stack = _log_tail(directory, rank, after_marker=True)
                    if stack:
                        message += f"\n--- rank {rank} stacks ---\n{stack}"
            status = "hang"
        else:
            dead = [rank for rank, code in codes.items() if code not in (None, 0)] or [
                rank for rank in range(world_size) if rank not in done
            ]
            culprit = "setup" if in_setup else f"case {stuck.case.name!r}" if stuck else "teardown"
            message = f"rank process died in {culprit}:\n{where}"
            for rank in dead:
                if rank in fatal:
                    message += f"\n--- rank {rank} error ---\n{fatal[rank]}"
                else:
                    message += f"\n--- rank {rank} log ---\n{_log_tail(directory, rank)}"
            for rank in range(world_size):
                if codes.get(rank) is None:  # alive when the others died: where it was stuck
                    stack = _log_tail(directory, rank, after_marker=True)
                    if stack:
                        message += f"\n--- rank {rank} stacks ---\n{stack}"
            status = "crash"
        if fatal and in_setup:
            info.outcome = "fatal"
        info.message = message
        if keep_dir:
            info.message += f"\n(launch directory kept: {directory})"
        if in_setup:
            for pc in batch:  # nothing ran; launching again would fail the same way
                outcome[pc.case.name] = CaseResult(
                    pc.case.name,
                    "error" if info.outcome == "fatal" else status,
                    info.message,
                    world_size,
                    (pc.mesh_shape, pc.mesh_names),
                )
            info.case = "<setup>"
        elif stuck is not None:
            info.case = stuck.case.name
            outcome[stuck.case.name] = CaseResult(
                stuck.case.name, status, info.message, world_size, (stuck.mesh_shape, stuck.mesh_names)
            )
            for pc in batch:
                if pc.index > stuck.index and pc.index not in complete:
                    outcome[pc.case.name] = CaseResult(
                        pc.case.name,
                        "not_run",
                        f"not run: the launch ended after a {status} in case {stuck.case.name!r}",
                        world_size,
                        (pc.mesh_shape, pc.mesh_names),
                    )
                    if resume_from is None:
                        resume_from = pc.index
    return info, outcome, resume_from
