"""`python -m hypershard.plan --search`: the meshes of N ranks, pruned, planned, ranked by an
estimated step time (docs/planner.md, "Search").

1. Candidates: every mesh dp x cp x ep x tp = N (axes of size 1 dropped) with fully_shard off, HSDP
   (dp split into dp_replicate=R x dp=dp/R, fully sharded over the dp/R, for every R >= 2 dividing dp
   with dp/R >= 2) or fully_shard over dp, and recomputation none / selective / full.
2. Pruned without planning, each with its reason: tp that does not divide the query and KV heads or
   exceeds a node; ep that does not divide the routed experts (ep > 1 on a model without experts);
   cp that does not divide the sequence into 2 x cp chunks; and a training state (fp32 parameter,
   gradient, AdamW m and v: 16 bytes per parameter) whose LOWER bound per rank (expert parameters
   / (ep x dp when fully sharded), the rest / (tp x dp when fully sharded)) already exceeds the
   budget.
3. Planned in order of cost: sharding and recomputation only add communication and compute, so
   a mesh is planned with the cheapest setting first (no fully_shard, no recomputation) and the next
   only when the cheaper one does not fit: HSDP from the most replicas to the fewest (per rank it
   sends 3 P - P / (dp/R) - 2 P / dp bytes for P local parameter bytes: from plain data
   parallelism's 2 P (1 - 1/dp) at R = dp up to fully_shard's 3 P (1 - 1/dp) at R = 1), then
   fully_shard; within each, selective then full recomputation.
   A cut-depth plan's peak bounds the full depth's from below: a mesh over the budget at the first
   cut depth with full recomputation is reported over without planning more of it.
4. Each plan is of a cut-depth model (`depths`: a few layers), scaled to the full depth per layer:
   figure(L) = figure(d1) + (L - d1) x (figure(d2) - figure(d1)) / (d2 - d1). `check_linear` plans a
   third depth and reports how far it is from the line (docs: measured).
5. The time model (`estimate`) and the ranked table (`format_table`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from .step import REPLICATE_AXIS, data_parallel

__all__ = [
    "HARDWARE",
    "Candidate",
    "Hardware",
    "LINEAR_FIGURES",
    "axis_links",
    "candidates",
    "cut_depths",
    "estimate",
    "format_table",
    "hsdp_meshes",
    "pipeline_estimate",
    "scale_report",
    "search",
]


@dataclass(frozen=True)
class Hardware:
    """Published peak figures of one accelerator and its links (docs/planner.md cites each)."""

    name: str
    tflops: float  # dense bf16 / fp16 tensor throughput, TFLOP/s
    intra_gbs: float  # GB/s one rank sends inside a node (one direction)
    inter_gbs: float  # GB/s one rank sends to other nodes (one direction)
    node_size: int  # ranks per node
    host_gbs: float  # GB/s between device and host memory (optimizer offload)
    memory_gb: float


HARDWARE = {
    # NVIDIA H100 SXM5: 989 TFLOPS bf16 dense (1,979 with sparsity), NVLink 4 900 GB/s both
    # directions, one 400 Gb/s ConnectX-7 NIC per GPU in a DGX H100 (50 GB/s), PCIe Gen5 x16 64 GB/s.
    "h100": Hardware("NVIDIA H100 SXM", 989.0, 450.0, 50.0, 8, 64.0, 80.0),
    # NVIDIA H200 SXM: the H100's compute and links with 141 GB of HBM3e.
    "h200": Hardware("NVIDIA H200 SXM", 989.0, 450.0, 50.0, 8, 64.0, 141.0),
    # Ascend 910B (Atlas 800T A2 node of 8): ~320 TFLOPS fp16, HCCS 392 GB/s inside the node,
    # 200 GbE RoCE per NPU (25 GB/s), PCIe Gen4 x16 32 GB/s, 64 GB HBM2e.
    "910b": Hardware("Huawei Ascend 910B", 320.0, 196.0, 25.0, 8, 32.0, 64.0),
}

# Figures of a PlanReport that the cut-depth model scales per layer (everything but timings).
LINEAR_FIGURES = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "forward_backward_peak",
    "optimizer_growth",
    "peak",
    "traffic_bytes",
    "flops",
    "total_parameters",
)
_NAME = 42  # the mesh column's width: "dp_replicate=2,dp=16,ep=8 fs rc=selective" fits
AXES = ("dp", "cp", "ep", "tp")  # mesh order: tp fastest (inside a node), dp slowest; pp before dp


@dataclass
class Candidate:
    mesh: dict  # axis -> size, in AXES order, sizes > 1 only
    fully_shard: bool = False
    recompute: str = "none"
    pruned: str = ""  # why it was not planned ("" when planned)
    report: object = None  # the scaled PlanReport (a pp mesh's: its stage of largest peak, not scaled)
    estimate: dict = field(default_factory=dict)
    linear: Optional[float] = None  # largest relative distance of a third depth from the line

    @property
    def name(self) -> str:
        mesh = ",".join(f"{a}={n}" for a, n in self.mesh.items()) or "one rank"
        if self.report is not None and getattr(self.report, "pp", None):
            mesh += f" {self.report.pp['schedule']} m{self.report.pp['microbatches']}"
        return (
            mesh + (" fs" if self.fully_shard else "") + ("" if self.recompute == "none" else f" rc={self.recompute}")
        )


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(world: int, pp: int = 1) -> list:
    """Every dp x cp x ep x tp = world / pp, as {axis: size} with sizes > 1 in AXES order (pp first,
    the slowest: stages across nodes)."""
    out = []
    if world % pp:
        return out
    world //= pp
    head = {"pp": pp} if pp > 1 else {}
    for tp in _divisors(world):
        for ep in _divisors(world // tp):
            for cp in _divisors(world // tp // ep):
                dp = world // tp // ep // cp
                sizes = dict(zip(AXES, (dp, cp, ep, tp)))
                out.append({**head, **{a: n for a, n in sizes.items() if n > 1}})
    return out


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _experts(config) -> int:
    text = _text(config)
    for name in ("n_routed_experts", "num_experts", "num_local_experts"):
        value = getattr(text, name, None)
        if value:
            return int(value)
    return 0


def parameter_split(config) -> tuple:
    """(expert parameters, other parameters) of the model, counted on meta (each tied tensor once)."""
    from .step import build_model

    model = build_model(config, "meta")
    seen, expert, other = set(), 0, 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if ".experts." in name:
            expert += p.numel()
        else:
            other += p.numel()
    return expert, other


def prune_reason(mesh: dict, fully_shard: bool, config, seq: int, budget: float, split: tuple, node: int) -> str:
    """Why this mesh cannot run or cannot fit, without planning it ("" when it may)."""
    text = _text(config)
    tp, ep, cp, dp, pp = (mesh.get(a, 1) for a in ("tp", "ep", "cp", "dp", "pp"))
    heads = getattr(text, "num_attention_heads", 1)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if tp > node:
        return f"tp={tp} spans nodes of {node}"
    if heads % tp or kv % tp:
        return f"tp={tp} does not divide {heads} query / {kv} KV heads"
    experts = _experts(config)
    if ep > 1 and (not experts or experts % ep):
        return f"ep={ep} does not divide {experts} routed experts"
    if pp > text.num_hidden_layers:
        return f"pp={pp} is more stages than {text.num_hidden_layers} layers"
    if seq % (2 * cp):
        return f"cp={cp} does not divide seq {seq} into 2 x cp chunks"
    if fully_shard and dp == 1:
        return "fully_shard without a dp axis"
    expert, other = split
    shard = dp if fully_shard else 1
    state = 16 * (expert / (ep * shard) + other / (tp * shard)) / pp
    if budget and state > budget:
        return f"training state >= {state / 1e9:.1f} GB per rank (16 B/parameter, lower bound)"
    return ""


def hsdp_meshes(mesh: dict) -> list:
    """The HSDP splits of `mesh`'s dp, most replicas first: dp_replicate=R (outermost: across nodes)
    x dp=dp/R for every R >= 2 dividing dp with dp/R >= 2 (none with a pp axis: not planned)."""
    dp = mesh.get("dp", 1)
    if "pp" in mesh:
        return []
    splits = [r for r in range(dp // 2, 1, -1) if dp % r == 0 and dp // r >= 2]
    return [{REPLICATE_AXIS: r, **{a: (n // r if a == "dp" else n) for a, n in mesh.items()}} for r in splits]


def candidates(world: int, config, seq: int, budget: float, node: int, split: tuple, pps=(1,)) -> list:
    """Per mesh, in the order planned (module docstring, 3): no fully_shard, HSDP most replicas first,
    fully_shard."""
    out = []
    for mesh in (m for pp in pps for m in meshes(world, pp)):
        settings = [(mesh, False)] + [(m, True) for m in hsdp_meshes(mesh)] + [(mesh, True)]
        for shape, fully_shard in settings:
            c = Candidate(shape, fully_shard)
            c.pruned = prune_reason(shape, fully_shard, config, seq, budget, split, node)
            out.append(c)
    return out


def cut_depths(config, depth: int = 0) -> tuple:
    """Two depths (d1, d2) whose difference is one period of the model's layer pattern (Qwen3.5's
    3 linear + 1 full attention: 4 layers; DeepSeek-V3.2's MoE layers after its dense ones: 1), d1
    two periods past any leading layers of another kind; (L, L) when d2 would exceed the depth L."""
    text = _text(config)
    layers = depth or text.num_hidden_layers
    period = 1
    types = getattr(text, "layer_types", None)
    if types:
        for p in range(1, len(types) + 1):
            if all(types[i] == types[i % p] for i in range(len(types))):
                period = p
                break
    lead = int(getattr(text, "first_k_dense_replace", 0) or 0)
    # Two periods past the lead: the step from the first period to the second is not yet on the line
    # (measured on the tiny DeepSeek-V3.2: peak +186.8 KB from 2 to 3 layers, +198.8 KB per layer after).
    d1 = lead + 2 * period
    d2 = d1 + period
    if d2 > layers:
        return (layers, layers)
    return (d1, d2)


def scale_report(r1, r2, d1: int, d2: int, layers: int):
    """The report of `layers` layers from those of d1 and d2 layers, every LINEAR_FIGURES figure and
    every per-axis / per-phase byte count extrapolated on the line through them."""
    if d1 == d2:
        return r1
    k = (layers - d1) / (d2 - d1)

    def line(a, b):
        return int(round(a + k * (b - a)))

    out = dataclasses.replace(r1)
    for name in LINEAR_FIGURES:
        setattr(out, name, line(getattr(r1, name), getattr(r2, name)))
    for name in ("axis_bytes", "collective_bytes", "phase_bytes", "collectives", "phase_flops", "kernels", "cp_calls"):
        a, b = getattr(r1, name), getattr(r2, name)
        setattr(out, name, {key: line(a.get(key, 0), b.get(key, 0)) for key in set(a) | set(b)})
    out.seconds = {"planned": r1.seconds.get("total", 0) + r2.seconds.get("total", 0)}
    out.peak_optimizer_offloaded = 0  # not linear in depth (CHECKED_FIGURES): not given for a scaled plan
    return out


# The figures whose linearity the tests and --search check: every LINEAR_FIGURES figure but the
# activations class, which moves between runs of the same plan by when Python's garbage collector
# frees storages held in reference cycles (docs/planner.md; the peaks do not), and the peak without
# the optimizer state, the larger of a backward peak and an optimizer-step peak that grow at
# different rates (tiny DeepSeek-V3.2: +104, +80, +60 KB per layer): not linear, so not scaled
# (plan.py refuses --offload-optimizer with --scale-depth).
CHECKED_FIGURES = tuple(f for f in LINEAR_FIGURES if f != "activations")


def linear_deviation(r1, r2, r3, d1: int, d2: int, d3: int, figures=CHECKED_FIGURES) -> dict:
    """{figure: |r3 - line(d3)| / |r3|}: how far a third depth's figures lie from the line of the
    first two (0 for a figure exactly linear in depth)."""
    predicted = scale_report(r1, r2, d1, d2, d3)
    out = {}
    for name in figures:
        actual = getattr(r3, name)
        out[name] = abs(getattr(predicted, name) - actual) / max(abs(actual), 1)
    return out


def axis_links(mesh: dict, node: int) -> dict:
    """{axis: "intra" | "inter"}: ranks are numbered row-major over the mesh (the last axis fastest)
    and nodes hold `node` consecutive ranks; an axis is intra-node when every one of its groups lies
    inside one node."""
    sizes = list(mesh.values())
    out = {}
    for i, axis in enumerate(mesh):
        stride = math.prod(sizes[i + 1 :])
        span = stride * sizes[i]
        out[axis] = "intra" if span <= node and node % span == 0 else "inter"
    return out


def estimate(report, hardware: Hardware, efficiency: float, tokens: int, offload: bool = False) -> dict:
    """Seconds of one step: compute = this rank's planned FLOPs / (tflops x efficiency); each axis's
    bytes / its link's bandwidth (axis_links); optimizer offload adds the gradients down and the
    parameters back up at the host bandwidth. No overlap of compute and communication is assumed
    (the sum is an upper bound of a perfectly overlapped step's max)."""
    compute = report.flops / (hardware.tflops * 1e12 * efficiency)
    links = axis_links(report.mesh, hardware.node_size)
    comm = {}
    for axis, nbytes in report.axis_bytes.items():
        bw = hardware.intra_gbs if links.get(axis, "inter") == "intra" else hardware.inter_gbs
        comm[axis] = nbytes / (bw * 1e9)
    host = (report.gradients + report.parameters) / (hardware.host_gbs * 1e9) if offload else 0.0
    step = compute + sum(comm.values()) + host
    return {
        "compute_s": compute,
        "comm_s": comm,
        "host_s": host,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "links": links,
    }


def pipeline_estimate(report, hardware, efficiency: float, tokens: int) -> dict:
    """`estimate` for a pp plan (pipeline.py): the slowest stage's microbatch time (its FLOPs / m at the
    stated throughput, plus its per-microbatch collectives at their links) stretched by the
    schedule to (m + (pp - 1) / v) microbatch-times, plus dp's once-per-step gradient reductions and
    the P2P bytes at the pp link; no overlap (as search.estimate)."""
    pp = report.pp
    m, v = pp["microbatches"], pp["virtual"]
    stages = report.mesh["pp"]
    links = axis_links(report.mesh, hardware.node_size)

    def seconds(axis, nbytes):
        bw = hardware.intra_gbs if links.get(axis, "inter") == "intra" else hardware.inter_gbs
        return nbytes / (bw * 1e9)

    compute = pp["slowest_flops"] / (hardware.tflops * 1e12 * efficiency)
    per_micro = {a: 0 for a in report.axis_bytes if a != "pp"}
    once = dict(per_micro)
    for key, (step_bytes, micro_bytes) in pp["once_per_microbatch"].items():
        axis = key.split(" ", 1)[0]
        once[axis] += step_bytes
        per_micro[axis] += m * micro_bytes
    for axis, n in report.axis_bytes.items():  # uncounted collectives: per microbatch
        if axis != "pp":
            per_micro[axis] += n - per_micro[axis] - once[axis]
    micro_s = (compute + sum(seconds(a, n) for a, n in per_micro.items())) / m
    pipeline_s = micro_s * (m + (stages - 1) / v)
    comm = {a: seconds(a, per_micro[a] + once[a]) for a in per_micro}
    comm["pp"] = seconds("pp", report.axis_bytes.get("pp", 0))
    once_s = sum(seconds(a, n) for a, n in once.items())
    step = pipeline_s + once_s + comm["pp"]
    return {
        "compute_s": compute,
        "comm_s": comm,
        "host_s": 0.0,
        "bubble_s": pipeline_s - micro_s * m,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "links": links,
    }


def _plan_mesh(c, plan, d1, d2, layers, budget, modes, hardware, efficiency, seq, planned, log, peak_of) -> bool:
    """Plans one candidate (module docstring, 3 and 4); True when a setting of it fits. A figure at d1
    layers bounds the full depth's from below (every layer adds state and saved activations), so
    the most frugal setting (the last of `modes`) is planned at d1 first: when even that is over
    the budget the candidate is reported over without planning the others."""
    t0 = time.perf_counter()
    first = {}
    frugal = modes[-1]
    first[frugal] = plan(c.mesh, c.fully_shard, frugal, d1)
    if budget and peak_of(first[frugal]) > budget:
        trial = dataclasses.replace(c, recompute=frugal)
        trial.report = first[frugal]
        trial.estimate = estimate(trial.report, hardware, efficiency, data_parallel(c.mesh) * seq)
        trial.pruned = f"over at {d1} layers with recompute {frugal}: {peak_of(first[frugal]) / 1e9:.1f} GB"
        trial.report = None
        planned.append(trial)
        log(f"  {trial.name:<{_NAME}} {trial.pruned}  ({time.perf_counter() - t0:.0f} s)")
        return False
    for mode in modes:
        t1 = time.perf_counter()
        trial = dataclasses.replace(c, recompute=mode)
        r1 = first.get(mode) or plan(trial.mesh, trial.fully_shard, mode, d1)
        if budget and peak_of(r1) > budget:
            log(
                f"  {trial.name:<{_NAME}} over at {d1} layers: {peak_of(r1) / 1e9:.1f} GB  ({time.perf_counter() - t1:.0f} s)"
            )
            continue
        r2 = plan(trial.mesh, trial.fully_shard, mode, d2) if d2 != d1 else r1
        trial.report = scale_report(r1, r2, d1, d2, layers)
        trial.report.seconds = {"planned": time.perf_counter() - t1}
        trial.report._cut = (r1, r2, d1, d2)
        trial.estimate = estimate(trial.report, hardware, efficiency, data_parallel(trial.mesh) * seq)
        planned.append(trial)
        fits = not budget or peak_of(trial.report) <= budget
        log(
            f"  {trial.name:<{_NAME}} peak {peak_of(trial.report) / 1e9:8.1f} GB  {'fits' if fits else 'over'}  "
            f"({time.perf_counter() - t1:.0f} s)"
        )
        if fits:
            return True
    return False


def _plan_pipeline(c, plan_pp, budget, modes, hardware, efficiency, seq, planned, log, peak_of) -> bool:
    """A pp candidate: each recompute setting in turn (cheapest first) until one fits."""
    for mode in modes:
        t0 = time.perf_counter()
        trial = dataclasses.replace(c, recompute=mode)
        try:
            trial.report = plan_pp(trial.mesh, trial.fully_shard, mode)
        except ValueError as exc:  # the schedule cannot run (check_pipeline)
            trial.pruned = str(exc).removeprefix("hypershard: plan: ")
            planned.append(trial)
            return False
        trial.estimate = pipeline_estimate(trial.report, hardware, efficiency, trial.report.pp["batch"] * seq)
        planned.append(trial)
        fits = not budget or peak_of(trial.report) <= budget
        log(
            f"  {trial.name:<{_NAME}} peak {peak_of(trial.report) / 1e9:8.1f} GB  {'fits' if fits else 'over'}  "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        if fits:
            return True
    return False


def search(
    config,
    world: int,
    budget: float,
    seq: int,
    plan: Callable,
    hardware: Hardware,
    efficiency: float,
    recompute_modes=("none", "selective", "full"),
    verify: int = 3,
    log: Callable = lambda line: None,
    peak_of: Callable = lambda r: r.peak,
    pps=(1,),
    plan_pp: Optional[Callable] = None,
) -> list:
    """The ranked candidates (fitting ones first, by estimated tokens per second; then the others by
    peak; then the pruned). `plan(mesh, fully_shard, recompute, layers)` returns a PlanReport of a
    model cut to `layers`; `verify`: the top candidates whose linearity in depth is checked with a
    third depth. `pps`: the pp sizes searched; `plan_pp(mesh, fully_shard, recompute)` the PlanReport
    of a pp mesh's stage of largest peak (pipeline.plan_pipeline, planned at the stages' depths)."""
    text = _text(config)
    layers = text.num_hidden_layers
    d1, d2 = cut_depths(config)
    split = parameter_split(config)
    out = candidates(world, config, seq, budget, hardware.node_size, split, pps)
    live = [c for c in out if not c.pruned]
    log(f"{len(out)} candidates, {len(out) - len(live)} pruned; planning depths {d1} and {d2} of {layers}")
    planned = []
    by_mesh: dict = {}  # the mesh with HSDP's dp_replicate folded back into dp -> its settings, cheapest first
    for c in live:
        base = {
            a: n * c.mesh.get(REPLICATE_AXIS, 1) if a == "dp" else n for a, n in c.mesh.items() if a != REPLICATE_AXIS
        }
        by_mesh.setdefault(tuple(base.items()), []).append(c)
    for key, group in by_mesh.items():
        for c in group:  # in candidates' order: no fully_shard, HSDP most replicas first, fully_shard
            if "pp" in c.mesh:
                if _plan_pipeline(
                    c, plan_pp, budget, recompute_modes, hardware, efficiency, seq, planned, log, peak_of
                ):
                    break
                continue
            if _plan_mesh(
                c, plan, d1, d2, layers, budget, recompute_modes, hardware, efficiency, seq, planned, log, peak_of
            ):
                break  # fully_shard is planned only when the mesh without it does not fit
    over_early = [c for c in planned if c.report is None]
    planned = [c for c in planned if c.report is not None]
    fit = sorted(
        (c for c in planned if not budget or peak_of(c.report) <= budget), key=lambda c: -c.estimate["tokens_per_s"]
    )
    over = sorted((c for c in planned if budget and peak_of(c.report) > budget), key=lambda c: peak_of(c.report))
    for c in fit[:verify]:
        if "pp" in c.mesh:
            continue  # planned at the stages' own depths, not scaled
        r1, r2, d1_, d2_ = c.report._cut
        d3 = d2_ + (d2_ - d1_)
        if d1_ == d2_ or d3 > layers:
            continue
        r3 = plan(c.mesh, c.fully_shard, c.recompute, d3)
        c.linear = max(linear_deviation(r1, r2, r3, d1_, d2_, d3, ("peak", "flops", "traffic_bytes")).values())
    return fit + over + over_early + [c for c in out if c.pruned]


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def format_table(
    ranked: list,
    budget: float,
    hardware: Hardware,
    efficiency: float,
    show_pruned: int = 12,
    peak_of: Callable = lambda r: r.peak,
) -> str:
    lines = [
        f"time model: {hardware.name}, {hardware.tflops:g} TFLOP/s x {efficiency:g}, links {hardware.intra_gbs:g} GB/s "
        f"inside a node of {hardware.node_size}, {hardware.inter_gbs:g} GB/s across; no compute/communication overlap",
        f"{'#':>3} {'mesh':<{_NAME}}{'peak GB':>9}{'fits':>6}{'TFLOP':>9}{'compute s':>10}{'comm s':>8}{'step s':>8}"
        f"{'tok/s':>9}  bytes per axis GB (link)   lin",
    ]
    planned = [c for c in ranked if c.report is not None]
    for i, c in enumerate(planned, 1):
        r, e = c.report, c.estimate
        fits = "yes" if not budget or peak_of(r) <= budget else "no"
        axes = " ".join(f"{a}={_gb(b)}({e['links'].get(a, '?')[:5]})" for a, b in sorted(r.axis_bytes.items()))
        lin = "-" if c.linear is None else f"{100 * c.linear:.1f}%"
        lines.append(
            f"{i:>3} {c.name:<{_NAME}}{_gb(peak_of(r)):>9}{fits:>6}{r.flops / 1e12:>9.1f}{e['compute_s']:>10.2f}"
            f"{sum(e['comm_s'].values()):>8.2f}{e['step_s']:>8.2f}{e['tokens_per_s']:>9.0f}  {axes}   {lin}"
        )
    pruned = [c for c in ranked if c.pruned]
    if pruned:
        lines.append(
            f"not ranked (pruned, or over at the first cut depth): {len(pruned)} (first {min(show_pruned, len(pruned))}):"
        )
        for c in pruned[:show_pruned]:
            lines.append(f"    {c.name:<{_NAME}}{c.pruned}")
    return "\n".join(lines)
