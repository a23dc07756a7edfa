"""Which ``checkpoint-N`` folder of a LlamaFactory run is complete, and resuming from the newest
complete one (docs/faults.md).

HF's Trainer writes ``checkpoint-N`` in place: the model's and optimizer's shards
(``hypershard/step_N``, itself atomic: hypershard.checkpoint.save), the scheduler, every rank's
RNG state and, on rank 0, ``trainer_state.json``. HyperParallelTrainer writes ``COMPLETE`` into the
folder last, once every rank reported its part written (a failure on one rank leaves no marker on
any). A folder without it is partial: a save that failed (a full disk) or was killed.

HF's ``get_last_checkpoint`` -- which LlamaFactory's automatic resume calls -- picks the
highest-numbered folder, partial or not. ``install_auto_resume`` (the launcher calls it) replaces
it, in LlamaFactory's argument parser only, by ``newest_complete``: the newest complete folder, with
the partial ones it skipped and why logged on rank 0. Nothing is ever deleted.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

MARKER = "COMPLETE"  # in checkpoint-N, written last (JSON: step, world size, time)
SHARDS_DIR = "hypershard"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def incomplete_reason(folder) -> Optional[str]:
    """Why a checkpoint-N folder is not complete (None when it is)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "no such folder"
    if (folder / MARKER).is_file():
        return None
    missing = []
    shards = folder / SHARDS_DIR
    from hypershard import checkpoint

    if not shards.is_dir() or checkpoint.latest(shards) is None:
        missing.append(f"complete model/optimizer shards ({SHARDS_DIR}/step_N/COMPLETE)")
    if not (folder / "trainer_state.json").is_file():
        missing.append("trainer_state.json")
    detail = f"; it lacks {' and '.join(missing)}" if missing else ""
    return f"no {MARKER} marker: its save did not finish on every rank{detail}"


def _numbered(output_dir) -> list:
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _CHECKPOINT.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def newest_complete(output_dir) -> tuple:
    """(the newest complete checkpoint-N under `output_dir` or None, [(path, reason)] of the
    partial ones newer than it)."""
    skipped = []
    for path in reversed(_numbered(output_dir)):
        reason = incomplete_reason(path)
        if reason is None:
            return path, list(reversed(skipped))
        skipped.append((path, reason))
    return None, list(reversed(skipped))


def skipped_message(newest, skipped: list) -> str:
    target = f"resuming from {newest}" if newest is not None else "no complete checkpoint to resume from"
    return "\n".join(f"hypershard: llamafactory: {target}; skipped {p}: {why}" for p, why in skipped)


def _is_rank0() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def log_skipped(newest, skipped: list) -> None:
    if skipped and _is_rank0():
        print(skipped_message(newest, skipped), file=sys.stderr, flush=True)


def get_last_checkpoint(folder) -> Optional[str]:
    """HF's get_last_checkpoint, complete checkpoints only (the partial ones skipped are logged)."""
    newest, skipped = newest_complete(folder)
    log_skipped(newest, skipped)
    return None if newest is None else str(newest)


def install_auto_resume() -> None:
    """LlamaFactory's automatic resume (hparams.parser) takes the newest COMPLETE checkpoint."""
    import llamafactory.hparams.parser as parser

    parser.get_last_checkpoint = get_last_checkpoint


def write_marker(folder, step: int, world: int) -> None:
    """checkpoint-N/COMPLETE, atomically (rank 0, after every rank finished its part)."""
    folder = Path(folder)
    tmp = folder / f".{MARKER}.tmp"
    with open(tmp, "w") as fh:
        fh.write(
            json.dumps({"step": step, "world_size": world, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        )
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MARKER)


def resolve(resume_from_checkpoint, output_dir):
    """What HF's train should resume from: True -> the newest complete checkpoint-N of `output_dir`
    (the partial ones skipped are logged); a path to a partial checkpoint -> refused with the reason
    (HyperParallelConfigError, the same on every rank, before any collective); anything else as is."""
    from .args import HyperParallelConfigError

    if resume_from_checkpoint is True:
        newest, skipped = newest_complete(output_dir)
        log_skipped(newest, skipped)
        if newest is None:
            why = "".join(f"; skipped {p.name}: {reason}" for p, reason in skipped)
            raise HyperParallelConfigError(
                f"hypershard: llamafactory: resume_from_checkpoint=True: no complete checkpoint in {str(output_dir)!r}{why}"
            )
        return str(newest)
    if isinstance(resume_from_checkpoint, (str, Path)) and Path(resume_from_checkpoint).is_dir():
        reason = incomplete_reason(resume_from_checkpoint)
        if reason is not None:
            newest, _ = newest_complete(Path(resume_from_checkpoint).resolve().parent)
            raise HyperParallelConfigError(
                f"hypershard: llamafactory: resume_from_checkpoint {str(resume_from_checkpoint)!r} is a partial "
                f"checkpoint ({reason}); allowed: a complete checkpoint (the newest next to it: {newest}), or "
                "resume_from_checkpoint unset in the output_dir (LlamaFactory then resumes from the newest complete one)"
            )
    return resume_from_checkpoint
