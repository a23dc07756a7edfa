"""The planner's run (one simulated rank) and its validation run (real ranks, measured).

Both run `step.train_step` on the same model, mesh and batch; the planner on meta tensors over a
simulated mesh (world.py), counting storages (memory.py); the validation on real tensors over
gloo, reading the process's resident memory. Their figures are compared in
tests/python/level1/test_planner.py.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional

import torch

from .. import _C
from .memory import LiveBytes
from .step import build_model, make_batch, shard_model, state_bytes, train_step
from .world import recording, simulated_mesh

__all__ = ["PlanReport", "apply_options", "measure_rank", "plan_step"]


@dataclass
class PlanReport:
    """One rank's figures for one training step (bytes)."""

    model: str = ""
    mesh: dict = field(default_factory=dict)
    rank: int = 0
    coordinates: dict = field(default_factory=dict)
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0  # peak of everything else alive during the step (see memory.py)
    forward_backward_peak: int = 0  # peak above the parameters from forward to the end of backward, grads included
    optimizer_growth: int = 0  # live bytes added by clip + AdamW's step (its state, mostly)
    peak: int = 0  # parameters + the peak of everything the step holds
    axis_bytes: dict = field(default_factory=dict)  # mesh axis -> bytes sent
    collectives: dict = field(default_factory=dict)  # "axis kind" -> count
    collective_bytes: dict = field(default_factory=dict)  # "axis kind" -> bytes
    phase_bytes: dict = field(default_factory=dict)  # "phase axis" -> bytes
    traffic_bytes: int = 0  # hypershard._C.traffic() growth over the step
    uncounted: int = 0
    total_parameters: int = 0  # of the whole model (elements)
    seconds: dict = field(default_factory=dict)
    issuers: list = field(default_factory=list)  # with trace: [axis, kind, line, bytes], largest first
    device: str = "cpu"  # whose kernels were planned (world.recording)
    recompute: str = "none"
    cp_algorithm: str = ""
    flops: int = 0  # this rank's floating-point operations over the step (memory.LiveBytes)
    phase_flops: dict = field(default_factory=dict)  # "forward" / "backward" / "optimizer" -> flops
    kernels: dict = field(default_factory=dict)  # "sdpa <backend>" -> calls
    cp_calls: dict = field(default_factory=dict)  # cp attention calls per algorithm that ran them
    peak_optimizer_offloaded: int = 0  # the peak with the optimizer state on the host (never on the device)
    offload: int = 0  # with the optimizer offloaded (plan.py --offload-optimizer): host-device bytes per step
    # For the pp axis (planner/pipeline.py): what one microbatch's pass through the decoder layers
    # leaves alive (live bytes after the last layer's forward minus before the first's), the share
    # of forward FLOPs spent in the decoder layers, and this rank's bytes of the parameters outside
    # the layers by where a pipeline puts them ("embed": the first stage; "head": the last).
    layer_activations: int = 0
    layer_flops_share: float = 1.0
    root_state: dict = field(default_factory=dict)  # "embed" / "head" / "both" (tied) -> {class: bytes}
    seq: int = 0  # tokens per sequence planned
    pp: dict = field(default_factory=dict)  # a pp plan's schedule, stages and bubble (pipeline.py)

    def over(self, memory_per_rank: float) -> list:
        """The classes that do not fit `memory_per_rank` bytes, largest first: each class's share
        is named when the sum exceeds the budget; a class alone larger than it is 'over'."""
        classes = {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
        }
        if self.offload:
            del classes["optimizer"]  # on the host
        if self.peak <= memory_per_rank:
            return []
        return sorted(classes, key=lambda k: -classes[k])

    def to_dict(self) -> dict:
        return asdict(self)


def apply_options(report: PlanReport, offload: bool = False) -> PlanReport:
    """The setting modelled from a plan rather than planned (docs/planner.md, "The library's axes"):
    with `offload` the AdamW state lives on the host and the step runs there: the device peak is the
    plan's peak without the optimizer state's storages (planned exactly), and every step moves the
    gradients down and the parameters back up (their bytes, at the host link)."""
    if offload:
        report.peak = report.peak_optimizer_offloaded
        report.offload = report.gradients + report.parameters
    return report


class _Resyncing:
    """A fully_shard group's C++ half (``cgroup``) that re-reads the live storages' sizes after each
    call: its gathers and frees resize storages in place (see LiveBytes.resync)."""

    def __init__(self, cgroup, live: LiveBytes):
        self._cgroup, self._live = cgroup, live

    def __getattr__(self, name):
        value = getattr(self._cgroup, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            out = value(*args, **kwargs)
            if isinstance(out, (list, tuple)):
                for t in out:
                    if isinstance(t, torch.Tensor):
                        self._live.see(t)
            self._live.resync()
            return out

        return call


def _watch_fully_shard(model, live: LiveBytes) -> None:
    for module in model.modules():
        group = getattr(module, "_hs_fully_shard", None)
        if group is not None and not isinstance(group.cgroup, _Resyncing):
            group.cgroup = _Resyncing(group.cgroup, live)


def _step_figures(report: PlanReport, model, optimizer, live: LiveBytes) -> None:
    counted = state_bytes(model, optimizer)
    report.parameters, report.gradients, report.optimizer = counted.parameters, counted.gradients, counted.optimizer
    state = live.births(counted.keys["gradients"] | counted.keys["optimizer"])
    report.activations = live.peak(exclude=state, start="forward", end="end")
    report.forward_backward_peak = live.peak(start="forward", end="optimizer")
    at_optimizer = live.peak(start="optimizer", end="optimizer")
    at_end = live.peak(start="end", end="end")
    report.optimizer_growth = at_end - at_optimizer
    report.peak = report.parameters + live.peak(start="forward", end="end")
    report.peak_optimizer_offloaded = report.parameters + live.peak(
        exclude=live.births(counted.keys["optimizer"]), start="forward", end="end"
    )
    if "layers" in live.marks and "head" in live.marks:
        report.layer_activations = live.peak(start="head", end="head") - live.peak(start="layers", end="layers")
        forward = live.flops_at.get("backward", live.flops) - live.flops_at.get("forward", 0)
        layers = live.flops_at["head"] - live.flops_at["layers"]
        report.layer_flops_share = layers / forward if forward else 1.0
    report.root_state = _root_state(model, optimizer)
    marks = live.flops_at
    order = ["forward", "backward", "optimizer", "end"]
    report.phase_flops = {a: marks.get(b, live.flops) - marks.get(a, 0) for a, b in zip(order, order[1:])}
    report.flops = live.flops


# Parameters outside the decoder layers, by the pipeline stage that holds them (pipeline.py): the
# embeddings (and a vision tower: its features enter at the first stage) on the first; the final
# norm and the LM head on the last. A tied embedding is one parameter in both.
_ROOT_PLACES = (("embed", ("embed", "visual", "vision")), ("head", ("lm_head", "norm")))


def _root_state(model, optimizer) -> dict:
    """{"embed" | "head" | "both": {"parameters", "gradients", "optimizer": bytes}}: this rank's bytes
    of the parameters outside the decoder layers, by the stages that hold them ("both": a tied
    embedding, on the first and the last)."""
    from ..parallel.recompute import decoder_layers

    inside = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    where: dict = {}  # id -> (parameter, the places its names put it)
    for name, p in model.named_parameters(remove_duplicate=False):  # a tied parameter under each name
        if id(p) in inside:
            continue
        path = name.rsplit(".", 1)[0]
        place = next((place for place, words in _ROOT_PLACES if any(w in path for w in words)), "embed")
        where.setdefault(id(p), (p, set()))[1].add(place)
    out = {}
    for place in ("embed", "head", "both"):
        params = [
            p
            for p, places in where.values()
            if (places == {"embed", "head"}) == (place == "both") and (place == "both" or places == {place})
        ]
        state = [v for p in params for v in (optimizer.state.get(p, {}).values() if optimizer is not None else ())]
        out[place] = {
            "parameters": _unique(params),
            "gradients": _unique(p.grad for p in params),
            "optimizer": _unique(state),
        }
    return out


def _unique(tensors) -> int:
    """Bytes of these tensors' local elements (not their storages': gradients are views of the
    data-parallel buckets, one storage for many parameters)."""
    from .memory import local_tensor

    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            local = local_tensor(t)
            total += local.numel() * local.element_size()
    return total


def _mark_layers(model, phase) -> list:
    """Forward hooks that mark the timeline "layers" before the first decoder layer runs (before
    fully_shard gathers it) and "head" after the last one (after it freed its gathered parameters),
    once per step: between them one microbatch's pass through the layers (pipeline.py)."""
    from ..parallel.recompute import decoder_layers

    layers = decoder_layers(model)
    if not layers:
        return []
    seen = set()

    def once(name):
        def hook(*_):
            if name not in seen:
                seen.add(name)
                phase(name)

        return hook

    return [
        layers[0].register_forward_pre_hook(once("layers"), prepend=True),
        layers[-1].register_forward_hook(once("head")),
    ]


def plan_step(
    config,
    shape: Mapping[str, int],
    *,
    name: str = "",
    rank: int = 0,
    fully_shard: bool = False,
    batch: int = 1,
    seq: int = 4096,
    dtype: torch.dtype = torch.float32,
    compute_dtype: Optional[torch.dtype] = None,
    trace: bool = False,
    device: str = "cpu",
    recompute: str = "none",
    cp_algorithm: str = "all_gather_kv",
) -> PlanReport:
    """One training step of `config`'s model on a simulated mesh of `shape`, as rank `rank` sees it.
    `batch`: sequences per step in all (split over dp); `seq`: tokens per sequence; `device`: whose
    kernels the step takes (world.recording); `recompute`: step.apply_recompute's mode;
    `cp_algorithm`: attention's algorithm on a "cp" axis."""
    from .world import coordinates

    times = {}
    t0 = time.perf_counter()
    mesh = simulated_mesh(shape, rank)
    model = build_model(config, "meta", dtype)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    times["build"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    shard_model(model, mesh, fully_shard, compute_dtype, cp_algorithm, recompute)
    times["shard"] = time.perf_counter() - t0
    report = PlanReport(
        model=name,
        mesh=dict(shape),
        rank=rank,
        total_parameters=total,
        coordinates=dict(zip(shape, coordinates(shape, rank))),
        device=device,
        recompute=recompute,
        cp_algorithm=cp_algorithm if "cp" in shape else "",
        seq=seq,
    )
    ids = make_batch(config, batch, seq, "meta")
    live = LiveBytes()
    live.know(list(model.parameters()) + list(model.buffers()) + list(ids))
    _watch_fully_shard(model, live)
    t0 = time.perf_counter()
    # The garbage collector frees storages held in reference cycles when its allocation counters
    # say so: collected here, a plan's step starts from the same counters whatever ran before it
    # in the process (without it, a plan's peak depended on the plans run earlier).
    gc.collect()
    before = _C.traffic()["bytes_sent"]
    cp_before = dict(_C.cp_attention_calls())
    with recording(trace, device) as log, live:

        def phase(name):
            live.mark(name)
            log.phase = name

        def mark(name):
            live.mark(name)

        hooks = _mark_layers(model, mark)
        try:
            optimizer = train_step(model, ids, phase)
        finally:
            for h in hooks:
                h.remove()
    times["step"] = time.perf_counter() - t0
    report.traffic_bytes = _C.traffic()["bytes_sent"] - before
    report.cp_calls = {
        k: n - cp_before.get(k, 0) for k, n in dict(_C.cp_attention_calls()).items() if n - cp_before.get(k, 0)
    }
    report.kernels = dict(log.kernels)
    _step_figures(report, model, optimizer, live)
    report.axis_bytes = log.axis_bytes()
    report.collectives = {f"{a} {k}": n for (a, k), n in sorted(log.counts.items())}
    report.collective_bytes = {f"{a} {k}": n for (a, k), n in sorted(log.bytes.items())}
    report.phase_bytes = {f"{p} {a}": n for (p, a), n in sorted(log.by_phase.items())}
    report.uncounted = log.uncounted
    report.issuers = [[a, k, where, n] for (a, k, where), n in log.where.most_common()]
    report.seconds = times
    return report


# ------------------------------------------------------------------------------------ measurement


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _page()


def _page() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")


def _high_water() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_high_water() -> None:
    # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current one.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure_rank(
    rank: int,
    world: int,
    config_values: dict,
    shape: dict,
    fully_shard: bool,
    batch: int,
    seq: int,
    recompute: str = "none",
    cp_algorithm: str = "all_gather_kv",
) -> dict:
    """A real step on a gloo mesh (run by hypershard.launch.spawn_local_ranks, with
    MALLOC_MMAP_THRESHOLD_ fixed so every large tensor is its own mapping and freeing it shrinks the
    resident set): counted bytes, resident-set growth over each phase, hypershard's traffic."""
    import gc

    import hypershard as hs

    from .step import load_config

    config = load_config(config_values.pop("name"), **config_values)
    mesh = hs.init_device_mesh("cpu", list(shape.values()), list(shape))
    ids = make_batch(config, batch, seq, "cpu")
    # A whole warm-up run first, on a model then dropped: it takes what a process allocates once
    # (thread pools, BLAS and gloo buffers, hypershard's plan caches). The measured step is the
    # first of a fresh model, as the planner's (a later step starts from the previous one's
    # gradients and optimizer state).
    warm = shard_model(build_model(config, "cpu"), mesh, fully_shard, None, cp_algorithm, recompute)
    train_step(warm, ids)
    del warm
    gc.collect()
    model = shard_model(build_model(config, "cpu"), mesh, fully_shard, None, cp_algorithm, recompute)
    gc.collect()
    marks = {}

    def phase(name):
        gc.collect()
        marks[name] = (_resident(), _high_water())
        _reset_high_water()

    _C.reset_traffic()
    optimizer = train_step(model, ids, phase)
    traffic = _C.traffic()["bytes_sent"]
    counted = state_bytes(model, optimizer)
    forward = marks["forward"][0]
    return {
        "parameters": counted.parameters,
        "gradients": counted.gradients,
        "optimizer": counted.optimizer,
        "forward_backward_peak": max(marks["optimizer"][1], marks["backward"][1]) - forward,
        "gradients_rss": marks["optimizer"][0] - forward,
        "optimizer_growth": marks["end"][0] - marks["optimizer"][0],
        "traffic_bytes": traffic,
    }
