"""A simulated world: one rank's view of a mesh of any size, in one process, sending nothing.

Each mesh axis gets a c10d ``ProcessGroup`` of the axis size with no backend behind it. hypershard's
C++ (redistribution, gradient buckets, fully_shard) calls ``group._allgather_base`` /
``allreduce`` / ``_reduce_scatter_base`` / ``alltoall_base`` on it exactly as on a gloo or NCCL
group; c10d routes those calls through the dispatcher by the tensors' device, and for meta tensors
that lands on the ``c10d`` Meta kernels. Torch's own Meta kernels (torch.distributed.
_meta_registrations, the fake process group's path) return a finished Work; ours do the same and
also record the collective: its kind, the mesh axis (each group is one axis) and its bytes.

Bytes are hypershard's own count (`_C.traffic()`, the bytes this rank sends, by the same cost model
the redistribution planner uses): hypershard adds a collective's bytes to the counter just before it
issues the collective, so the counter's growth since the previous collective is this collective's
bytes. The one exception, span exchanges (an all_to_all counted right after it is issued), is
costed from its splits. A collective hypershard never counts (none known) would be costed by ring
formulas and marked uncounted. While recording, F.scaled_dot_product_attention on meta takes the
kernel the planned device's dispatch takes (`recording(device=...)`: _cuda_attention, _npu_attention,
_cpu_attention).
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed._meta_registrations import create_fakework

from .. import _C

__all__ = ["CollectiveLog", "recording", "simulated_mesh"]


class _AxisGroup(dist.ProcessGroup):
    """The process group of one mesh axis, as seen from this rank (no backend: only meta tensors
    may be sent through it)."""

    def __init__(self, rank: int, size: int, axis: str):
        super().__init__(rank, size)
        self.axis = axis


_GROUPS: list = []


def coordinates(shape: Mapping[str, int], rank: int) -> list:
    """Row-major coordinates of `rank` on a mesh of `shape` (the order init_device_mesh uses)."""
    out = []
    for size in reversed(list(shape.values())):
        out.append(rank % size)
        rank //= size
    return out[::-1]


def simulated_mesh(shape: Mapping[str, int], rank: int = 0):
    """A hypershard DeviceMesh of `shape` ({"dp": 32, "tp": 8}) seen by `rank`, with one
    backend-less group per axis. Only meta tensors may take part in its collectives."""
    size = 1
    for n in shape.values():
        size *= n
    if not 0 <= rank < size:
        raise ValueError(f"hypershard: plan: rank {rank} is not on a mesh of {size} ranks; allowed: 0..{size - 1}")
    mesh = _C.Mesh.create(list(shape.values()), list(shape), [])
    groups = [_AxisGroup(c, n, axis) for c, (axis, n) in zip(coordinates(shape, rank), shape.items())]
    # The Python objects must outlive the mesh: a recorded collective finds its axis on them.
    _GROUPS.extend(groups)
    return _C.DeviceMesh(mesh, rank, "cpu", groups)


@dataclass
class CollectiveLog:
    """Collectives issued while recording: per (axis, kind) the count and bytes sent."""

    counts: collections.Counter = field(default_factory=collections.Counter)
    bytes: collections.Counter = field(default_factory=collections.Counter)
    uncounted: int = 0  # collectives hypershard did not count (costed here)
    phase: str = "step"
    by_phase: collections.Counter = field(default_factory=collections.Counter)  # (phase, axis) -> bytes
    trace: bool = False  # also attribute each collective to the model / hypershard line that issued it
    where: collections.Counter = field(default_factory=collections.Counter)  # (axis, kind, line) -> bytes
    kernels: collections.Counter = field(default_factory=collections.Counter)  # "sdpa <backend>" -> calls

    def axis_bytes(self) -> dict:
        out: collections.Counter = collections.Counter()
        for (axis, _), b in self.bytes.items():
            out[axis] += b
        return dict(out)


_active: Optional[CollectiveLog] = None
_last_counted = 0
_library = None
_aten = None
# c10d op -> (index of the process group among its arguments, whether the op returns its first argument)
_OPS = {
    "allreduce_": (1, True),
    "broadcast_": (1, True),
    "allgather_": (2, True),
    "_allgather_base_": (2, True),
    "reduce_scatter_": (2, True),
    "_reduce_scatter_base_": (2, True),
    "alltoall_base_": (2, False),
    "alltoall_": (2, True),
    "barrier": (1, False),
}
_KINDS = {
    "allreduce_": "all_reduce",
    "broadcast_": "broadcast",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "barrier": "barrier",
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _all_to_all_bytes(args: tuple, me: int) -> int:
    """Bytes this rank sends in alltoall_base(output, input, group, output_splits, input_splits):
    every row of the input but its own block."""
    inp, splits = args[1], list(args[4])
    if not splits or inp.dim() == 0 or inp.shape[0] == 0:
        return _nbytes(inp) * 0
    row = inp.numel() // inp.shape[0] * inp.element_size()
    return (sum(splits) - splits[me]) * row


def _estimate(kind: str, args: tuple, k: int) -> int:
    """Ring-algorithm bytes this rank sends, for a collective hypershard did not count."""
    if kind == "all_reduce":
        return 2 * (k - 1) * _nbytes(args[0]) // k
    if kind == "all_gather":
        return (k - 1) * _nbytes(args[1])
    if kind == "reduce_scatter":
        return (k - 1) * _nbytes(args[0])
    if kind == "all_to_all":
        return (k - 1) * _nbytes(args[1]) // k
    return 0


def _issuer(phase: str) -> str:
    """The innermost Python line outside torch and the planner: the model code (or hypershard hook)
    whose op issued the collective. A backward op the autograd engine runs from C++ has no such
    line (the innermost one is the planner's loss.backward()): it shows as the phase's engine."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if "/torch/" in path or path.endswith(("planner/memory.py", "planner/world.py", "planner/run.py")):
            continue  # torch, and the planner's own dispatch mode, kernels and fully_shard wrapper
        if path.endswith(("planner/step.py", "hypershard/planner/cli.py")):
            break  # reached the step itself: no model line issued it
        short = "/".join(path.split("/")[-2:])
        return f"{short}:{frame.lineno} {frame.name}"
    return f"({phase}: ops the autograd engine or optimizer ran)"


def _kernel(op: str):
    group_index, returns_first = _OPS[op]
    kind = _KINDS[op]

    def meta_kernel(*args):
        global _last_counted
        log = _active
        if log is not None:
            group = dist.ProcessGroup.unbox(args[group_index])
            axis = getattr(group, "axis", "?")
            counted = _C.traffic()["bytes_sent"]
            sent = counted - _last_counted
            _last_counted = counted
            if sent <= 0 and kind == "all_to_all" and op == "alltoall_base_":
                # Span exchanges (csrc/runtime/span_exchange.cpp) count right AFTER issuing: cost
                # it from its splits and take those bytes off the count that follows.
                sent = _all_to_all_bytes(args, group.rank())
                _last_counted += sent
            elif sent <= 0 and kind != "barrier":
                sent = _estimate(kind, args, group.size())
                log.uncounted += 1
            log.counts[(axis, kind)] += 1
            log.bytes[(axis, kind)] += sent
            log.by_phase[(log.phase, axis)] += sent
            if log.trace:
                log.where[(axis, kind, _issuer(log.phase))] += sent
        return create_fakework(args, returns_first)

    return meta_kernel


def _install() -> None:
    """Our Meta kernels in place of torch's (same results, plus the record); once per process."""
    global _library, _aten
    if _library is not None:
        return
    import warnings

    _library = torch.library.Library("c10d", "IMPL")
    _aten = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": intended
        # allow_override: torch registers some of these from Python, and torch 2.11 refuses to
        # replace such a kernel unless asked (2.13 allows it by default)
        for op in _OPS:
            _library.impl(op, _kernel(op), "Meta", allow_override=True)
        _aten.impl("_local_scalar_dense", _meta_item, "Meta", allow_override=True)
        _aten.impl("_grouped_mm", _meta_grouped_mm, "Meta", allow_override=True)


def _meta_grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """torch's Meta kernel of _grouped_mm insists on bf16 (the CUDA kernel's rule); the CPU kernel a
    real run takes computes any float dtype. Same output shapes as torch's: 2d x 3d -> (S, N),
    3d x 3d -> (G, M, N), 2d x 2d (jagged K) -> (G, M, N), 3d x 2d (jagged N) -> (M, total N)."""
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    elif a.dim() == 2 and b.dim() == 2:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    else:
        shape = (a.shape[1], b.shape[-1])
    return a.new_empty(shape, dtype=out_dtype or a.dtype)


def _meta_item(t: torch.Tensor):
    """`.item()` of a meta tensor inside hypershard's C++ (a rule reading a bound, e.g. the largest
    token id of a vocab-parallel embedding): 0 / False, which no data-dependent check refuses.
    Model code's `.item()` is answered earlier by memory.LiveBytes (with the value a real batch gives)."""
    if t.dtype == torch.bool:
        return False
    return 0.0 if t.dtype.is_floating_point else 0


_sdpa = torch.nn.functional.scaled_dot_product_attention
DEVICES = ("cuda", "npu", "cpu")
# The SDPA backends torch's CUDA chooser tries, in order (aten/src/ATen/native/transformers/cuda/
# sdp_utils.cpp, priority_order): cuDNN first on sm90 / sm100 with a runtime cuDNN newer than 9.15
# (H100, H200, B200 with torch's CUDA 12.9+ / 13 wheels), else flash, efficient, math, cuDNN.
CUDA_SDPA_ORDER = ("cudnn", "flash", "efficient", "math")


def _low_precision(t) -> bool:
    return t.dtype in (torch.float16, torch.bfloat16)


def cuda_sdpa_backend(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False, order=CUDA_SDPA_ORDER
) -> str:
    """The backend torch's CUDA chooser (sdp_utils.cpp, select_sdp_backend) takes for these inputs on
    an sm90 GPU (H100 / H200) with cuDNN >= 9.10, checking what depends on shapes and dtypes only:
    - cudnn: fp16 / bf16; head dims of q/k and v at most 256 and multiples of 8; q and k one head
      dim; grouped key/value heads allowed; a mask allowed;
    - flash: fp16 / bf16; q, k, v one head dim, at most 256; no mask; causal only when the query and
      key lengths are equal; grouped heads allowed;
    - efficient: any float dtype; q and k one head dim; q and v head dims multiples of 8 (fp16 / bf16)
      or 4 (fp32); a mask allowed; no grouped heads;
    - math: anything (the S x S scores materialised)."""
    dq, dk, dv = query.shape[-1], key.shape[-1], value.shape[-1]
    grouped = key.dim() >= 3 and key.shape[-3] != query.shape[-3]
    low = _low_precision(query)
    for backend in order:
        if backend == "cudnn":
            ok = low and dq == dk and max(dq, dv) <= 256 and dq % 8 == 0 and dv % 8 == 0
        elif backend == "flash":
            square = query.shape[-2] == key.shape[-2]
            ok = low and dq == dk == dv <= 256 and attn_mask is None and (square or not is_causal)
        elif backend == "efficient":
            align = 8 if low else 4
            ok = dq == dk and dq % align == 0 and dv % align == 0 and not grouped
        else:
            ok = True
        if ok:
            return backend
    return "math"


def _meta_attention(kernel):
    """F.scaled_dot_product_attention's signature around a device's kernel choice on meta: a call on
    real tensors runs torch's own SDPA; on meta, `kernel(query, key, value, sdpa)` gets the other
    arguments as one dict (attn_mask, dropout_p, is_causal, scale, enable_gqa)."""

    @functools.wraps(kernel)
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        sdpa = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if not query.is_meta:
            return _sdpa(query, key, value, **sdpa)
        return kernel(query, key, value, sdpa)

    return attention


@_meta_attention
def _cuda_attention(query, key, value, sdpa: dict):
    """F.scaled_dot_product_attention on meta as CUDA dispatch lowers it: the backend torch's chooser
    takes (cuda_sdpa_backend) and the lowering of hypershard.testing.cuda_lowering (the one its CUDA
    trace uses): aten::_scaled_dot_product_{cudnn,flash,efficient}_attention and their backwards, whose
    Meta kernels give the outputs a GPU keeps: out and the fp32 logsumexp (no S x S matrix)."""
    from ..testing.cuda_lowering import lowered_sdpa

    backend = cuda_sdpa_backend(
        query, key, value, sdpa["attn_mask"], sdpa["dropout_p"], sdpa["is_causal"], sdpa["enable_gqa"]
    )
    if _active is not None:
        _active.kernels[f"sdpa {backend}"] += 1
    return lowered_sdpa(backend, query, key, value, **sdpa)


@_meta_attention
def _cpu_attention(query, key, value, sdpa: dict):
    """F.scaled_dot_product_attention on meta as a CPU run computes it. torch picks the kernel by
    the query's device type, and on meta that is the math path (a softmax of the whole score
    matrix: other memory, other ops); a real CPU run takes the fused flash kernel."""
    # torch's CPU flash check: 4-d, float dtypes, no dropout, one head size for q, k and v.
    if not (
        query.dim() == 4
        and sdpa["dropout_p"] == 0.0
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and query.shape[-1] == key.shape[-1] == value.shape[-1]
    ):
        if _active is not None:
            _active.kernels["sdpa math"] += 1
        return _sdpa(query, key, value, **sdpa)
    if _active is not None:
        _active.kernels["sdpa flash_for_cpu"] += 1
    if sdpa["enable_gqa"] and key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, sdpa["dropout_p"], sdpa["is_causal"], attn_mask=sdpa["attn_mask"], scale=sdpa["scale"]
    )[0]


# npu_fusion_attention's saved softmax statistics: softmax_max and softmax_sum, each [B, N, S, 8]
# float32 (torch_npu's layout, csrc/ops/attention.cpp's "bhL8"), against CUDA's one fp32 logsumexp per row.
NPU_STATISTICS_WIDTH = 8


class _KeepStatistics(torch.autograd.Function):
    """Identity on the attention output that holds npu_fusion_attention's softmax_max / softmax_sum
    until the backward reaches the attention (the node runs just before the attention's own)."""

    @staticmethod
    def forward(ctx, out, softmax_max, softmax_sum):
        ctx.save_for_backward(softmax_max, softmax_sum)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


@_meta_attention
def _npu_attention(query, key, value, sdpa: dict):
    """F.scaled_dot_product_attention on meta as an Ascend NPU runs it: torch_npu dispatches to
    npu_fusion_attention (a flash-style fused kernel: no S x S matrix kept; its grad recomputes the
    scores blockwise), which saves query, key, value, the output and softmax_max / softmax_sum,
    [B, N, S, 8] float32 each. torch_npu is not installed here, so the kernel is a stand-in: the
    PrivateUse1 fused-attention hook (aten::_scaled_dot_product_fused_attention_overrideable, the
    op torch routes a PrivateUse1 device's SDPA to; its Meta kernel: out + a [B, N, S] fp32
    logsumexp, and its backward) for the output, the FLOPs and q / k / v / out saved, plus the two
    statistics tensors allocated like the query (sharded alike: new_empty's rule) and held to the
    backward. Over-counts the logsumexp's 4 bytes per row (1/16 of the statistics)."""
    from ..testing.cuda_lowering import lowered_sdpa

    if _active is not None:
        _active.kernels["npu_fusion_attention"] += 1
    if key.size(-3) != query.size(-3):
        sdpa = {**sdpa, "enable_gqa": True}  # npu_fusion_attention takes grouped key/value heads (N1 != N2) as they are
    out = lowered_sdpa("overrideable", query, key, value, **sdpa)
    if not (torch.is_grad_enabled() and out.requires_grad):
        return out
    shape = (*query.shape[:-1], NPU_STATISTICS_WIDTH)
    softmax_max = query.new_empty(shape, dtype=torch.float32)
    softmax_sum = query.new_empty(shape, dtype=torch.float32)
    return _KeepStatistics.apply(out, softmax_max, softmax_sum)


_ATTENTION = {"cpu": _cpu_attention, "cuda": _cuda_attention, "npu": _npu_attention}


class recording:
    """``with recording() as log:`` records every collective on a simulated mesh into `log`."""

    def __init__(self, trace: bool = False, device: str = "cpu"):
        if device not in _ATTENTION:
            raise ValueError(f"hypershard: plan: device {device!r} is not modelled; allowed: {sorted(_ATTENTION)}")
        self.log = CollectiveLog(trace=trace)
        self.device = device

    def __enter__(self) -> CollectiveLog:
        global _active, _last_counted
        _install()
        _active, _last_counted = self.log, _C.traffic()["bytes_sent"]
        torch.nn.functional.scaled_dot_product_attention = _ATTENTION[self.device]
        return self.log

    def __exit__(self, *exc) -> None:
        global _active
        _active = None
        torch.nn.functional.scaled_dot_product_attention = _sdpa
