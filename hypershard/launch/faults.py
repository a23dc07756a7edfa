"""A broken distributed run names what broke (docs/faults.md).

hypershard's collectives are issued by its C++ runtime through c10d (gloo on CPU). When a peer
dies, gloo fails the pending collective at once ("Connection closed by peer"); when a peer stops
issuing collectives (an exception caught in user code, a deadlock), the others wait the process
group's timeout, then gloo fails them with a bare timeout. Neither message says which rank or
which operation. This module adds that:

- ``register()`` (collective-free; called once the process group exists): this rank's host and pid
  go into the process group's store, so a survivor can tell which peers are dead;
- ``explain(error, where)``: for an error raised by a collective, one line naming this rank, what
  it was doing (``where``: the step and phase the caller knows), the collective it was waiting in
  and the ATen op that issued it (kept by the C++ runtime: ``_C.operation_in_flight()``), the
  operation it was in (the innermost frame of the traceback outside torch and hypershard: file,
  line and the source line),
  the ranks that are dead (same host: their pid is gone), and gloo's own message;
- ``note(text)``: what the rank is doing now (the training loop's step and phase);
- ``reporting(where)``: a context manager that re-raises a collective's error as a
  ``CollectiveError`` with that line (the original chained).

The timeout: ``collective_timeout(default)`` is ``HYPERSHARD_COLLECTIVE_TIMEOUT`` (seconds) when
set, else the caller's default (hypershard.sft: --timeout, 3600 s; LlamaFactory: HF's
``ddp_timeout``, 1800 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Optional

__all__ = ["CollectiveError", "TIMEOUT_ENV", "collective_timeout", "explain", "note", "register", "reporting"]

TIMEOUT_ENV = "HYPERSHARD_COLLECTIVE_TIMEOUT"
_KEY = "hypershard/faults/rank{rank}"
_PACKAGE_DIRS = (str(Path(__file__).resolve().parents[1]), str(Path(contextlib.__file__).resolve().parent))
# Words of the errors c10d / gloo raise when a collective fails (a peer gone, a timeout).
_COLLECTIVE_WORDS = (
    "gloo",
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out",
    "timed out",
    "DistBackendError",
    "NCCL",
    "ProcessGroup",
    "c10d",
)


_where = {"text": ""}  # what this rank is doing, as its training loop last noted it


def note(text: str) -> None:
    """Notes what this rank is doing now ("in step 3 of 8"): a failed collective's report says it."""
    _where["text"] = text


class CollectiveError(RuntimeError):
    """A collective failed; the message names the rank, the operation and the dead peers."""


def collective_timeout(default: float) -> float:
    """Seconds a collective waits for its peers: $HYPERSHARD_COLLECTIVE_TIMEOUT, else `default`."""
    value = os.environ.get(TIMEOUT_ENV)
    if not value:
        return float(default)
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"hypershard: {TIMEOUT_ENV}={value!r}; allowed: a number of seconds > 0") from None
    if seconds <= 0:
        raise ValueError(f"hypershard: {TIMEOUT_ENV}={value!r}; allowed: a number of seconds > 0")
    return seconds


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _store():
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def register() -> None:
    """Records this rank's host and pid in the process group's store (no collective)."""
    dist = _dist()
    store = _store() if dist else None
    if store is None:
        return
    try:
        store.set(_KEY.format(rank=dist.get_rank()), json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    except Exception:  # noqa: BLE001 -- diagnostics only: a run never fails for them
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child its parent has not reaped yet is a zombie: dead
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def dead_ranks(wait: float = 0.0) -> Optional[list]:
    """The ranks on this host whose process is gone (None when the store cannot tell). `wait`:
    seconds to keep looking while none is found -- a killed process closes its sockets (which
    fails its peers' collectives) a moment before it is gone."""
    dist = _dist()
    store = _store() if dist else None
    if store is None:
        return None
    host = socket.gethostname()
    pids = {}
    try:
        for rank in range(dist.get_world_size()):
            key = _KEY.format(rank=rank)
            if store.check([key]):
                info = json.loads(store.get(key))
                if info["host"] == host:
                    pids[rank] = int(info["pid"])
    except Exception:  # noqa: BLE001 -- the store lived in a dead rank: nothing to tell
        return None
    deadline = time.monotonic() + wait
    while True:
        dead = [rank for rank, pid in pids.items() if not _alive(pid)]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.02)


def is_collective_error(error: BaseException) -> bool:
    if isinstance(error, CollectiveError):
        return False  # already explained
    text = f"{type(error).__name__}: {error}"
    return any(word in text for word in _COLLECTIVE_WORDS)


def _operation(error: BaseException) -> str:
    """Where the failed collective was issued: the torch function the rank was in (the innermost
    torch frame: ``cross_entropy``, or the backward pass) and the innermost frame of the traceback
    outside torch, hypershard and contextlib (the model or user code line that called it)."""
    import torch

    torch_dir = str(Path(torch.__file__).resolve().parent)
    frames = traceback.extract_tb(error.__traceback__)
    user = inner_torch = None
    for frame in frames:
        path = str(Path(frame.filename).resolve())
        if path.startswith(torch_dir):
            inner_torch = frame
        elif not path.startswith(_PACKAGE_DIRS):
            user, inner_torch = frame, None
    parts = []
    if inner_torch is not None:
        name = inner_torch.name
        module = Path(inner_torch.filename).stem
        parts.append("the backward pass" if "backward" in name or module == "graph" else f"torch {module}.{name}")
    if user is not None:
        line = (user.line or "").strip()
        parts.append(f"{Path(user.filename).name}:{user.lineno} in {user.name}" + (f" `{line}`" if line else ""))
    return ", called from ".join(parts) if parts else "an unknown operation"


def _collective() -> str:
    """The collective this rank was waiting in and the ATen op that issued it, as the C++ runtime
    recorded them (runtime/in_flight.h: a collective that raised stays recorded until its thread
    issues the next one): "all_reduce over dp (8 bytes) of aten::sum.default"; "" when none."""
    try:
        from hypershard import _C

        record = _C.operation_in_flight()
    except Exception:  # noqa: BLE001 -- diagnostics only: a report never fails for them
        return ""
    if not record or not record.get("collective"):
        return ""
    text = record["collective"]
    if record.get("axis"):
        text += f" over {record['axis']}"
    if record.get("bytes") is not None:
        text += f" ({record['bytes']} bytes)"
    if record.get("op"):
        text += f" of {record['op']}"
    elif record.get("what"):
        text += f" of {record['what']}"
    return text


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def explain(error: BaseException, where: str = "") -> str:
    """One line: this rank, where, the operation, the dead peers, gloo's message."""
    dist = _dist()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    lost = any(word in str(error) for word in ("closed by peer", "reset by peer", "Broken pipe"))
    dead = dead_ranks(wait=1.0 if lost else 0.0)
    if dead:
        peers = f"rank {', '.join(map(str, dead))} is dead (its process is gone)"
    elif dead is None:
        peers = "a peer rank is dead or stopped issuing collectives (the store cannot tell which)"
    else:
        peers = (
            "no rank on this host is dead: a peer stopped issuing collectives (an exception it caught, "
            f"a deadlock) or another host failed; the timeout is ${TIMEOUT_ENV} or the launcher's"
        )
    kind = "timed out" if "imed out" in str(error) else "failed"
    place = f" {where}," if where else ""
    collective = _collective()
    waiting = f" waiting in {collective}," if collective else ""
    return (
        f"hypershard: rank {rank} of {world}: a collective {kind}{place}{waiting} in {_operation(error)}: {peers}; "
        f"{type(error).__name__}: {_first_line(error)}"
    )


@contextlib.contextmanager
def reporting(where: str = ""):
    """Re-raises an error of a failed collective as a CollectiveError that explains it."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 -- only collective errors are rewritten
        if not is_collective_error(error):
            raise
        raise CollectiveError(explain(error, where or _where["text"])) from error
