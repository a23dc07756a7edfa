"""Section "memory": peak RSS growth and parameter + gradient + optimizer-state bytes per rank
of a larger Qwen3 config, hypershard vs torch DTensor vs one device. It runs at the end of the
step launches (training.py) in the same rank processes."""

from __future__ import annotations

import ctypes
import gc

from .common import error_text, mesh_text, ratio
from .trainers import HypershardTrainer, SingleTrainer, TorchTPTrainer, lr_at, state_bytes

MEMORY_CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=32,
)


def vm_kib(field: str) -> int:
    """A /proc/self/status value in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def set_mmap_threshold(size: int) -> None:
    """A fixed glibc mmap threshold: big blocks are mmapped and go back to the OS when freed, so
    RSS follows what is live (the default threshold adapts upward after frees)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, size)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def measure_memory(rank: int, mesh_spec, steps: int) -> dict:
    """Peak RSS growth and state bytes per rank over `steps` training steps of the larger
    MEMORY_CONFIG model, for each implementation in turn in this process (one device on rank 0
    while the other ranks wait). The baseline is taken after the model is built and parallelized,
    with garbage collected and free heap memory returned to the OS."""
    import torch.distributed as dist

    from hypershard.testing.models import make_batches, tiny_config

    set_mmap_threshold(65536)
    config = tiny_config("qwen3", **MEMORY_CONFIG)
    batches = make_batches(config.vocab_size, 2, batch=4, seq=32)
    out: dict = {}
    for impl in ("hypershard", "torch_dtensor", "single_device"):
        gc.collect()
        malloc_trim()
        dist.barrier()
        if impl == "single_device" and rank != 0:
            continue
        trainer = None
        try:
            if impl == "hypershard":
                trainer = HypershardTrainer(config, mesh_spec)
            elif impl == "torch_dtensor":
                trainer = TorchTPTrainer(config, mesh_spec)
            else:
                trainer = SingleTrainer(config)
            gc.collect()
            malloc_trim()
            baseline = vm_kib("VmRSS")
            exact = reset_peak_rss()
            for step in range(steps):
                trainer.step(*batches[step % len(batches)], lr_at(step, steps))
            peak = vm_kib("VmHWM")
            out[impl] = {
                "rss_after_build_mb": baseline / 1024,
                "peak_rss_mb": peak / 1024,
                "peak_growth_mb": (peak - baseline) / 1024 if exact else None,
                "state": state_bytes(trainer.params, trainer.optimizers),
            }
        except Exception as exc:  # noqa: BLE001 (every rank raises alike)
            out[impl] = {"error": error_text(exc)}
        finally:
            del trainer
    dist.barrier()
    return out


def memory_summary(ranks: list, mesh_spec) -> dict:
    entry: dict = {"mesh": mesh_text(mesh_spec)}
    single = ranks[0]["memory"].get("single_device", {})
    for impl in ("hypershard", "torch_dtensor"):
        rows = [r["memory"].get(impl, {}) for r in ranks]
        errors = [row["error"] for row in rows if "error" in row]
        if errors:
            entry[f"{impl}_error"] = errors[0]
            continue
        growth = [row["peak_growth_mb"] for row in rows if row.get("peak_growth_mb") is not None]
        entry[f"{impl}_peak_mb"] = max(growth) if growth else None
        entry[f"{impl}_peak_mb_per_rank"] = [row.get("peak_growth_mb") for row in rows]
        entry[f"{impl}_state_mb"] = max(row["state"]["total_mb"] for row in rows)
        entry[f"{impl}_state_rank0"] = rows[0]["state"]
        entry[f"{impl}_rss_after_build_mb_rank0"] = rows[0]["rss_after_build_mb"]
    if "error" in single:
        entry["single_device_error"] = single["error"]
    entry["single_device_peak_mb"] = single.get("peak_growth_mb")
    entry["single_device_state_mb"] = single.get("state", {}).get("total_mb")
    entry["single_device_state"] = single.get("state")
    for impl in ("hypershard", "torch_dtensor"):
        entry[f"{impl}_peak_vs_single"] = ratio(entry.get(f"{impl}_peak_mb"), entry["single_device_peak_mb"])
        entry[f"{impl}_state_vs_single"] = ratio(entry.get(f"{impl}_state_mb"), entry["single_device_state_mb"])
    return entry
