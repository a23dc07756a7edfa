"""The planner's `pp` axis: pipeline stages over a `pp` mesh axis, run by a torch.distributed.pipelining
schedule (GPipe, 1F1B, Interleaved1F1B), planned from one microbatch of each distinct stage.

A stage is planned as what it is, a model of its own layers: `stage_config` cuts the model to the
rank's layers with their kinds (DeepSeek-V3.2's dense layers, Qwen3.5's linear / full attention),
and `run.plan_step` runs one microbatch of it on the mesh of the other axes. The pipeline is then
added analytically (docs/planner.md, "Pipeline parallelism"):

- **Split.** `stage_layers`: the L layers cut into pp x v chunks of consecutive layers as evenly as
  they go, the first L mod (pp x v) chunks one layer longer (torch.chunk's geometry: rank 0's are
  the largest); chunk c runs on pp rank c mod pp (v = 1 but for interleaved_1f1b). The embeddings
  (and a vision tower) are on the first stage, the final norm, the LM head and the loss on the last;
  a tied embedding is held by both (the pipeline cannot share one tensor between two ranks).
- **State.** The stage plan holds the embeddings and the head whatever the stage; a rank not on
  the first (last) stage gives back their bytes on this rank (run._root_state, exact per class).
  With fully_shard, gradients are reduced over dp once per step (the issue's rule; torch's stages
  accumulate unreduced and reduce on the last backward): every stage holds its layers' unsharded
  fp32 gradients from its first backward to the reduction, (dp - 1) x its sharded gradient bytes
  more than the plan.
- **Activations.** One microbatch's pass through the stage's layers leaves `layer_activations`
  alive (measured in the plan: live bytes after the last layer's forward minus before the first's);
  a schedule holds `in_flight` such passes at the rank's peak (GPipe: m; 1F1B: min(m, pp - s) on
  stage s, torch's Schedule1F1B warm-up; Interleaved1F1B: torch's _get_warmup_ops + 1 chunk
  passes, each 1/v of the rank's layers). Peak = the plan's peak + (in_flight - 1) x that.
- **Traffic.** Each stage kind is planned twice, with the microbatch's sequences and with twice
  as many: a collective whose bytes stay the same does not depend on the tokens (a gradient
  reduction: fully_shard's reduce-scatter, the buckets' all-reduces, an ep all-reduce of gradients)
  and runs once per step; the part that doubles runs once per microbatch (m times). fully_shard's
  parameter all-gathers run per microbatch too (hs.fully_shard's default reshard_after_forward:
  gathered for each microbatch's forward and again for its backward). P2P (`p2p_bytes`): per boundary and
  microbatch the boundary hidden state forward and its gradient backward, each
  hidden x (seq / cp) x micro-batch x dtype bytes, sent by each rank of the boundary as its local
  tensor (a DTensor keeps its layout across the boundary).
- **Time.** `bubble`: a schedule of m microbatches over pp stages with v chunks per rank takes
  (m + (pp - 1) / v) microbatch-times of its slowest stage, a bubble fraction of
  (pp - 1) / (v x m + pp - 1) (Narayanan et al., "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM", SC'21, section 2.2: bubble time / ideal time = (p - 1) / m for
  GPipe and 1F1B, (p - 1) / (v m) interleaved; the torch.distributed.pipelining docs' schedules
  implement those).

The stage plans include the head and the loss on every stage: their FLOPs are removed from the
stages without them (by the layers' share of forward FLOPs measured in the plan), their transient
activations (logits) are not (an upper bound for the stages before the last).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = [
    "SCHEDULES",
    "bubble",
    "check_pipeline",
    "in_flight",
    "p2p_bytes",
    "plan_pipeline",
    "stage_config",
    "stage_layers",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _error(problem: str, allowed: str) -> ValueError:
    return ValueError(f"hypershard: plan: {problem}; allowed: {allowed}")


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def virtual_stages(schedule: str, virtual: int) -> int:
    return virtual if schedule == "interleaved_1f1b" else 1


def check_pipeline(layers: int, pp: int, microbatches: int, batch_per_dp: int, schedule: str, virtual: int = 2) -> None:
    """Raises ValueError (one line, "hypershard: plan: ...; allowed: ...") for a pipeline that cannot run."""
    if schedule not in SCHEDULES:
        raise _error(f"--pp-schedule {schedule!r}", ", ".join(SCHEDULES))
    v = virtual_stages(schedule, virtual)
    if schedule == "interleaved_1f1b" and v < 2:
        raise _error(f"interleaved_1f1b with {virtual} stage per rank", "--pp-virtual >= 2 (1 is 1f1b)")
    if pp * v > layers:
        raise _error(
            f"pp={pp}"
            + (f" x {v} virtual stages" if v > 1 else "")
            + f" is more stages than the model's {layers} layers",
            f"pp x virtual stages <= {layers}",
        )
    if microbatches < 1 or batch_per_dp % microbatches:
        divisors = [d for d in range(1, batch_per_dp + 1) if batch_per_dp % d == 0]
        raise _error(
            f"--microbatches {microbatches} does not divide the batch of {batch_per_dp} sequences per dp rank",
            f"a divisor of {batch_per_dp}: {divisors} (or a --batch that it divides)",
        )
    if schedule == "1f1b" and microbatches < pp:
        raise _error(f"1f1b needs at least pp={pp} microbatches, got {microbatches}", f">= {pp} (torch Schedule1F1B)")
    if schedule == "interleaved_1f1b":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise _error(
                f"interleaved_1f1b with {microbatches} microbatches on pp={pp}: not a multiple of its "
                f"{rounds} rounds (torch ScheduleInterleaved1F1B)",
                f"microbatches < {pp} or a multiple of {rounds}",
            )


def stage_layers(layers: int, pp: int, virtual: int = 1) -> list:
    """[[layer indices of pp rank r] for r in range(pp)]: pp x virtual chunks of consecutive layers,
    the first layers mod (pp x virtual) one longer; chunk c on rank c mod pp."""
    chunks = pp * virtual
    base, extra = divmod(layers, chunks)
    out, start = [[] for _ in range(pp)], 0
    for c in range(chunks):
        n = base + (1 if c < extra else 0)
        out[c % pp].extend(range(start, start + n))
        start += n
    return out


def stage_config(config, layer_ids: list):
    """`config` cut to the layers `layer_ids` (of the full model), with their kinds: every per-layer
    list of the config (a list as long as the layers: layer_types, DeepSeek-V3.2's mlp_layer_types)
    sliced; DeepSeek's first_k_dense_replace set to the stage's leading dense layers; Qwen3-MoE's
    mlp_only_layers re-indexed. Other per-layer settings are the same on every layer of the four
    targets."""
    config = _copy(config)
    text = _text(config)
    layers = text.num_hidden_layers
    n = len(layer_ids)
    for name, value in list(vars(text).items()):
        if isinstance(value, (list, tuple)) and len(value) == layers and layers > 1:
            setattr(text, name, [value[i] for i in layer_ids])
    dense = getattr(text, "first_k_dense_replace", None)
    if dense is not None:
        kinds = [i < dense for i in layer_ids]
        if any(kinds[j] < kinds[j + 1] for j in range(n - 1)):
            raise _error(f"layers {layer_ids} put a dense layer after a MoE layer", "consecutive layers")
        text.first_k_dense_replace = sum(kinds)
    only = getattr(text, "mlp_only_layers", None)
    if only:
        text.mlp_only_layers = [j for j, i in enumerate(layer_ids) if i in set(only)]
    text.num_hidden_layers = n
    return config


def _copy(config):
    import copy

    return copy.deepcopy(config)


def in_flight(schedule: str, pp: int, microbatches: int, rank: int, virtual: int = 1) -> float:
    """Microbatch passes through ALL of pp rank `rank`'s layers whose activations are alive at its
    peak (a chunk pass counts 1/v): GPipe holds every microbatch; torch's Schedule1F1B runs
    min(m, pp - rank) forwards before its first backward; its ScheduleInterleaved1F1B
    (_get_warmup_ops) (v - 1) x microbatches-per-round + 2 (pp - 1 - rank) chunk forwards, then one
    more before the first backward (capped at m x v)."""
    m = microbatches
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - rank))
    v = virtual
    rounds = max(1, m // pp)
    warmup = min((v - 1) * (m // rounds) + 2 * (pp - 1 - rank), m * v)
    return min(warmup + 1, m * v) / v


def bubble(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The fraction of a step's time a stage idles: (pp - 1) / (v m + pp - 1), v = 1 but for
    interleaved_1f1b (Narayanan et al. SC'21, section 2.2)."""
    v = virtual_stages(schedule, virtual)
    return (pp - 1) / (v * microbatches + pp - 1)


def p2p_bytes(
    hidden: int, seq: int, micro_batch: int, dtype_bytes: int, microbatches: int, rank: int, pp: int, virtual: int = 1
) -> int:
    """Bytes pp rank `rank` sends per step: per microbatch, each of its chunks sends its output
    forward (not the model's last chunk) and its input's gradient backward (not the first), each
    hidden x seq x micro_batch x dtype_bytes (`seq`: this rank's tokens, seq / cp). Per boundary
    and step: 2 x m x that."""
    one = hidden * seq * micro_batch * dtype_bytes
    sends = 2 * virtual - (rank == 0) - (rank == pp - 1)
    return sends * microbatches * one


def stage_report(
    plan,
    *,
    pp: int,
    rank: int,
    microbatches: int,
    schedule: str,
    virtual: int,
    layers: list,
    dp: int,
    fully_shard: bool,
    p2p: int,
    doubled=None,
):
    """The PlanReport of pp rank `rank` from `plan`, the plan of one microbatch of its layers, and
    `doubled`, the same with twice the microbatch's sequences: a collective's bytes that stay the
    same are per step (gradient reductions), those that double per microbatch (module docstring)."""
    out = dataclasses.replace(plan)
    first, last = rank == 0, rank == pp - 1
    for cls in ("parameters", "gradients", "optimizer"):
        give = 0
        if not first:
            give += plan.root_state.get("embed", {}).get(cls, 0)
        if not last:
            give += plan.root_state.get("head", {}).get(cls, 0)
        if not first and not last:
            give += plan.root_state.get("both", {}).get(cls, 0)
        setattr(out, cls, getattr(plan, cls) - give)
    given = (plan.parameters - out.parameters) + (plan.gradients - out.gradients) + (plan.optimizer - out.optimizer)
    m = microbatches
    flight = in_flight(schedule, pp, m, rank, virtual)
    held = int(round((flight - 1) * plan.layer_activations))
    accumulated = out.gradients * (dp - 1) if fully_shard and m > 1 else 0
    out.activations = plan.activations + held
    out.peak = plan.peak - given + held + accumulated
    out.forward_backward_peak = plan.forward_backward_peak - (plan.gradients - out.gradients) + held + accumulated
    share = 1.0 if last else plan.layer_flops_share
    out.phase_flops = {k: int(v if k == "optimizer" else m * v * share) for k, v in plan.phase_flops.items()}
    out.flops = sum(out.phase_flops.values())
    # Per step: a collective's bytes that do not grow with the tokens (the gradient reductions) once,
    # the rest m times; fully_shard's parameter gathers ("all_gather") m times (module docstring).
    doubled = doubled or plan
    out.collective_bytes, out.collectives, split = {}, {}, {}
    for key in set(plan.collective_bytes) | set(plan.collectives):
        one, two = plan.collective_bytes.get(key, 0), doubled.collective_bytes.get(key, 0)
        count_one = plan.collectives.get(key, 0)
        if key.endswith(" all_gather") or doubled is plan:
            per_micro, once, calls = one, 0, m * count_one
        else:
            per_micro, once = max(two - one, 0), max(2 * one - two, 0)
            calls = count_one if per_micro == 0 else m * count_one
        out.collective_bytes[key] = once + m * per_micro
        out.collectives[key] = calls
        split[key] = [once, per_micro]
    axis_bytes: dict = {}
    for key, n in out.collective_bytes.items():
        axis = key.split(" ", 1)[0]
        axis_bytes[axis] = axis_bytes.get(axis, 0) + n
    # Collectives hypershard did not count (the ring-costed ones) keep the plan's per-axis share, x m.
    for axis, n in plan.axis_bytes.items():
        counted = sum(b for k, b in plan.collective_bytes.items() if k.split(" ", 1)[0] == axis)
        if n > counted:
            axis_bytes[axis] = axis_bytes.get(axis, 0) + m * (n - counted)
    axis_bytes["pp"] = p2p
    out.axis_bytes = axis_bytes
    out.phase_bytes = {}
    out.collectives["pp send/recv"] = m * (2 * virtual - first - last)
    out.collective_bytes["pp send/recv"] = p2p
    out.traffic_bytes = sum(axis_bytes.values())
    out.pp = {
        "schedule": schedule,
        "microbatches": m,
        "virtual": virtual,
        "stage": rank,
        "layers": list(layers),
        "in_flight": flight,
        "held_activations": held,
        "accumulated_gradients": accumulated,
        "bubble": bubble(schedule, pp, m, virtual),
        "p2p_bytes": p2p,
        "once_per_microbatch": split,  # "axis kind" -> [bytes once per step, bytes per microbatch]
    }
    return out


def plan_pipeline(
    config,
    shape: dict,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    virtual: int = 2,
    rank: Optional[int] = 0,
    batch: int = 0,
    seq: int = 4096,
    fully_shard: bool = False,
    compute_dtype=None,
    dtype=None,
    plan=None,
    **options,
):
    """The plan of pp rank `rank`'s stage on mesh `shape` (which has a "pp" axis), or with
    rank=None of the stage with the largest peak; `batch`: sequences per step in all (default dp x
    microbatches: one sequence per microbatch per dp rank). Every stage's summary is in
    report.pp["stages"]. `plan(stage_config, sub_shape, sub_rank, batch)`: run.plan_step by default."""
    import torch

    from .run import plan_step
    from .world import coordinates

    dtype = dtype or torch.float32
    pp = shape["pp"]
    sub_shape = {a: n for a, n in shape.items() if a != "pp"}
    dp, cp = shape.get("dp", 1), shape.get("cp", 1)
    batch = batch or dp * microbatches
    if batch % dp:
        raise _error(f"--batch {batch} is not a multiple of dp={dp}", "a multiple of the dp size")
    text = _text(config)
    layers = text.num_hidden_layers
    check_pipeline(layers, pp, microbatches, batch // dp, schedule, virtual)
    v = virtual_stages(schedule, virtual)
    micro = batch // dp // microbatches
    split = stage_layers(layers, pp, v)
    if plan is None:

        def plan(cut, mesh, sub_rank, sequences):
            return plan_step(
                cut,
                mesh,
                rank=sub_rank,
                fully_shard=fully_shard,
                batch=sequences,
                seq=seq,
                dtype=dtype,
                compute_dtype=compute_dtype,
                **options,
            )

    def sub_rank_of(r):
        coords = dict(zip(shape, coordinates(shape, r)))
        sub = 0
        for a, n in sub_shape.items():
            sub = sub * n + coords[a]
        return coords["pp"], sub

    stage_of, sub = sub_rank_of(rank or 0)
    dtype_bytes = torch.empty((), dtype=compute_dtype or dtype).element_size()
    plans: dict = {}
    reports = []
    for s in range(pp):
        cut = stage_config(config, split[s])
        kinds = _kinds(cut)
        if kinds not in plans:
            plans[kinds] = (plan(cut, sub_shape, sub, dp * micro), plan(cut, sub_shape, sub, 2 * dp * micro))
        p2p = p2p_bytes(text.hidden_size, seq // cp, micro, dtype_bytes, microbatches, s, pp, v)
        reports.append(
            stage_report(
                plans[kinds][0],
                pp=pp,
                rank=s,
                microbatches=microbatches,
                schedule=schedule,
                virtual=v,
                layers=split[s],
                dp=dp,
                fully_shard=fully_shard,
                p2p=p2p,
                doubled=plans[kinds][1],
            )
        )
    pick = max(range(pp), key=lambda s: reports[s].peak) if rank is None else stage_of
    out = reports[pick]
    out.mesh = dict(shape)
    out.rank = rank if rank is not None else _first_rank(shape, pick)
    out.coordinates = dict(zip(shape, coordinates(shape, out.rank)))
    out.pp["stages"] = [
        {
            "stage": s,
            "layers": len(r.pp["layers"]),
            "peak": r.peak,
            "in_flight": r.pp["in_flight"],
            "tflop": r.flops / 1e12,
            "p2p": r.pp["p2p_bytes"],
        }
        for s, r in enumerate(reports)
    ]
    from .search import parameter_split

    out.total_parameters = sum(parameter_split(config))
    out.pp["slowest_flops"] = max(r.flops for r in reports)
    out.pp["micro_batch"] = micro
    out.pp["batch"] = batch
    out.seconds = {"stage plans": float(2 * len(plans))}
    return out


def _kinds(config) -> tuple:
    text = _text(config)
    return (
        text.num_hidden_layers,
        tuple(getattr(text, "layer_types", None) or ()),
        tuple(getattr(text, "mlp_layer_types", None) or ()),
        getattr(text, "first_k_dense_replace", None),
        tuple(getattr(text, "mlp_only_layers", None) or ()),
    )


def _first_rank(shape: dict, stage: int) -> int:
    """The lowest global rank whose pp coordinate is `stage` (the other coordinates 0)."""
    rank, stride = 0, 1
    for a, n in reversed(list(shape.items())):
        if a == "pp":
            rank += stage * stride
        stride *= n
    return rank


def describe(report) -> list:
    """Lines for the CLI's report of a pp plan."""
    pp = report.pp
    lines = [
        f"  pipeline: {pp['schedule']}, pp={report.mesh['pp']}"
        + (f" x {pp['virtual']} virtual stages" if pp["virtual"] > 1 else "")
        + f", {pp['microbatches']} microbatches of {pp['micro_batch']} sequence(s) per dp rank "
        f"(batch {pp['batch']}); bubble (pp-1)/(v*m+pp-1) = {100 * pp['bubble']:.1f} %",
        f"  this stage: {pp['stage']} (layers {_ranges(pp['layers'])}), {pp['in_flight']:g} microbatch passes "
        f"in flight at its peak (+{pp['held_activations'] / 1e9:.2f} GB held)"
        + (
            f", unreduced fp32 gradients accumulated over microbatches +{pp['accumulated_gradients'] / 1e9:.2f} GB"
            if pp["accumulated_gradients"]
            else ""
        ),
        "  stages (peak GB, layers, in flight, TFLOP, P2P GB sent): "
        + "; ".join(
            f"{s['stage']}: {s['peak'] / 1e9:.1f}, {s['layers']}, {s['in_flight']:g}, {s['tflop']:.1f}, {s['p2p'] / 1e9:.2f}"
            for s in pp.get("stages", [])
        ),
    ]
    return lines


def _ranges(ids: list) -> str:
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ",".join(out)
