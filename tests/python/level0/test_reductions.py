"""Level 0: the reductions family (csrc/ops/reductions.cpp) on real multi-process gloo meshes.

Every case distributes seeded global inputs with the given placements, runs the op on DTensors
and compares the gathered output (twice: the second call hits the plan cache) and the input
gradients (backward of a seeded random cotangent) with the same op on plain tensors in one
process. Expect-error cases check that EVERY rank raises the same message. Cases are batched:
one launch per world size (2 and 4 ranks), each running all its cases, with a timeout that kills
the ranks.

TODO(harness): switch to hypershard.testing (Case/Input/run_cases) once it lands in main; this
file keeps a small self-contained launcher until then (spawned ranks, a free port from bind(0),
gloo, OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import multiprocessing as mp
import os
import queue as queue_module
import signal
import socket
import time
import traceback
import warnings
from typing import Callable, Optional

import pytest
import torch

LAUNCH_TIMEOUT_S = 240.0  # per launch; a hang kills the ranks and fails every case left
M2, M4, M22 = (2,), (4,), (2, 2)
MESH_NAMES = {M2: ("dp",), M4: ("dp",), M22: ("dp", "tp")}
WORLD = {M2: 2, M4: 4, M22: 4}
INF = float("inf")


# ------------------------------------------------------------------------------------ cases

@dataclasses.dataclass(frozen=True)
class Inp:
    shape: tuple
    spec: object                 # placements per mesh axis ("S(0)", "R", "P(sum)") or an alias tuple
    dtype: str = "float32"
    init: str = "randn"          # randn | ties (small integers) | nan (randn with NaNs) | randint | bool | pos


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: str                      # key into FNS
    mesh: tuple
    inputs: tuple
    grad: bool = True            # compare input gradients too
    expect_error: Optional[str] = None
    expect_placements: Optional[tuple] = None  # repr of output 0's placements


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _sum_out(x):
    out_shape = list(x.shape[1:])
    import hypershard as hs
    if hs._C.is_dtensor(x):
        out = hs.distribute_tensor(torch.zeros(out_shape, dtype=x.dtype), x.device_mesh, ["R"] * x.device_mesh.ndim)
    else:
        out = torch.zeros(out_shape, dtype=x.dtype)
    torch.sum(x, 0, out=out)
    return out


FNS: dict[str, Callable] = {
    # linear
    "sum": lambda x: x.sum(),
    "sum_0": lambda x: x.sum(0),
    "sum_m1_kd": lambda x: x.sum(-1, keepdim=True),
    "sum_01": lambda x: x.sum((0, 1)),
    "sum_empty_dims": lambda x: torch.ops.aten.sum.dim_IntList(x, []),
    "sum_f64": lambda x: x.sum(0, dtype=torch.float64),
    "sum_all_f64": lambda x: x.sum(dtype=torch.float64),
    "sum_out": _sum_out,
    "mean": lambda x: x.mean(),
    "mean_0": lambda x: x.mean(0),
    "mean_m1_kd": lambda x: x.mean(-1, keepdim=True),
    "mean_01": lambda x: x.mean((0, 1)),
    "mean_f64": lambda x: x.mean(0, dtype=torch.float64),
    # collective
    "amax_0": lambda x: x.amax(0),
    "amax_m1_kd": lambda x: x.amax(-1, keepdim=True),
    "amax_all": lambda x: x.amax((0, 1)),
    "amin_0": lambda x: x.amin(0),
    "amin_m2_kd": lambda x: x.amin(-2, keepdim=True),
    "max": lambda x: x.max(),
    "min": lambda x: x.min(),
    "prod": lambda x: x.prod(),
    "prod_0": lambda x: x.prod(0),
    "prod_m1_kd": lambda x: x.prod(-1, keepdim=True),
    "prod_0_f64": lambda x: x.prod(0, dtype=torch.float64),
    "any": lambda x: x.any(),
    "any_0": lambda x: x.any(0),
    "any_m1_kd": lambda x: x.any(-1, keepdim=True),
    "any_01": lambda x: torch.any(x, dim=(0, 1)),
    "all": lambda x: x.all(),
    "all_0": lambda x: x.all(0),
    "all_m1_kd": lambda x: x.all(-1, keepdim=True),
    "all_01": lambda x: torch.all(x, dim=(0, 1)),
    "norm": lambda x: torch.linalg.vector_norm(x),
    "norm2_0": lambda x: torch.linalg.vector_norm(x, 2, dim=0),
    "norm1_m1_kd": lambda x: torch.linalg.vector_norm(x, 1, dim=-1, keepdim=True),
    "norm3_0": lambda x: torch.linalg.vector_norm(x, 3, dim=0),
    "norm_half": lambda x: torch.linalg.vector_norm(x, 0.5),
    "norm_neg1_0": lambda x: torch.linalg.vector_norm(x, -1, dim=0),
    "norm0_0": lambda x: torch.linalg.vector_norm(x, 0, dim=0),
    "norm_inf_0": lambda x: torch.linalg.vector_norm(x, INF, dim=0),
    "norm_inf": lambda x: torch.linalg.vector_norm(x, INF),
    "norm_neginf_0": lambda x: torch.linalg.vector_norm(x, -INF, dim=0),
    "norm_f64": lambda x: torch.linalg.vector_norm(x, 2, dim=(0, 1), dtype=torch.float64),
    # select
    "max_0": lambda x: x.max(0),
    "max_m1_kd": lambda x: x.max(-1, keepdim=True),
    "min_0": lambda x: x.min(0),
    "min_1": lambda x: x.min(1),
    "argmax": lambda x: x.argmax(),
    "argmax_kd": lambda x: x.argmax(keepdim=True),
    "argmax_0": lambda x: x.argmax(0),
    "argmax_m1_kd": lambda x: x.argmax(-1, keepdim=True),
    "argmin": lambda x: x.argmin(),
    "argmin_0": lambda x: x.argmin(0),
    # moments
    "var": lambda x: x.var(),
    "var_0": lambda x: x.var(0),
    "var_m1_kd": lambda x: x.var(-1, keepdim=True),
    "var_0_c0": lambda x: x.var(0, correction=0),
    "std": lambda x: x.std(),
    "std_0": lambda x: x.std(0),
    "std_1_c2": lambda x: x.std(1, correction=2),
    "std_01_kd": lambda x: x.std((0, 1), keepdim=True),
    # foreach
    "foreach_norm": lambda a, b: torch._foreach_norm([a, b]),
    "foreach_norm_inf": lambda a, b: torch._foreach_norm([a, b], INF),
    "foreach_norm3": lambda a, b: torch._foreach_norm([a, b], 3),
    # compositions (sum-Partial flowing through linear ops, mean's backward)
    "softmax_like": lambda x: (x - x.amax(-1, keepdim=True)).exp().sum(-1),
    "mean_then_mul": lambda x: x.mean(0) * 3.0,
}

# Gradients reach ops outside this family (see the family header); forward still compared:
#   max.dim/min.dim  -> scatter_ into a plain zeros tensor (value_selecting_reduction_backward)
#   prod.default     -> nonzero
NO_BACKWARD = {"max_0", "max_m1_kd", "min_0", "min_1", "prod", "norm0_0"}  # norm0: no gradient in torch
# Backward divides by mask.sum(dim) (a Partial(sum) count when the reduced dim is sharded); the
# pointwise family rejects a Partial divisor. These get grad=False on sharded reduced dims and
# one tripwire case each (expect_error) below.
PARTIAL_DIVISOR_BACKWARD = {"amax_0", "amax_m1_kd", "amax_all", "amin_0", "amin_m2_kd", "max", "min",
                            "norm_inf_0", "norm_inf", "norm_neginf_0", "softmax_like"}

FLOAT_FNS = [name for name in FNS if not name.startswith(("any", "all", "foreach", "arg", "sum_out"))]
ARG_FNS = [name for name in FNS if name.startswith("arg")]
BOOL_FNS = [name for name in FNS if name.startswith(("any", "all"))]

# Layouts per mesh: (shape, spec). Uneven: 5 over 2 (3, 2), 5 over 4 (2, 2, 1, 0: an empty
# shard), 3 over 2x2 nested (2 -> 1, 1 and 1 -> 1, 0: an empty shard).
LAYOUTS = {
    M2: [((4, 6), ["S(0)"]), ((5, 3), ["S(0)"]), ((4, 5), ["S(1)"]), ((4, 6), ["R"])],
    M4: [((5, 3), ["S(0)"]), ((6, 5), ["S(1)"]), ((2, 3, 4), ["S(2)"])],
    M22: [((4, 6), ["S(0)", "S(1)"]), ((3, 5), ["S(0)", "S(0)"]), ((5, 6), ["S(1)", "S(0)"]),
          ((4, 5), ["R", "S(1)"]), ((6, 3), (("tp", "dp"), "None"))],
}


def _sharded_dims(shape, spec) -> set:
    """Tensor dims that some mesh axis shards (for either notation)."""
    if isinstance(spec, tuple):
        return {d for d, entry in enumerate(spec) if entry not in ("None", None)}
    return {int(p[2:-1]) % len(shape) for p in spec if p.startswith("S(")}


def _reduced_dims(fn: str, ndim: int) -> set:
    probe = torch.zeros(*(range(2, 2 + ndim)))
    out = _first(FNS[fn](probe if not fn.startswith(("any", "all")) else probe.bool()))
    kept = [s for s in out.shape if s != 1]
    return {d for d, s in enumerate(probe.shape) if s not in kept}


def _make_cases() -> list:
    cases = []

    def add(fn, mesh, inputs, suffix="", **kw):
        tag = "|".join(f"{list(i.shape)}{i.spec}{'' if i.dtype == 'float32' else i.dtype}"
                       f"{'' if i.init in ('randn', 'bool') else ':' + i.init}" for i in inputs)
        cases.append(Case(f"{fn}|{'x'.join(map(str, mesh))}|{tag}{suffix}", fn, mesh, tuple(inputs), **kw))

    for mesh, layouts in LAYOUTS.items():
        for shape, spec in layouts:
            if len(shape) != 2:
                continue
            sharded = _sharded_dims(shape, spec)
            for fn in FLOAT_FNS:
                grad = fn not in NO_BACKWARD and not (fn in PARTIAL_DIVISOR_BACKWARD and _reduced_dims(fn, 2) & sharded)
                add(fn, mesh, [Inp(shape, spec)], grad=grad)
            for fn in ARG_FNS:
                add(fn, mesh, [Inp(shape, spec)], grad=False)
                add(fn, mesh, [Inp(shape, spec, init="ties")], grad=False)
            for fn in BOOL_FNS:
                add(fn, mesh, [Inp(shape, spec, dtype="bool", init="bool")], grad=False)
            for fn in ("max_0", "min_1", "amax_0", "max"):
                add(fn, mesh, [Inp(shape, spec, init="ties")], grad=False)
            for fn in ("max_0", "min_1", "amax_0", "max", "argmax", "argmin_0", "norm_inf", "any_0"):
                add(fn, mesh, [Inp(shape, spec, init="nan")], grad=False)
            for fn in ("sum_0", "sum", "amax_0", "amin_m2_kd", "max", "max_0", "prod_0", "argmin_0"):
                add(fn, mesh, [Inp(shape, spec, dtype="int64", init="randint")], grad=False)
        # 3-d inputs and the foreach norm over two differently sharded tensors
        first = layouts[0]
        other = layouts[-1]
        for fn in ("foreach_norm", "foreach_norm_inf", "foreach_norm3"):
            add(fn, mesh, [Inp(*first), Inp(*other)], grad=fn != "foreach_norm_inf")
            add(fn, mesh, [Inp(*first), Inp((3,), ["R"] * len(mesh))], grad=fn != "foreach_norm_inf")
        add("sum_out", mesh, [Inp(*first)], grad=False)

    three_d = [(M4, (2, 3, 4), ["S(2)"]), (M4, (4, 5, 3), ["S(0)"]), (M22, (2, 5, 4), ["S(1)", "S(2)"])]
    for mesh, shape, spec in three_d:
        for fn in ("sum_01", "mean_01", "sum_m1_kd", "amax_all", "var_m1_kd", "std_01_kd", "max_m1_kd", "argmax",
                   "argmax_kd", "argmin_0", "norm_f64", "prod_m1_kd", "norm3_0"):
            grad = fn not in NO_BACKWARD and not (fn in PARTIAL_DIVISOR_BACKWARD and
                                                  _reduced_dims(fn, 3) & _sharded_dims(shape, spec))
            add(fn, mesh, [Inp(shape, spec, init="pos" if fn.startswith("prod") else "randn")], grad=grad)

    # Output placements: sum/mean -> Partial(sum); collective and select ops -> Replicate (global).
    P, R = "Partial(sum)", "Replicate()"
    placements = [
        ("sum_0", M2, (4, 6), ["S(0)"], (P,)), ("mean_0", M2, (5, 3), ["S(0)"], (P,)),
        ("sum_0", M2, (4, 6), ["S(1)"], ("Shard(dim=0)",)), ("sum_m1_kd", M22, (4, 6), ["S(0)", "S(1)"], ("Shard(dim=0)", P)),
        ("sum_01", M22, (3, 5), ["S(0)", "S(0)"], (P, P)), ("amax_0", M2, (4, 6), ["S(0)"], (R,)),
        ("max_0", M4, (5, 3), ["S(0)"], (R,)), ("argmax_0", M4, (5, 3), ["S(0)"], (R,)),
        ("var_0", M22, (5, 6), ["S(1)", "S(0)"], ("Shard(dim=0)", R)), ("norm2_0", M2, (4, 6), ["S(0)"], (R,)),
        ("prod_0", M2, (4, 6), ["S(0)"], (R,)), ("amax_0", M22, (4, 6), ["S(0)", "S(1)"], (R, "Shard(dim=0)")),
    ]
    for fn, mesh, shape, spec, expected in placements:
        add(fn, mesh, [Inp(shape, spec, init="pos" if fn.startswith("prod") else "randn")],
            grad=fn not in NO_BACKWARD and fn not in PARTIAL_DIVISOR_BACKWARD, expect_placements=expected,
            suffix="|placements")

    # Partial inputs the algebra keeps (a Partial leaf's gradient is compared as its full value).
    for mesh, spec in ((M2, ["P(sum)"]), (M22, ["P(sum)", "S(0)"]), (M22, ["S(1)", "P(sum)"])):
        for fn in ("sum", "sum_0", "sum_m1_kd", "mean", "mean_0", "mean_m1_kd", "mean_then_mul"):
            add(fn, mesh, [Inp((5, 4), spec)])
    add("sum_0", M2, [Inp((5, 4), ["P(sum)"])], expect_placements=("Partial(sum)",), suffix="|placements")
    add("mean_m1_kd", M22, [Inp((5, 4), ["P(avg)", "R"])], expect_placements=("Partial(avg)", "Replicate()"))
    for fn, op in (("amax_0", "max"), ("amax_m1_kd", "max"), ("max", "max"), ("amin_0", "min"), ("min", "min"),
                   ("prod_0", "prod"), ("prod", "prod")):
        add(fn, M2, [Inp((4, 5), [f"P({op})"], init="pos")], grad=False,
            expect_placements=(f"Partial({op})",))
        add(fn, M22, [Inp((4, 5), [f"P({op})", "S(0)"], init="pos")], grad=False)
    add("any_0", M2, [Inp((4, 5), ["P(max)"], dtype="bool", init="bool")], grad=False)
    add("all_m1_kd", M2, [Inp((4, 5), ["P(min)"], dtype="bool", init="bool")], grad=False)

    # Partial inputs the algebra rejects: every rank raises the same house error.
    errors = [
        ("amax_0", ["P(sum)"], "Partial(sum) input is not supported by this reduction; allowed: Replicate, Shard or Partial(max)"),
        ("amin_0", ["P(max)"], "allowed: Replicate, Shard or Partial(min)"),
        ("prod_0", ["P(sum)"], "allowed: Replicate, Shard or Partial(prod)"),
        ("sum_0", ["P(max)"], "Partial(max) input is not supported by this reduction; allowed: Replicate, Shard, Partial(sum)"),
        ("mean", ["P(min)"], "allowed: Replicate, Shard, Partial(sum)"),
        ("max_0", ["P(max)"], "Partial(max) input is not supported by this reduction; allowed: Replicate or Shard"),
        ("argmax", ["P(sum)"], "aten::argmax: argument self (#0)"),
        ("var_0", ["P(sum)"], "aten::var.correction: argument self (#0)"),
        ("std", ["P(avg)"], "Partial(avg) input is not supported"),
        ("norm2_0", ["P(sum)"], "aten::linalg_vector_norm: argument self (#0)"),
        ("any_0", ["P(sum)"], "allowed: Replicate, Shard or Partial(max)"),
    ]
    for fn, spec, message in errors:
        dtype, init = ("bool", "bool") if fn.startswith("any") else ("float32", "randn")
        add(fn, M2, [Inp((4, 5), spec, dtype=dtype, init=init)], grad=False, expect_error=message, suffix="|error")
    add("mean_0", M22, [Inp((4, 5), ["P(avg)", "S(0)"])], grad=False,
        expect_error="allowed: Replicate, Shard, Partial(sum), or Partial(avg) when no reduced dim is sharded")
    add("foreach_norm", M2, [Inp((4, 5), ["S(0)"]), Inp((3,), ["P(sum)"])], grad=False,
        expect_error="aten::_foreach_norm.Scalar: argument self[1] (#0)")
    # torch's own errors stay identical on every rank (an empty reduced dim, an integer mean).
    add("amax_0", M2, [Inp((0, 3), ["S(0)"])], grad=False, expect_error="Expected reduction dim 0 to have non-zero size")
    add("mean_0", M2, [Inp((4, 3), ["S(0)"], dtype="int64", init="randint")], grad=False,
        expect_error="mean(): could not infer output dtype")
    # Tripwires: backward paths that need other families today (see PARTIAL_DIVISOR_BACKWARD and
    # NO_BACKWARD). When one of these starts passing, give the matching cases grad=True.
    tripwire = {"grad": True, "suffix": "|backward-gap"}
    add("amax_0", M2, [Inp((4, 5), ["S(0)"])], expect_error="backward:hypershard: aten::div.Tensor: argument other", **tripwire)
    add("max_0", M2, [Inp((4, 5), ["S(0)"])], expect_error="backward:hypershard: Missing operator aten::scatter_", **tripwire)
    add("prod", M2, [Inp((4, 5), ["S(0)"], init="pos")], expect_error="backward:hypershard: Missing operator aten::nonzero",
        **tripwire)
    names = [case.name for case in cases]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)
    return cases


CASES = _make_cases()
CASES_BY_NAME = {case.name: case for case in CASES}


# ------------------------------------------------------------------------------------ one case

def _global_input(inp: Inp, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, inp.dtype)
    if inp.init == "bool":
        return torch.rand(inp.shape, generator=g) > 0.7
    if inp.init == "randint":
        return torch.randint(-50, 50, inp.shape, generator=g, dtype=dtype)
    if inp.init == "ties":
        return torch.randint(0, 3, inp.shape, generator=g).to(dtype)
    t = torch.randn(inp.shape, generator=g, dtype=dtype)
    if inp.init == "pos":
        return t.abs() + 0.5
    if inp.init == "nan":
        t[torch.rand(inp.shape, generator=g) > 0.85] = float("nan")
    return t


def _seed(name: str, i: int) -> int:
    return (sum(ord(c) * (k + 1) for k, c in enumerate(name)) * 31 + i) % (2 ** 31)


def _compare(what: str, got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{what}: got {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"
    try:
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        elif not torch.equal(got, want):
            return f"{what}: got {got.tolist()}, expected {want.tolist()}"
    except AssertionError as e:
        return f"{what}: {str(e).splitlines()[0]} ({' '.join(str(e).split())[:300]})"
    return None


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _run_case(case: Case, mesh, hs) -> tuple[str, str]:
    """('passed' | 'failed' | 'raised', message) for this rank."""
    fn = FNS[case.fn]
    globals_ = [_global_input(inp, _seed(case.name, i)) for i, inp in enumerate(case.inputs)]
    floating = [t.is_floating_point() and case.grad for t in globals_]

    def distributed():
        xs = [hs.distribute_tensor(t.detach().clone().requires_grad_(f), mesh, inp.spec)
              for t, f, inp in zip(globals_, floating, case.inputs)]
        return xs, fn(*xs)

    if case.expect_error is not None:
        phase = ""
        try:
            xs, out = distributed()
            if case.expect_error.startswith("backward:"):
                phase = "backward:"
                y = _first(out)
                y.backward(hs.distribute_tensor(torch.ones(y.shape, dtype=y.dtype), mesh, ["R"] * len(case.mesh)))
        except Exception as e:  # noqa: BLE001 - every error is compared
            message = phase + str(e).strip().splitlines()[0]
            if case.expect_error not in message:
                return "failed", f"raised {message!r}, expected {case.expect_error!r}"
            return "raised", message
        return "failed", f"did not raise (expected {case.expect_error!r})"

    # single-process reference
    ref_in = [t.clone().requires_grad_(f) for t, f in zip(globals_, floating)]
    ref_out = _as_list(fn(*ref_in))
    cot = None
    if any(floating) and ref_out[0].requires_grad:
        y = ref_out[0]
        cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(_seed(case.name, 99)), dtype=y.dtype)
        ref_grads = torch.autograd.grad(y, [t for t in ref_in if t.requires_grad], cot, allow_unused=True)

    problems = []
    for attempt in range(2):  # the second call hits the plan cache
        xs, out = distributed()
        outs = _as_list(out)
        if len(outs) != len(ref_out):
            return "failed", f"{len(outs)} outputs, expected {len(ref_out)}"
        for k, (got, want) in enumerate(zip(outs, ref_out)):
            if not hs._C.is_dtensor(got):
                problems.append(f"output {k} is a plain tensor")
                continue
            problem = _compare(f"output {k} (call {attempt})", got.full_tensor(), want.detach())
            if problem:
                problems.append(problem)
        if case.expect_placements is not None:
            got = tuple(repr(p) for p in outs[0].placements)
            if got != case.expect_placements:
                problems.append(f"placements {got}, expected {case.expect_placements}")
        if problems:
            break
    if not problems and cot is not None:
        y = outs[0]
        y.backward(hs.distribute_tensor(cot, mesh, ["R"] * len(case.mesh)))
        grads = [x.grad for x in xs if x.requires_grad]
        for k, (got, want) in enumerate(zip(grads, ref_grads)):
            if got is None or want is None:
                if (got is None) != (want is None):
                    problems.append(f"grad {k}: got {got is not None and 'a tensor'}, expected {want}")
                continue
            problem = _compare(f"grad {k}", got.full_tensor(), want)
            if problem:
                problems.append(problem)
    return ("failed", "; ".join(problems)) if problems else ("passed", "")


# ------------------------------------------------------------------------------------ launcher

def _worker(rank: int, world: int, port: int, names: list, results) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent dumps stacks on a timeout
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*degrees of freedom is <= 0")  # var over one element: nan, as torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    import hypershard as hs
    meshes = {shape: hs.init_device_mesh("cpu", shape, MESH_NAMES[shape])
              for shape in (M2, M4, M22) if WORLD[shape] == world}
    for name in names:
        case = CASES_BY_NAME[name]
        start = time.monotonic()
        try:
            status, message = _run_case(case, meshes[case.mesh], hs)
        except Exception:  # noqa: BLE001
            status, message = "failed", traceback.format_exc(limit=6).strip().replace("\n", " | ")[-1500:]
        results.put((rank, name, status, message, time.monotonic() - start))
    dist.barrier()
    dist.destroy_process_group()
    results.put((rank, None, "done", "", 0.0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, names: list, timeout: float = LAUNCH_TIMEOUT_S) -> dict:
    """Runs `names` on `world` spawned ranks; {name: (status, message)} merged over ranks."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world, port, names, results), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    per_case: dict = {}
    done = 0
    deadline = time.monotonic() + timeout
    try:
        while done < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, name, status, message, seconds = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(1.0)  # let the other ranks report what they can
                    break
                continue
            if name is None:
                done += 1
            else:
                per_case.setdefault(name, {})[rank] = (status, message)
    finally:
        if any(p.is_alive() for p in procs) and done < world:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1.0)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    merged = {}
    for name in names:
        ranks = per_case.get(name, {})
        if len(ranks) < world:
            merged[name] = ("failed", f"only ranks {sorted(ranks)} reported (timeout {timeout:.0f} s or a crash)")
            continue
        statuses = {s for s, _ in ranks.values()}
        messages = {m for _, m in ranks.values()}
        if statuses == {"passed"}:
            merged[name] = ("passed", "")
        elif statuses == {"raised"}:
            merged[name] = ("passed", "") if len(messages) == 1 else \
                ("failed", f"ranks raised different messages: {sorted(messages)}")
        else:
            merged[name] = ("failed", " / ".join(f"rank {r}: {m}" for r, (s, m) in sorted(ranks.items()) if s != "passed"))
    return merged


@pytest.fixture(scope="module")
def results() -> dict:
    merged = {}
    for world in (2, 4):
        names = [case.name for case in CASES if WORLD[case.mesh] == world]
        merged.update(launch(world, names))
    return merged


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_reduction(results, name):
    status, message = results[name]
    assert status == "passed", message


def test_rules_registered():
    import hypershard as hs
    reductions = {"aten::sum", "aten::sum.dim_IntList", "aten::sum.IntList_out", "aten::mean", "aten::mean.dim",
                  "aten::amax", "aten::amin", "aten::max", "aten::max.dim", "aten::min", "aten::min.dim",
                  "aten::argmax", "aten::argmin", "aten::var.correction", "aten::std.correction",
                  "aten::linalg_vector_norm", "aten::_foreach_norm.Scalar", "aten::prod", "aten::prod.dim_int",
                  "aten::any", "aten::any.dim", "aten::any.dims", "aten::all", "aten::all.dim", "aten::all.dims"}
    assert reductions <= set(hs._C.rule_names())
