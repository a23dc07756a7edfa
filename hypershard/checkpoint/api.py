"""Sharded checkpoints of hypershard models through PyTorch's own distributed checkpoint (DCP).

``torch.distributed.checkpoint.save/load`` work on state dicts holding hypershard DTensors: every
DTensor answers DCP's three questions (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``) with this rank's shard and its GLOBAL offsets, so each rank writes only
its shard (a Replicate shard once: DCP keeps one of identical chunks) and a load into another mesh
reads the overlapping pieces of the saved chunks (resharding). Partial DTensors are refused (their
values are not the tensor's; reduce them first).

On top of DCP this module adds only what DCP lacks:

- ``save(directory, model, optimizer, step=..., extra=...)``: model and optimizer state (the
  optimizer's keyed by parameter NAME, so it loads into a differently built optimizer; an
  hs.offload_optimizer's host state is saved in its parameters' layouts, like the device
  optimizer's, so either resumes the other), every
  rank's RNG states and the caller's ``extra`` (data position, scheduler, ...), written into a
  temporary folder that becomes ``step_N`` -- with its COMPLETE marker -- only once every rank
  finished: a failure on one rank (a full disk) raises on every rank naming it, and a crash
  mid-save leaves only the temporary folder, which ``latest`` ignores.
- A ``hs.pipeline`` Pipeline is a model here too: its state dict is its rank's stages' slice of
  the full model's under the full model's names, so each pp rank writes its stages' entries (DCP's
  global plan takes every rank's keys; replicated chunks once) and a load into another split or a
  model without pp reads what it holds (the optimizer groups' parameter-name lists stay the
  loading model's: they are one saved value per group, which ranks of different stages differ on).
- ``latest(directory)``: the newest complete checkpoint. ``load(path, model, optimizer)`` loads in
  place (on any mesh; the optimizer's state is allocated first when it has none); on a folder of
  checkpoints it takes the newest complete one and logs the partial ones it skipped.
- ``export_hf(model, directory)``: a HuggingFace ``save_pretrained`` folder (safetensors files,
  index, config) written from the shards: one parameter is gathered at a time and each file is
  written by one rank, so no rank ever holds more than one file's tensors.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import _C

__all__ = [
    "export_hf",
    "latest",
    "load",
    "model_state_dict",
    "optimizer_state_dict",
    "partial_checkpoints",
    "read_extra",
    "resume_point",
    "save",
    "set_optimizer_state_dict",
]

COMPLETE = "COMPLETE"  # the marker file of a finished checkpoint (JSON: step, world, time)
_STEP_PREFIX = "step_"
_PARTIAL_SUFFIX = ".partial"  # save's temporary folder: .step_N.partial
_EXTRA = "extra.pt"
_RNG = "rng_rank{rank}.pt"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3  # export_hf: bytes per safetensors file (HF's default is 5 GB)


def _error(message: str) -> RuntimeError:
    return RuntimeError(f"hypershard: checkpoint: {message}")


# ---------------------------------------------------------------------------------- DCP protocol


def _chunk_of(tensor: torch.Tensor, fqn: Optional[str] = None):
    """This rank's chunk of a DTensor: offsets and sizes in GLOBAL coordinates."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    layout = _C.layout_of(tensor)
    if layout.has_partial():
        raise _error(
            f"{fqn or 'a DTensor'} is Partial ({layout}); a checkpoint holds values, so reduce "
            "it first (redistribute to Replicate or Shard); allowed: Shard and Replicate layouts"
        )
    position = _C.device_mesh_of(tensor).position
    offsets = torch.Size(layout.global_offset_at(position))
    sizes = torch.Size(layout.local_shape_at(position))
    return ChunkStorageMetadata(offsets=offsets, sizes=sizes)


def _create_write_items(self: torch.Tensor, fqn: str, obj: Any) -> list:
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    chunk = _chunk_of(self, fqn)
    return [
        WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk, properties=TensorProperties.create_from_tensor(_C.local_of(self)), size=self.size()
            ),
        )
    ]


def _create_chunk_list(self: torch.Tensor) -> list:
    return [_chunk_of(self)]


def _get_tensor_shard(self: torch.Tensor, index) -> torch.Tensor:
    # The local shard itself (no autograd): DCP reads into it in place when loading.
    chunk = _chunk_of(self, index.fqn)
    if index.offset is not None and torch.Size(index.offset) != chunk.offsets:
        raise _error(
            f"{index.fqn}: asked for the chunk at {tuple(index.offset)}, this rank holds the one at "
            f"{tuple(chunk.offsets)}"
        )
    return _C.local_of(self).detach()


def _install_dcp_protocol() -> None:
    # Methods only hypershard DTensors have (hasattr stays False on plain tensors, so DCP treats
    # those as before); torch's own DTensor class defines its own and is not affected.
    from ..tensor.dtensor import _DTensorMethod

    torch.Tensor.__create_write_items__ = _DTensorMethod("__create_write_items__", _create_write_items)
    torch.Tensor.__create_chunk_list__ = _DTensorMethod("__create_chunk_list__", _create_chunk_list)
    torch.Tensor.__get_tensor_shard__ = _DTensorMethod("__get_tensor_shard__", _get_tensor_shard)


_install_dcp_protocol()


# ---------------------------------------------------------------------------------- state dicts


def model_state_dict(model: torch.nn.Module) -> dict:
    """``model.state_dict()`` (DTensors stay sharded; DCP writes each rank's shards)."""
    return model.state_dict()


def _offloaded(optimizer: torch.optim.Optimizer) -> bool:
    """hs.offload_optimizer's: its param_groups hold host copies of the parameters' local shards,
    each standing for a model parameter (parameter_of), and its state_dict is in the parameters'
    layouts, so it saves and loads like the device optimizer's (docs/checkpoint.md)."""
    from ..fsdp.offload import OffloadedOptimizer

    return isinstance(optimizer, OffloadedOptimizer)


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """The names of the optimizer's parameters in the order optimizer.state_dict() numbers them."""
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    stands_for = optimizer.parameter_of if _offloaded(optimizer) else (lambda param: param)
    ordered = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            param = stands_for(param)
            if id(param) not in names:
                raise _error(
                    "the optimizer holds a parameter that is not one of the model's; pass the model "
                    "whose parameters it optimizes"
                )
            ordered.append(names[id(param)])
    return ordered


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with parameter NAMES in place of positions (as torch's
    get_optimizer_state_dict), so it loads into an optimizer built on another mesh or order."""
    names = _param_names(model, optimizer)
    state = optimizer.state_dict()
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def set_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Loads a state of optimizer_state_dict's form (names) into `optimizer`."""
    names = _param_names(model, optimizer)
    index = {name: i for i, name in enumerate(names)}
    missing = [name for group in state["param_groups"] for name in group["params"] if name not in index]
    if missing:
        raise _error(f"the optimizer state names parameters the model lacks: {missing[:5]}")
    optimizer.load_state_dict(
        {
            "state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [
                {**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]
            ],
        }
    )


def _allocate_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Gives every parameter without optimizer state its state (the layouts a step would create),
    so DCP has tensors to load into: one step with zero gradients and learning rate 0 on those
    parameters only (the others' gradients are set aside meanwhile, so their state is untouched).
    A zero step leaves parameters unchanged: AdamW multiplies by 1 - 0 * wd and adds 0.
    hs.offload_optimizer's host optimizer takes that step on its host copies (its own step would
    copy the device gradients over them)."""
    missing = [
        p for group in optimizer.param_groups for p in group["params"] if p.requires_grad and not optimizer.state.get(p)
    ]
    if not missing:
        return
    missing_ids = {id(p) for p in missing}
    saved_grads = {}
    saved_lrs = []
    try:
        for group in optimizer.param_groups:
            saved_lrs.append(group["lr"])
            group["lr"] = 0.0
            for p in group["params"]:
                saved_grads[id(p)] = (p, p.grad)
                p.grad = torch.zeros_like(p) if id(p) in missing_ids else None
        (optimizer.inner if _offloaded(optimizer) else optimizer).step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            group["lr"] = lr
        for p, grad in saved_grads.values():
            p.grad = grad


# ---------------------------------------------------------------------------------- save / load


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(directory, step: int) -> Path:
    return Path(directory) / f"{_STEP_PREFIX}{step:08d}"


def is_complete(path) -> bool:
    return (Path(path) / COMPLETE).is_file()


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def partial_dir(path) -> Path:
    """Where ``save`` writes the checkpoint `path` until every rank finished: ``.step_N.partial``
    next to it (hidden, and never named like a checkpoint), renamed to `path` once complete."""
    path = Path(path)
    return path.parent / f".{path.name}{_PARTIAL_SUFFIX}"


def _first_line(error: BaseException, limit: int = 400) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _failures(error: BaseException) -> list:
    """[(rank, first line of its error)]: DCP's CheckpointException and SaveError carry the
    failures of the ranks where they happened (every rank raises them); any other error is this
    rank's own."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return [
            (int(r), f if isinstance(f, str) else _first_line(f[0] if isinstance(f, tuple) else f))
            for r, f in sorted(failures.items())
        ]
    return [(_rank(), _first_line(error))]


class SaveError(RuntimeError):
    """A save failed on some ranks; raised on every rank. ``failures``: {rank: its error, one line}."""

    def __init__(self, message: str, failures: dict):
        super().__init__(message)
        self.failures = failures


def _agree(what: str, error: Optional[BaseException]) -> None:
    """Collective: every rank tells the others whether its part of `what` failed; if any did,
    every rank raises the same SaveError naming the ranks where it happened and the first one's
    error (a failure on one rank never leaves the others waiting in a later collective)."""
    if not dist.is_initialized() or _world() == 1:
        if error is not None:
            failed = dict(_failures(error))
            raise SaveError(f"hypershard: checkpoint: {what} failed: {failed[min(failed)]}", failed) from error
        return
    reports: list = [None] * _world()
    dist.all_gather_object(reports, None if error is None else _failures(error))
    failed = dict(pair for report in reports if report for pair in report)
    if failed:
        ranks = sorted(failed)
        raise SaveError(
            f"hypershard: checkpoint: {what} failed on rank {', '.join(map(str, ranks))} of {_world()}: "
            f"{failed[ranks[0]]}",
            failed,
        ) from error


def _write_marker(path: Path, marker: dict) -> None:
    """COMPLETE, atomically (the file exists whole or not at all) and durably (fsync'd)."""
    tmp = path / f".{COMPLETE}.tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(marker))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path / COMPLETE)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a directory
        pass
    finally:
        os.close(fd)


def save(
    directory,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    step: int,
    extra: Optional[dict] = None,
    keep: Optional[int] = None,
) -> Path:
    """Saves a sharded checkpoint to ``directory/step_{step:08d}`` and returns that path.

    Collective: every rank calls it. Atomic per checkpoint: every rank writes its shards (through
    DCP; a Replicate shard by one rank), its RNG states, and rank 0 the picklable `extra` (the same
    on every rank: data position, scheduler state, ...) into a temporary folder
    (``.step_N.partial``); once EVERY rank reported success, rank 0 writes the COMPLETE marker
    into it and renames it to ``step_N``. A failure on any rank (a full disk, a write error) makes
    every rank raise the same error naming the rank, and leaves no marker and no ``step_N``
    folder; a crash mid-save leaves only the temporary folder. ``latest`` and ``load`` see
    complete checkpoints only. An earlier folder of the same step is replaced once the new one is
    complete (a stale ``.step_N.partial`` of an earlier failed save is removed first). `keep`:
    delete all but the newest `keep` complete checkpoints afterwards."""
    import torch.distributed.checkpoint as dcp

    path = step_dir(directory, step)
    tmp = partial_dir(path)
    rank = _rank()
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)  # the part of an earlier save of this step that never finished
            tmp.mkdir(parents=True)
        except OSError as e:
            error = e
    _agree(f"saving step {step}: creating {tmp}", error)
    started = time.perf_counter()
    try:
        state = {"model": model_state_dict(model)}
        if optimizer is not None:
            state["optimizer"] = optimizer_state_dict(model, optimizer)
        dcp.save(state, checkpoint_id=str(tmp))
        torch.save(_rng_state(), tmp / _RNG.format(rank=rank))
        if rank == 0:
            torch.save(dict(extra or {}), tmp / _EXTRA)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException; every rank raises it below
        error = e
    _agree(f"saving step {step} into {tmp} (no {COMPLETE} marker was written)", error)
    if rank == 0:
        try:
            marker = {
                "step": step,
                "world_size": _world(),
                "optimizer": optimizer is not None,
                "seconds": round(time.perf_counter() - started, 3),
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            _write_marker(tmp, marker)
            replaced = None
            if path.exists():  # an earlier save of this step: set aside, removed once the new one is in place
                replaced = path.parent / f".{path.name}.replaced"
                if replaced.exists():
                    shutil.rmtree(replaced)
                (path / COMPLETE).unlink(missing_ok=True)
                os.replace(path, replaced)
            os.replace(tmp, path)  # atomic: step_N appears complete, or not at all
            _fsync_dir(path.parent)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            if keep is not None:
                for old in complete_checkpoints(directory)[:-keep] if keep > 0 else []:
                    if old != path:
                        (old / COMPLETE).unlink(missing_ok=True)
                        shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            error = e
    _agree(f"saving step {step}: completing {path}", error)
    return path


def _step_of(name: str) -> Optional[int]:
    if name.startswith(".") and name.endswith(_PARTIAL_SUFFIX):
        name = name[1 : -len(_PARTIAL_SUFFIX)]
    if name.startswith(_STEP_PREFIX) and name[len(_STEP_PREFIX) :].isdigit():
        return int(name[len(_STEP_PREFIX) :])
    return None


def complete_checkpoints(directory) -> list:
    """The complete checkpoint folders under `directory`, oldest step first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if not child.name.startswith(".") and _step_of(child.name) is not None and is_complete(child):
            found.append((_step_of(child.name), child))
    return [path for _, path in sorted(found)]


def incomplete_reason(path) -> Optional[str]:
    """Why `path` is not a complete checkpoint (None when it is one)."""
    path = Path(path)
    if is_complete(path):
        return None
    if path.name.endswith(_PARTIAL_SUFFIX):
        return f"a save that did not finish (its temporary folder; no {COMPLETE} marker)"
    if not path.is_dir():
        return "no such folder"
    return f"no {COMPLETE} marker: its save did not finish on every rank"


def partial_checkpoints(directory) -> list:
    """[(path, reason)] of the checkpoint folders under `directory` that are not complete (a save
    that failed or was killed), oldest step first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = _step_of(child.name)
        if step is not None and child.is_dir() and not is_complete(child):
            found.append((step, child.name, child))
    return [(path, incomplete_reason(path)) for _, _, path in sorted(found)]


def resume_point(directory) -> tuple:
    """(the newest complete checkpoint under `directory` or None, [(path, reason)] of the partial
    ones newer than it: what a resume skips)."""
    newest = latest(directory)
    floor = -1 if newest is None else _step_of(newest.name)
    skipped = [(p, why) for p, why in partial_checkpoints(directory) if _step_of(p.name) > floor]
    return newest, skipped


def skipped_message(newest, skipped: list, what: str = "resuming") -> str:
    """One line per skipped partial checkpoint, for the log of a resume."""
    target = f"from {newest}" if newest is not None else "from the start (no complete checkpoint)"
    return "\n".join(f"hypershard: checkpoint: {what} {target}; skipped {p}: {why}" for p, why in skipped)


def _log_skipped(newest, skipped: list) -> None:
    if skipped and _rank() == 0:
        print(skipped_message(newest, skipped), file=sys.stderr, flush=True)


def latest(directory) -> Optional[Path]:
    """The newest complete checkpoint under `directory` (None when there is none)."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def _looks_like_one_checkpoint(path: Path) -> bool:
    return _step_of(path.name) is not None or (path / ".metadata").is_file() or any(path.glob("rng_rank*.pt"))


def _resolve(path, log: bool = False) -> Path:
    """A complete checkpoint: `path` itself, or the newest complete one it holds. An explicit
    partial checkpoint is refused with the reason (never replaced by an older one silently)."""
    path = Path(path)
    if is_complete(path):
        return path
    if path.is_dir() and _looks_like_one_checkpoint(path):
        newest = latest(path.parent)
        raise _error(
            f"{path} is not a complete checkpoint: {incomplete_reason(path)}; the newest complete one "
            f"next to it is {newest}; allowed: a complete checkpoint, or the folder that holds them "
            "(the newest complete one is then used)"
        )
    newest, skipped = resume_point(path)
    if newest is None:
        reasons = "; ".join(f"{p.name}: {why}" for p, why in skipped)
        raise _error(
            f"{path} is not a complete checkpoint (no {COMPLETE} marker) and holds none"
            + (f" (partial ones: {reasons})" if reasons else "")
            + "; allowed: a folder written by hypershard.checkpoint.save, or one that holds such folders"
        )
    if log:
        _log_skipped(newest, skipped)
    return newest


def load(path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """Loads a checkpoint written by ``save`` into `model` (and `optimizer`) in place and returns
    its `extra`. `path`: a checkpoint folder, or a folder holding several (the newest COMPLETE
    one is used; rank 0 logs the partial ones it skipped, and why). A partial checkpoint named
    explicitly is refused with the reason. Collective. The model may be on another mesh than the
    one saved (DCP reads the pieces of the saved shards each rank needs); this rank's RNG states
    are restored when the world size is the saved one."""
    import torch.distributed.checkpoint as dcp

    path = _resolve(path, log=True)
    marker = json.loads((path / COMPLETE).read_text())
    if optimizer is not None and not marker.get("optimizer", False):
        raise _error(f"{path} holds no optimizer state; load it with optimizer=None")
    state = {"model": model_state_dict(model)}
    if optimizer is not None:
        _allocate_optimizer_state(optimizer)
        state["optimizer"] = optimizer_state_dict(model, optimizer)
    groups = [list(group["params"]) for group in state["optimizer"]["param_groups"]] if optimizer is not None else []
    dcp.load(state, checkpoint_id=str(path))
    # DCP loads tensors in place; non-tensor entries (step counts as ints, hyper-parameters) are
    # replaced in `state`, so the optimizer takes the whole loaded state -- except each group's
    # parameter names, which stay this model's: a group's name list is one saved value that ranks
    # holding different parameters (pipeline stages, on another mesh) do not share.
    if optimizer is not None:
        loaded = state["optimizer"]["param_groups"]
        if len(loaded) != len(groups):
            raise _error(f"{path} holds {len(loaded)} optimizer parameter groups, this optimizer has {len(groups)}")
        for group, names in zip(loaded, groups):
            group["params"] = names
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if marker["world_size"] == _world():
        _set_rng_state(torch.load(path / _RNG.format(rank=_rank()), weights_only=False))
    return torch.load(path / _EXTRA, weights_only=False)


def read_extra(path) -> dict:
    """The `extra` a checkpoint was saved with, without loading anything (not a collective):
    to check a resume's settings before the model is touched."""
    return torch.load(_resolve(path) / _EXTRA, weights_only=False)


def checkpoint_bytes(path) -> dict:
    """Bytes on disk of a checkpoint: 'total' and per DCP data file (one per writing rank)."""
    path = Path(path)
    files = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}
    return {"total": sum(files.values()), "files": files}


# ---------------------------------------------------------------------------------- HF export


def _export_names(model: torch.nn.Module, state: dict) -> list:
    """State-dict names to export: a tensor shared by several names (tied weights) once, under
    the name that is not one of the model's tied keys (what save_pretrained keeps)."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    tied = set(tied if not isinstance(tied, dict) else tied.keys())
    by_tensor: dict = {}  # state_dict() detaches, so shared tensors are told by their memory
    for name, tensor in state.items():
        local = _C.local_of(tensor) if _C.is_dtensor(tensor) else tensor
        key = (
            (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(tensor.shape), local.dtype)
            if local.numel()
            else name
        )  # empty tensors share no memory
        by_tensor.setdefault(key, []).append(name)
    keep = set()
    for names in by_tensor.values():
        untied = [n for n in names if n not in tied]
        keep.add((untied or names)[0])
    return [name for name in state if name in keep]


def _checkpoint_format(model: torch.nn.Module, tensors: dict) -> dict:
    """The tensors under the names and shapes of the model's checkpoint format: transformers 5
    fuses some weights when loading (MoE experts into one [experts, ...] tensor) and its
    save_pretrained splits them back (revert_weight_conversion); so does this export."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # another transformers: the model's own names
        return tensors
    if not isinstance(model, PreTrainedModel):
        return tensors
    return {name: tensor.contiguous() for name, tensor in revert_weight_conversion(model, tensors).items()}


def load_hf(directory, model: torch.nn.Module):
    """Loads a HuggingFace folder (export_hf's, or any save_pretrained one) into `model` in place:
    each rank reads only its shards' bytes (hypershard.checkpoint.pretrained.load_into; per-expert MoE keys
    into packed experts). To build a model from such a folder, use hs.from_pretrained."""
    from .pretrained import load_into

    return load_into(model, directory)


def export_hf(model: torch.nn.Module, directory, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Writes `model` as a HuggingFace ``save_pretrained`` folder (safetensors, plus the index
    when there are several files, config.json and generation_config.json when the model has
    them); ``from_pretrained(directory)`` loads it on one device. Collective.

    Written from the shards: the parameters are gathered one at a time, in the same order on
    every rank, and each file is written by one rank (file i by rank i mod world), which keeps
    only that file's tensors -- at most `max_shard_bytes` plus one gathered tensor per rank."""
    from safetensors.torch import save_file

    directory = Path(directory)
    rank, world = _rank(), _world()
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    names = _export_names(model, state)
    files: list = [[]]
    size = 0
    for name in names:
        nbytes = state[name].numel() * state[name].element_size()
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    count = len(files)
    file_names = (
        ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    _barrier()  # the folder exists before any rank writes into it
    written: dict = {}  # file name -> the keys this rank wrote into it
    with torch.no_grad():
        for index, members in enumerate(files):
            mine = index % world == rank
            tensors = {}
            for name in members:
                tensor = state[name]
                full = tensor.full_tensor() if _C.is_dtensor(tensor) else tensor  # a collective: every rank
                if mine:
                    tensors[name] = full.detach().contiguous().clone()
            if mine:
                tensors = _checkpoint_format(model, tensors)
                written[file_names[index]] = sorted(tensors)
                save_file(tensors, str(directory / file_names[index]), metadata={"format": "pt"})
    if world > 1:  # the key names each file holds (after the format conversion), for the index
        gathered: list = [None] * world
        dist.all_gather_object(gathered, written)
        written = {file: keys for part in gathered for file, keys in part.items()}
    if rank == 0:
        if count > 1:
            weight_map = {name: file for file in file_names for name in written[file]}
            total = sum(state[n].numel() * state[n].element_size() for n in names)
            (directory / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        config = getattr(model, "config", None)
        if config is not None:
            config.save_pretrained(directory)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            try:
                generation.save_pretrained(directory)
            except Exception:  # noqa: BLE001 -- an invalid generation config is the model's, not ours
                pass
    _barrier()
    return directory
