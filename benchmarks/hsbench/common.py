"""Helpers every section uses: medians, ratios, error text, and the argument specs the per-op
sections (dispatch, fallback) build their tensors from."""

from __future__ import annotations

import math
import statistics
from typing import Callable, Optional

# A Qwen3 of 7.6 M parameters (and the --quick cut of it, about 1 M) whose sharded training state
# the checkpoint and fully_shard sections measure on 4 CPU ranks: one table, so both sections'
# figures describe the same model.
QWEN3_7M_CONFIG = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=32,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
QWEN3_7M_QUICK_CONFIG = dict(
    QWEN3_7M_CONFIG,
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
)


def summary(samples: list) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def geomean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 800 else text[:150] + " ... " + text[-650:]  # a traceback ends with the cause


def launch_section(log: Callable, worker: Callable, world: int, settings: dict, timeout: float) -> dict:
    """Rank 0's result of `worker` run on `world` spawned ranks, the launch's time logged; a
    failure is logged and returned as {"error": text}, as every section reports one."""
    import time

    from hypershard.launch import spawn_local_ranks

    start = time.perf_counter()
    try:
        ranks = spawn_local_ranks(worker, world, settings, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 -- a section's failure is reported, not raised
        log(f"  failed: {error_text(exc)}")
        return {"error": error_text(exc)}
    log(f"  done in {time.perf_counter() - start:.0f} s")
    return ranks[0]


def mesh_text(spec) -> str:
    return " x ".join(f"{n}={s}" for s, n in zip(*spec))


# An op's arguments: ("tensor", shape, placement under the Shard variant) or ("list", count,
# shape, placement) or ("target", shape, classes, placement) or ("index", shape, high, placement)
# (int64 indices in [0, high)) or ("offs", ends, placement) (int32 cumulative group ends, as
# _grouped_mm's offs); a placement is a Shard dim or None (Replicate). The Replicate variant makes
# every argument Replicate.


def global_args(spec: list, seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)  # the same values on every rank
    out = []
    for item in spec:
        if item[0] == "tensor":
            out.append(torch.randn(*item[1], generator=g))
        elif item[0] == "list":
            out.append([torch.randn(*item[2], generator=g) for _ in range(item[1])])
        elif item[0] == "index":
            out.append(torch.randint(0, item[2], item[1], generator=g))
        elif item[0] == "offs":
            out.append(torch.tensor(item[1], dtype=torch.int32))
        else:  # class targets, about a quarter of them ignored (-100), as in HF labels
            target = torch.randint(0, item[2], item[1], generator=g)
            target[torch.rand(item[1], generator=g) < 0.25] = -100
            out.append(target)
    return out


def placed_args(spec: list, values: list, shard: bool, make: Callable) -> list:
    """make(tensor, dim or None) -> the implementation's tensor for one argument."""
    out = []
    for item, value in zip(spec, values):
        dim = item[-1] if shard else None
        if item[0] == "list":
            out.append([make(v, dim) for v in value])
        else:
            out.append(make(value, dim))
    return out


def full_value(x):
    """The global value of a result: DTensors (hypershard's or torch's) gathered, lists item by item."""
    from torch.distributed.tensor import DTensor as TorchDTensor

    import hypershard as hs

    if isinstance(x, list):
        return [full_value(v) for v in x]
    if isinstance(x, (hs.DTensor, TorchDTensor)):  # (hypershard gives every Tensor a raising full_tensor)
        return x.full_tensor()
    return x


def same_values(a, b, atol: float = 1e-5) -> bool:
    import torch

    if isinstance(a, list):
        return all(same_values(x, y, atol) for x, y in zip(a, b))
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=atol)


def rank0_per_world(
    section: str, worker: Callable, worlds, args, log: Callable, extra: dict, worker_args: Optional[dict] = None
) -> dict:
    """{world: rank 0's result of worker} for each world size, the ranks spawned with the section's
    timing settings (and worker_args); a launch that fails is logged and recorded as
    extra["<world>rank_error"], the seconds each took as extra["<world>rank_seconds"]."""
    import time

    from hypershard.launch import spawn_local_ranks

    results = {}
    for world in worlds:
        log(f"{section}: {world}-rank mesh ...")
        start = time.perf_counter()
        try:
            ranks = spawn_local_ranks(
                worker,
                world,
                {"sample_s": args.sample_s, "repeats": args.repeats, **(worker_args or {})},
                timeout=args.timeout,
            )
        except Exception as exc:  # noqa: BLE001 -- reported in the results, the other worlds still run
            extra[f"{world}rank_error"] = error_text(exc)
            log(f"  failed: {error_text(exc)}")
            continue
        results[world] = ranks[0]
        extra[f"{world}rank_seconds"] = time.perf_counter() - start
    return results
