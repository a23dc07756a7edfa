"""Level0: failures mid-step. When one rank raises or exits while the others enter a collective,
the others must fail with an error within the configured collective timeout -- never hang.

Each scenario forks 2 ranks (gloo, collective timeout COLLECTIVE_TIMEOUT_S) that run part of a
training step on a 2-rank mesh; rank 1 fails before the collective that rank 0 enters (a
DTensor full_tensor after a row-parallel matmul, i.e. hypershard's own all-reduce/all-gather).
The parent waits at most PARENT_DEADLINE_S and checks rank 0's outcome and time. Scenarios:
rank 1 raises, rank 1 exits, rank 1 stalls past the timeout (then exits).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import socket
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import hypershard as hs

COLLECTIVE_TIMEOUT_S = 5.0
PARENT_DEADLINE_S = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, scenario: str, out: str) -> None:
    code = 0
    record = {"rank": rank, "error": None}
    try:
        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        mesh = hs.init_device_mesh("cpu", (2,), ("tp",))
        x = hs.distribute_tensor(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), mesh, [hs.Shard(1)])
        w = hs.distribute_tensor(torch.randn(6, 3, generator=torch.Generator().manual_seed(1)), mesh, [hs.Shard(0)])
        y = x @ w  # Partial(sum): no collective yet
        dist.barrier()  # both ranks got here
        if rank == 1:
            if scenario == "raise":
                raise RuntimeError("injected failure on rank 1")
            if scenario == "exit":
                os._exit(3)
            if scenario == "stall":
                time.sleep(4 * COLLECTIVE_TIMEOUT_S)  # never enters the collective in time
                os._exit(0)
        start = time.monotonic()
        try:
            y.full_tensor()
        finally:
            record["elapsed"] = time.monotonic() - start
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent
        record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        code = 1
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    os._exit(code)


def _run(scenario: str) -> dict:
    out = tempfile.mkdtemp(prefix="hypershard-failure-")
    port = _free_port()
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_rank, args=(rank, port, scenario, out), daemon=True) for rank in range(2)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + PARENT_DEADLINE_S
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.exitcode is None]
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)
    assert not hung, f"{scenario}: rank(s) {hung} still running after {PARENT_DEADLINE_S} s (a hang)"
    with open(os.path.join(out, "rank0.json")) as handle:
        return json.load(handle)


@pytest.mark.parametrize("scenario", ["raise", "exit", "stall"])
def test_peer_failure_is_an_error_not_a_hang(scenario):
    rank0 = _run(scenario)
    assert rank0["error"], f"{scenario}: rank 0 finished the collective although rank 1 never joined"
    # gloo says why: the peer closed the connection, or the collective timed out.
    assert any(word in rank0["error"] for word in ("Connection closed", "Connection reset", "Timed out",
                                                    "timed out", "timeout", "Timeout")), rank0["error"]
    # Within the configured timeout (plus scheduling slack) -- not when the stalled peer finally
    # exits 4 timeouts later: hypershard's mesh groups inherit the default group's timeout.
    assert rank0["elapsed"] < COLLECTIVE_TIMEOUT_S + 5, rank0
