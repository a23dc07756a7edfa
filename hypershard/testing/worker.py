"""The rank side of a launch: runs every case of the launch in one rank process.

Per case, every rank: writes its progress file, runs the single-process reference and the
distributed run (inputs from the same seeds), gathers every output and input gradient to plain
global tensors, compares, and appends one JSON record to its result file.  Ranks then meet
through the launch's TCPStore (not a collective, so a desynchronised process group cannot turn
the meeting into a hang or a mismatch); when any rank raised, they check that the process group
still works with a small all_reduce and recreate it if it does not, so later cases still run.

Files in the launch directory, per rank r: ``rank<r>.progress`` (JSON: index, name, phase),
``rank<r>.jsonl`` (one record per case, then ``{"type": "done"}``), ``rank<r>.log`` (the rank's
stdout/stderr, and the Python stacks dumped on SIGUSR1 when the launch times out).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from .adapters import Adapter
from .spec import PreparedCase, make_cotangent

__all__ = ["LaunchPlan", "compare_tensors", "current_mesh", "current_rank", "in_distributed_run", "rank_main"]

SETUP_ERROR_EXIT = 3

# What the case functions may ask about the run they are in (see in_distributed_run).
_STATE: dict[str, Any] = {"run": None, "mesh": None, "rank": None}


def in_distributed_run() -> bool:
    """True while the harness runs the distributed half of a case (False in the reference)."""
    return _STATE["run"] == "distributed"


def replicated(t: Any) -> Any:
    """Inside a case function: `t` (a hypershard DTensor) redistributed to Replicate on every mesh
    axis during the distributed half -- the reduction a tensor-parallel block ends with, or a
    Partial scalar made whole -- and `t` itself in the one-device reference."""
    if not in_distributed_run():
        return t
    import hypershard as hs  # lazily: this package does not import hypershard at module level

    return t.redistribute(placements=[hs.Replicate()] * t.device_mesh.ndim)


def current_mesh() -> Any:
    """The case's device mesh during the distributed half of a case, else None."""
    return _STATE["mesh"] if _STATE["run"] == "distributed" else None


def debug_checked(fn: Callable) -> Callable:
    """A case's dist_fn: `fn` with hypershard's debug checks on (hs.set_debug_checks), restored after."""

    def run(*inputs):
        import hypershard as hs  # lazily, as replicated() does

        saved = hs.debug_checks()
        hs.set_debug_checks(True)
        try:
            return fn(*inputs)
        finally:
            hs.set_debug_checks(saved)

    return run


def traffic_checked(fn: Callable, check: Callable) -> Callable:
    """A case's dist_fn that also checks what a call sends: ``fn`` runs once (its plans cached),
    then again with hypershard's traffic counters reset; ``check(inputs, out, sent_bytes)`` returns
    a list of problem texts, raised as one AssertionError naming this rank."""

    def run(*inputs):
        import hypershard as hs  # lazily, as replicated() does

        fn(*inputs)
        hs._C.reset_traffic()
        out = fn(*inputs)
        problems = check(inputs, out, hs._C.traffic()["bytes_sent"])
        if problems:
            raise AssertionError(f"rank {current_mesh().rank}: " + "; ".join(problems))
        return out

    return run


def layout_problems(out: Any, expect: Any) -> list:
    """For a case's dist_fn: [] when `out`'s layout is `expect` (placements, or (alias dims, partial)
    as hs.make_layout takes them; None expects nothing), else the one problem's text."""
    if expect is None:
        return []
    import hypershard as hs  # lazily, as replicated() does

    spec = expect if isinstance(expect, tuple) else (expect, None)
    want = hs.make_layout(current_mesh().mesh, list(out.shape), *spec)
    got = hs._C.layout_of(out)
    return [] if got == want else [f"output layout {got} != expected {want}"]


def current_rank() -> Optional[int]:
    """This process's rank inside a launch, else None."""
    return _STATE["rank"]


@contextlib.contextmanager
def _running(run: str, mesh: Any = None):
    saved = dict(_STATE)
    _STATE.update(run=run, mesh=mesh)
    try:
        yield
    finally:
        _STATE.update(run=saved["run"], mesh=saved["mesh"])


@dataclass
class LaunchPlan:
    """Everything a rank needs; handed over by fork, so cases may hold lambdas."""

    world_size: int
    store_host: str
    port_pipe: Any  # receiving end of a pipe: the parent sends the store's port after fork
    directory: str
    cases: list  # PreparedCase, in launch order
    adapter: Adapter
    device_type: str
    collective_timeout: float
    store_timeout: float
    parent_pid: int
    device_backend: str = "nccl"  # the process group's backend for CUDA tensors


# ---------------------------------------------------------------------------------------------
# process setup


def _die_with_parent(parent_pid: int) -> None:
    # A rank must never outlive the test process (pytest killed, CI cancelled): ask the kernel
    # to SIGKILL us when the parent goes.  Linux only; elsewhere the parent's cleanup has to do.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def _isolate(plan: LaunchPlan, rank: int):
    """Own process group (the parent kills the group), output to the rank's log, stack dumps on
    SIGUSR1, single-threaded torch (the machine has few cores and the parent forked us)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _die_with_parent(plan.parent_pid)
    log = open(os.path.join(plan.directory, f"rank{rank}.log"), "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(plan.world_size),
        LOCAL_WORLD_SIZE=str(plan.world_size),
        HYPERSHARD_TESTING_RANK=str(rank),
    )
    # torch's intra-op pool was set up in the parent; with one thread it is never entered here.
    torch.set_num_threads(1)
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are local
    return log


def _write_json(path: str, value: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(value, handle)
    os.replace(tmp, path)  # atomic: the parent never reads half a progress file


_HIDDEN_DIRS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def _short_exception(exc: BaseException, frames: int = 4, limit: int = 3000) -> str:
    """The exception line(s) and the innermost frames of the code under test (the harness's and
    torch's own frames are left out; c10 messages are cut at `limit` characters)."""
    message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    if len(message) > limit:
        message = message[:limit] + " ..."
    summary = traceback.extract_tb(exc.__traceback__)
    shown = [frame for frame in summary if not os.path.abspath(frame.filename).startswith(_HIDDEN_DIRS)] or summary[-2:]
    stack = "".join(traceback.format_list(shown[-frames:])).rstrip()
    return f"{message}\n{stack}" if stack else message


# ---------------------------------------------------------------------------------------------
# comparison


def _fmt(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else str(value)


def compare_tensors(
    label: str, got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float
) -> tuple[Optional[str], float, float]:
    """(problem or None, max abs diff, max rel diff) for ``|got - expected| <= atol +
    rtol * |expected|`` elementwise; NaNs must match NaNs, infinities must match exactly."""
    if tuple(got.shape) != tuple(expected.shape):
        return (f"{label}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}", math.inf, math.inf)
    if got.dtype != expected.dtype:
        return f"{label}: dtype {got.dtype}, expected {expected.dtype}", math.inf, math.inf
    if expected.numel() == 0:
        return None, 0.0, 0.0
    got, expected = got.detach().cpu(), expected.detach().cpu()
    wide = torch.complex128 if expected.dtype.is_complex else torch.float64
    g, e = got.to(wide), expected.to(wide)
    # Equal values (infinities included) and NaN-for-NaN match; otherwise the expected value
    # must be finite and the difference within tolerance (a NaN difference never is).
    same = (g == e) | (torch.isnan(g) & torch.isnan(e))
    diff = torch.where(same, torch.zeros(1, dtype=torch.float64), (g - e).abs())
    allowed = atol + rtol * e.abs()
    bad = ~same & ~(torch.isfinite(e) & (diff <= allowed))
    unbounded = torch.where(diff == 0, torch.zeros_like(diff), torch.full_like(diff, math.inf))
    rel = torch.where(e.abs() > 0, diff / e.abs().clamp_min(1e-300), unbounded)
    max_abs, max_rel = float(diff.max()), float(rel.max())
    count = int(bad.sum())
    if count == 0:
        return None, max_abs, max_rel
    excess = torch.where(bad, (diff - allowed).nan_to_num(nan=math.inf), torch.full_like(diff, -math.inf))
    where = tuple(int(i) for i in torch.unravel_index(torch.argmax(excess), tuple(g.shape)))
    return (
        f"{label}: {count} of {expected.numel()} elements differ; max abs diff "
        f"{_fmt(max_abs)}, max rel diff {_fmt(max_rel)} (rtol={rtol:g}, atol={atol:g}); "
        f"worst at {where}: got {got[where].item()!r}, expected {expected[where].item()!r}",
        max_abs,
        max_rel,
    )


@dataclass
class _RunOutput:
    outputs: list  # gathered output leaves (tensors or Python values)
    spec: Any  # pytree spec of the outputs
    requires_grad: list  # per output leaf
    grads: Optional[list]  # gathered grads of the inputs that want grad, or None
    inputs_after: Optional[list]


# ---------------------------------------------------------------------------------------------
# the rank's loop


class _Rank:
    def __init__(self, rank: int, plan: LaunchPlan):
        self.rank, self.plan = rank, plan
        self.adapter = plan.adapter
        self.adapter.setup_rank()
        self.results = os.path.join(plan.directory, f"rank{rank}.jsonl")
        self.progress = os.path.join(plan.directory, f"rank{rank}.progress")
        self.generation = 0
        self.meshes: dict = {}
        if not plan.port_pipe.poll(plan.store_timeout):
            raise RuntimeError(f"rank {rank}: the parent never sent the store's port")
        port = plan.port_pipe.recv()
        plan.port_pipe.close()
        self.store = dist.TCPStore(
            plan.store_host, port, is_master=False, timeout=datetime.timedelta(seconds=plan.store_timeout)
        )

    # -- bookkeeping -------------------------------------------------------------------------
    def report(self, index: Optional[int], name: Optional[str], phase: str) -> None:
        _write_json(self.progress, {"index": index, "name": name, "phase": phase})

    def record(self, value: dict) -> None:
        with open(self.results, "a") as handle:
            handle.write(json.dumps(value) + "\n")

    def exchange(self, key: str, value: Any) -> list:
        """Every rank's `value` for `key`, through the store (waits for all ranks)."""
        self.store.set(f"{key}/{self.rank}", json.dumps(value))
        keys = [f"{key}/{r}" for r in range(self.plan.world_size)]
        self.store.wait(keys, datetime.timedelta(seconds=self.plan.store_timeout))
        return [json.loads(self.store.get(k)) for k in keys]

    # -- process group -----------------------------------------------------------------------
    def init_group(self) -> None:
        # Each generation gets its own key prefix, so a recreated group never sees old keys.
        # gloo for CPU tensors beside the device's backend: the health check and CPU-side exchanges
        # run on CPU (backend=None gives NCCL alone in torch 2.11 when a GPU is present)
        backend = "gloo" if self.plan.device_type == "cpu" else f"cpu:gloo,cuda:{self.plan.device_backend}"
        if self.plan.device_type == "cuda":
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"pg{self.generation}/", self.store),
            rank=self.rank,
            world_size=self.plan.world_size,
            timeout=datetime.timedelta(seconds=self.plan.collective_timeout),
        )

    def reset_group(self) -> None:
        self.meshes.clear()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        self.generation += 1
        self.init_group()

    def health_check(self) -> Optional[str]:
        """None when a small all_reduce over all ranks works, else what went wrong."""
        try:
            value = torch.ones(1)
            dist.all_reduce(value)
            if value.item() != self.plan.world_size:
                return f"all_reduce gave {value.item()}, expected {self.plan.world_size}"
            return None
        except Exception as exc:  # noqa: BLE001 -- any failure means the group is unusable
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def mesh(self, pc: PreparedCase) -> Any:
        # Meshes are created in case order, identically on every rank (creating sub-groups is
        # collective), and reused by later cases with the same shape and names.
        key = (self.plan.device_type, pc.mesh_shape, pc.mesh_names)
        if key not in self.meshes:
            self.meshes[key] = self.adapter.make_mesh(*key)
        return self.meshes[key]

    # -- one case ----------------------------------------------------------------------------
    def gather(self, value: Any) -> Any:
        if value is None:
            return None
        if self.adapter.is_dtensor(value):
            return self.adapter.full(value).detach()
        if isinstance(value, torch.Tensor):
            return value.detach()
        return value

    def execute(self, pc: PreparedCase, mesh: Any = None) -> _RunOutput:
        """Run the case's function once: reference (mesh None) or distributed."""
        case, distributed = pc.case, mesh is not None
        args = []
        for item, layout, seed in zip(case.inputs, pc.layouts, pc.seeds):
            value = item.make(seed)
            if self.plan.device_type != "cpu":  # the reference runs on the device too
                value = value.to(self.plan.device_type)
            if distributed and layout is not None:
                value = self.adapter.distribute(value, mesh, layout)
            if item.wants_grad:
                value.requires_grad_(True)
            args.append(value)
        fn = case.dist_fn if distributed and case.dist_fn is not None else case.fn
        on_device = self.plan.device_type != "cpu" and case.build_on_device
        with torch.device(self.plan.device_type) if on_device else contextlib.nullcontext():
            result = fn(*args)
        leaves, spec = tree_flatten(result)
        with torch.no_grad():
            outputs = [self.gather(leaf) for leaf in leaves]
            inputs_after = [self.gather(a) for a in args] if case.check_inputs else None
        requires_grad = [isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves]
        wanted = [i for i, item in enumerate(case.inputs) if item.wants_grad]
        grads = None
        if case.check_grad and wanted and any(requires_grad):
            roots, cotangents = [], []
            for index, leaf in enumerate(leaves):
                if not requires_grad[index]:
                    continue
                cot = make_cotangent(pc.cotangent_seed, index, tuple(leaf.shape), leaf.dtype).to(leaf.device)
                if distributed and self.adapter.is_dtensor(leaf):
                    cot = self.adapter.cotangent(cot, leaf, mesh, case.grad_placements)
                roots.append(leaf)
                cotangents.append(cot)
            torch.autograd.backward(roots, cotangents)
            with torch.no_grad():
                grads = [self.gather(self.adapter.grad_of(args[i])) for i in wanted]
        return _RunOutput(outputs, spec, requires_grad, grads, inputs_after)

    def compare(self, pc: PreparedCase, ref: _RunOutput, got: _RunOutput) -> dict:
        problems: list[str] = []
        worst = [0.0, 0.0]

        def check(label: str, g: Any, e: Any) -> None:
            if isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor):
                rtol, atol = pc.tolerance(e.dtype)
                problem, max_abs, max_rel = compare_tensors(label, g, e, rtol, atol)
                worst[0], worst[1] = max(worst[0], max_abs), max(worst[1], max_rel)
                if problem:
                    problems.append(problem)
            elif e is None and isinstance(g, torch.Tensor) and not g.any():
                pass  # no gradient vs an all-zero gradient: the same thing
            elif g is None and isinstance(e, torch.Tensor) and not e.any():
                pass
            elif isinstance(e, torch.Tensor) or isinstance(g, torch.Tensor):
                problems.append(f"{label}: got {type(g).__name__}, expected {type(e).__name__}")
            elif not (g == e):
                problems.append(f"{label}: got {g!r}, expected {e!r}")

        if ref.spec != got.spec:
            problems.append(f"output structure differs: got {got.spec}, expected {ref.spec}")
        else:
            single = len(ref.outputs) == 1
            for index, (g, e) in enumerate(zip(got.outputs, ref.outputs)):
                label = "output" if single else f"output[{index}]"
                check(label, g, e)
                if ref.requires_grad[index] != got.requires_grad[index]:
                    problems.append(
                        f"{label}: requires_grad {got.requires_grad[index]}, expected {ref.requires_grad[index]}"
                    )
        if (ref.grads is None) != (got.grads is None):
            problems.append(
                f"gradients: computed in the {'reference' if ref.grads is not None else 'distributed'} run only"
            )
        elif ref.grads is not None:
            wanted = [i for i, item in enumerate(pc.case.inputs) if item.wants_grad]
            for i, g, e in zip(wanted, got.grads, ref.grads):
                check(f"grad of input {i}", g, e)
        if ref.inputs_after is not None:
            for i, (g, e) in enumerate(zip(got.inputs_after, ref.inputs_after)):
                check(f"input {i} after the call", g, e)
        return {
            "status": "failed" if problems else "passed",
            "message": "\n".join(problems),
            "max_abs": worst[0],
            "max_rel": worst[1],
        }

    def run_case(self, pc: PreparedCase) -> dict:
        case = pc.case
        ref = None
        if case.expect_error is None:
            try:
                with _running("reference"):
                    ref = self.execute(pc)
            except Exception as exc:  # noqa: BLE001
                return {
                    "status": "error",
                    "raised": False,
                    "sticky": _sticky_device_error(exc),
                    "message": "the single-process reference raised (the case itself is "
                    "wrong):\n" + _short_exception(exc),
                }
        try:
            mesh = self.mesh(pc)
            with _running("distributed", mesh):
                got = self.execute(pc, mesh)
        except Exception as exc:  # noqa: BLE001
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            sticky = _sticky_device_error(exc)
            if case.expect_error is None:
                return {
                    "status": "error",
                    "raised": True,
                    "sticky": sticky,
                    "message": "the distributed run raised:\n" + _short_exception(exc),
                }
            if case.expect_error in f"{type(exc).__name__}: {exc}":
                return {"status": "passed", "raised": True, "message": "raised as expected: " + text.splitlines()[0]}
            return {
                "status": "failed",
                "raised": True,
                "sticky": sticky,
                "message": f"expected an error containing {case.expect_error!r}, got:\n" + _short_exception(exc),
            }
        if case.expect_error is not None:
            return {
                "status": "failed",
                "raised": False,
                "message": f"expected an error containing {case.expect_error!r}, but the distributed run succeeded",
            }
        return dict(self.compare(pc, ref, got), raised=False)

    # -- the launch --------------------------------------------------------------------------
    def run(self) -> None:
        self.report(None, None, "setup")
        self.init_group()
        for pc in self.plan.cases:
            name = pc.case.name
            self.report(pc.index, name, "run")
            start = time.perf_counter()
            record = {"status": "passed", "message": "", "raised": False}
            record.update(self.run_case(pc))
            record["duration"] = time.perf_counter() - start
            self.report(pc.index, name, "sync")
            sticky = record.pop("sticky", False)
            everyone = self.exchange(f"case{pc.index}", {"raised": record["raised"], "sticky": sticky})
            if any(peer["sticky"] for peer in everyone):
                # The device context is unusable (a device-side assert): every later case in this
                # process would fail with the same error. All ranks stop here; the launcher runs
                # the remaining cases in fresh processes.
                record.update(type="case", index=pc.index, name=name, rank=self.rank)
                self.record(record)
                self.record({"type": "restart", "rank": self.rank, "index": pc.index})
                return
            if any(peer["raised"] for peer in everyone):
                # After an error the ranks may have left collectives unmatched: make sure the
                # group still works, and recreate it for the next cases if it does not.
                self.report(pc.index, name, "health")
                problem = self.health_check()
                problems = self.exchange(f"health{pc.index}", problem)
                if any(problems):
                    self.reset_group()
                    detail = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
                    record["group_note"] = (
                        "the process group did not work after the error "
                        f"({detail}); it was recreated for the next cases"
                    )
                    if record["status"] == "passed":
                        record["status"] = "failed"
            record.update(type="case", index=pc.index, name=name, rank=self.rank)
            self.record(record)
        self.report(None, None, "teardown")
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        self.record({"type": "done", "rank": self.rank})
        self.report(None, None, "done")


def _sticky_device_error(exc: BaseException) -> bool:
    """An error after which the process's CUDA context is unusable (a device-side assert, an
    illegal address): torch raises them as AcceleratorError ("CUDA error: ...")."""
    return type(exc).__name__ == "AcceleratorError" or str(exc).startswith("CUDA error")


def rank_main(rank: int, plan: LaunchPlan) -> None:
    """Entry point of a forked rank process; never returns (exits with os._exit)."""
    code = 0
    try:
        log = _isolate(plan, rank)
        _STATE["rank"] = rank
        try:
            _Rank(rank, plan).run()
        except BaseException as exc:  # noqa: BLE001 -- reported to the parent, then exit
            traceback.print_exc()
            with open(os.path.join(plan.directory, f"rank{rank}.jsonl"), "a") as handle:
                handle.write(json.dumps({"type": "fatal", "rank": rank, "message": _short_exception(exc)}) + "\n")
            code = SETUP_ERROR_EXIT
        log.flush()
    except BaseException:  # noqa: BLE001
        code = SETUP_ERROR_EXIT
    finally:
        # Skip atexit handlers and finalizers inherited from the parent (pytest, torch).
        os._exit(code)


def counting(stat: str, fn):
    """fn, asserting in the distributed run that hypershard's dispatch_stats()[stat] grew during
    the call (e.g. "fallback_calls", "implicit_calls"): a case meant for that path cannot pass
    through another one unnoticed (when the op gets a rule, the case says so)."""

    def run(*args):
        if not in_distributed_run():
            return fn(*args)
        import hypershard as hs

        before = hs._C.dispatch_stats()[stat]
        out = fn(*args)
        assert hs._C.dispatch_stats()[stat] > before, f"no call counted in dispatch_stats()[{stat!r}]"
        return out

    return run
