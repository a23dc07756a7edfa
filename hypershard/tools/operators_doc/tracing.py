"""Tracing: which calls of which overloads a piece of eager code makes (a TorchDispatchMode), and
PyTorch's OpInfo samples (forward, in-place variant and backward) as that code."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable

import torch

from .calls import Call, bind, op_key, score, to_meta

SAMPLES_PER_OPINFO = 4  # forward samples traced per OpInfo
GRAD_SAMPLES_PER_OPINFO = 2  # of them traced forward and backward
FOREACH_SAMPLES_FACTOR = 4
DTYPES = (torch.float32, torch.int64, torch.bool)  # an OpInfo's samples: the first it supports
CANDIDATES_PER_OP = 4  # traced calls kept per overload, best first


class Recorder:
    """Every ATen/custom call a piece of eager code makes (a TorchDispatchMode), kept per
    overload: the CANDIDATES_PER_OP best-scoring calls, the earliest first among equals."""

    def __init__(self, wanted: set):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self
        self.wanted = wanted
        self.calls: dict = {}
        self.order = itertools.count()
        self.source = ""

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                recorder.record(func, args, kwargs, out)
                return out

        self.mode_type = Mode

    def record(self, func, args, kwargs, out) -> None:
        key = op_key(func)
        if key not in self.wanted:
            return
        outs = [t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
        call = Call(
            func, bind(func, to_meta(tuple(args)), to_meta(dict(kwargs))), [to_meta(t) for t in outs], self.source
        )
        kept = self.calls.setdefault(key, [])
        kept.append((-score(call), next(self.order), call))
        kept.sort(key=lambda item: item[:2])
        del kept[CANDIDATES_PER_OP:]

    def trace(self, source: str, fn: Callable[[], Any]) -> None:
        self.source = source
        try:
            with self.mode_type():
                fn()
        except Exception:  # noqa: BLE001 -- a sample torch itself rejects: the calls before count
            pass

    def result(self) -> dict:
        return {key: [call for _, _, call in kept] for key, kept in self.calls.items()}


def backward(outputs: Any, inputs: list) -> None:
    flat = [
        t
        for t in (outputs if isinstance(outputs, (list, tuple)) else [outputs])
        if isinstance(t, torch.Tensor) and t.grad_fn is not None and t.dtype.is_floating_point
    ]
    if flat and inputs:
        torch.autograd.grad(flat, inputs, [torch.ones_like(t) for t in flat], allow_unused=True)


def _leaves(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad and value.is_leaf else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _leaves(v)]
    return []


def seed_cpu(seed: int) -> None:
    """torch.manual_seed for the CPU generator alone (torch.manual_seed also queues a seed for
    every lazily initialised accelerator module, with a formatted stack trace each time)."""
    torch.default_generator.manual_seed(seed)


@contextlib.contextmanager
def fast_samples():
    """Two costs of OpInfo's sample iterators that do nothing here, skipped for the duration:
    every sample looks for the running unittest test through inspect.stack() (extract_test_fn,
    ~3 ms a frame, more under pytest's deep stacks; outside a unittest.TestCase it finds None),
    and reseeds through torch.manual_seed (see seed_cpu; set_rng_seed here seeds the same CPU,
    random and numpy generators). Together most of the generation's time."""
    import random

    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    def set_rng_seed(seed=None):
        seed = common_utils.SEED if seed is None else seed
        seed_cpu(seed)
        random.seed(seed)
        if common_utils.TEST_NUMPY:
            common_utils.np.random.seed(seed)

    saved = common_utils.extract_test_fn, core.extract_test_fn, common_utils.set_rng_seed
    common_utils.extract_test_fn = core.extract_test_fn = lambda: None
    common_utils.set_rng_seed = set_rng_seed
    try:
        yield
    finally:
        common_utils.extract_test_fn, core.extract_test_fn, common_utils.set_rng_seed = saved


@contextlib.contextmanager
def saved_rng():
    """OpInfo's samples reseed torch, random and numpy: their states come back afterwards."""
    import random

    python_state = random.getstate()
    try:
        import numpy

        numpy_state = numpy.random.get_state()
    except ImportError:
        numpy = numpy_state = None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy is not None:
                numpy.random.set_state(numpy_state)


def _opinfos() -> list:
    """[(OpInfo, dtype)]: op_db, then the _foreach_* OpInfos, each with the first of DTYPES its
    CPU samples support (float32 mostly; int64 or bool for the bitwise ops)."""
    from torch.testing._internal import common_methods_invocations as cmi

    out = []
    for op in [
        *cmi.op_db,
        *cmi.foreach_unary_op_db,
        *cmi.foreach_binary_op_db,
        *cmi.foreach_pointwise_op_db,
        *cmi.foreach_reduce_op_db,
        *cmi.foreach_other_op_db,
    ]:
        supported = op.supported_dtypes("cpu")
        dtype = next((d for d in DTYPES if d in supported), None)
        if dtype is not None:
            out.append((op, dtype))
    return out


def _samples(op, dtype, requires_grad: bool, count: int) -> list:
    from torch.testing._internal.opinfo.core import ForeachFuncInfo

    extra = {}
    if isinstance(op, ForeachFuncInfo):  # lists of two tensors; the ScalarList samples come late
        extra, count = {"num_input_tensors": [2]}, count * FOREACH_SAMPLES_FACTOR
    seed_cpu(0)
    try:
        return list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=requires_grad, **extra), count))
    except Exception:  # noqa: BLE001 -- an OpInfo without CPU samples of this dtype
        return []


def trace_opinfo(recorder: Recorder) -> None:
    from ...testing.opinfo_common import fresh_copy
    from ...testing.opinfo_common import op_key as opinfo_key

    for op, dtype in _opinfos():
        name = opinfo_key(op)
        for sample in _samples(op, dtype, False, SAMPLES_PER_OPINFO):
            args, kwargs = fresh_copy([sample.input, *sample.args]), fresh_copy(dict(sample.kwargs))
            recorder.trace(name, lambda: op(*args, **kwargs))
            if op.inplace_variant is not None:
                args, kwargs = fresh_copy([sample.input, *sample.args]), fresh_copy(dict(sample.kwargs))
                recorder.trace(name, lambda: op.inplace_variant(*args, **kwargs))
        if op.supports_autograd and dtype.is_floating_point:
            for sample in _samples(op, dtype, True, GRAD_SAMPLES_PER_OPINFO):
                recorder.trace(
                    name,
                    lambda: backward(
                        op(sample.input, *sample.args, **sample.kwargs),
                        _leaves([sample.input, sample.args, sample.kwargs]),
                    ),
                )
