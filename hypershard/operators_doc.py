"""python -m hypershard.operators_doc [--check] [--out docs/operators.md]

Writes docs/operators.md from the operator registry: every op with a distributed rule
(hypershard._C.rule_families()), grouped by family, each family with the header comment of its
csrc/ops/<family>.cpp, and per op what its rule plans for three layouts of the op's first tensor
argument on a 2-rank mesh: Shard(0), Shard(last dim) and Partial(sum). The layouts are PROBED:
the rule runs (hypershard.testing.planning, no processes) on arguments shaped like a real call of
the op, traced from PyTorch's OpInfo samples (forward, in-place variant and backward), from a
few calls of hypershard's own ops and the fused optimizers, and from calls written out here for
ops no trace reaches; an overload no call reaches borrows a sibling's call (add.Tensor's
arguments for add_.Tensor and add.out) where the schema takes them. The output is
deterministic (sorted, no times, no paths), so a test regenerates it and compares it with the
checked-in file; --check does the same and exits 1 when the file is stale.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import itertools
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
OPS_SOURCES = REPO_ROOT / "csrc" / "ops"
DEFAULT_OUT = REPO_ROOT / "docs" / "operators.md"
MESH_SHAPE = {"tp": 2}
PROBES = ("S(0)", "S(last)", "P")
SAMPLES_PER_OPINFO = 4  # forward samples traced per OpInfo
GRAD_SAMPLES_PER_OPINFO = 2  # of them traced forward and backward
FOREACH_SAMPLES_FACTOR = 4
DTYPES = (torch.float32, torch.int64, torch.bool)  # an OpInfo's samples: the first it supports
CANDIDATES_PER_OP = 4   # traced calls kept per overload, best first
STALE = "docs/operators.md is stale: run python -m hypershard.operators_doc"


# --------------------------------------------------------------------------------------------
# Tracing: which calls of which overloads a sample makes


@dataclass(frozen=True)
class TensorMeta:
    """A traced tensor argument: what the rule sees of it (no data)."""
    shape: tuple
    dtype: torch.dtype


@dataclass
class Call:
    op: Any          # the OpOverload
    bound: dict      # argument name -> value (TensorMeta for tensors), as passed
    outs: list       # TensorMeta of each returned tensor (out= overloads borrow them)
    source: str      # where the call came from (an OpInfo name, or a sibling overload)


def op_key(op) -> str:
    """"aten::add.Tensor" / "aten::abs": the name rule_families() uses."""
    schema = op._schema
    return schema.name + (f".{schema.overload_name}" if schema.overload_name else "")


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return [_meta(v) for v in value]
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    return value


def _tensors(value: Any) -> list:
    if isinstance(value, TensorMeta):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _bind(op, args: tuple, kwargs: dict) -> dict:
    bound = {}
    positional = [a for a in op._schema.arguments if not a.kwarg_only]
    for argument, value in zip(positional, args):
        bound[argument.name] = value
    bound.update(kwargs)
    return bound


def first_tensor(op, bound: dict) -> Optional[TensorMeta]:
    for argument in op._schema.arguments:
        found = _tensors(bound.get(argument.name))
        if found:
            return found[0]
    return None


def _score(call: Call) -> int:
    """Prefer calls whose first tensor has >= 2 dims of >= 2 elements each (Shard(0) and
    Shard(last) are different dims, no rank holds an empty shard, no size-1 broadcast dim)."""
    t = first_tensor(call.op, call.bound)
    if t is None or not t.shape or 0 in t.shape:
        return 0
    sized = t.shape[0] >= 2 and t.shape[-1] >= 2
    if sized and len(t.shape) >= 2:
        return 4 if min(t.shape) >= 2 else 3
    return 2 if sized else 1


class _Recorder:
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
        call = Call(func, _bind(func, _meta(tuple(args)), _meta(dict(kwargs))), [_meta(t) for t in outs], self.source)
        kept = self.calls.setdefault(key, [])
        kept.append((-_score(call), next(self.order), call))
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


def _backward(outputs: Any, inputs: list) -> None:
    flat = [t for t in (outputs if isinstance(outputs, (list, tuple)) else [outputs])
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and t.dtype.is_floating_point]
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


def _seed(seed: int) -> None:
    """torch.manual_seed for the CPU generator alone (torch.manual_seed also queues a seed for
    every lazily initialised accelerator module, with a formatted stack trace each time)."""
    torch.default_generator.manual_seed(seed)


@contextlib.contextmanager
def _fast_samples():
    """Two costs of OpInfo's sample iterators that do nothing here, skipped for the duration:
    every sample looks for the running unittest test through inspect.stack() (extract_test_fn,
    ~3 ms a frame, more under pytest's deep stacks; outside a unittest.TestCase it finds None),
    and reseeds through torch.manual_seed (see _seed; set_rng_seed here seeds the same CPU,
    random and numpy generators). Together most of the generation's time."""
    import random

    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    def set_rng_seed(seed=None):
        seed = common_utils.SEED if seed is None else seed
        _seed(seed)
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
def _saved_rng():
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
    for op in [*cmi.op_db, *cmi.foreach_unary_op_db, *cmi.foreach_binary_op_db, *cmi.foreach_pointwise_op_db,
               *cmi.foreach_reduce_op_db, *cmi.foreach_other_op_db]:
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
    _seed(0)
    try:
        return list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=requires_grad, **extra), count))
    except Exception:  # noqa: BLE001 -- an OpInfo without CPU samples of this dtype
        return []


def _trace_opinfo(recorder: _Recorder) -> None:
    from .testing.opinfo_sweep import _copy, _op_key

    for op, dtype in _opinfos():
        name = _op_key(op)
        for sample in _samples(op, dtype, False, SAMPLES_PER_OPINFO):
            args, kwargs = _copy([sample.input, *sample.args]), _copy(dict(sample.kwargs))
            recorder.trace(name, lambda: op(*args, **kwargs))
            if op.inplace_variant is not None:
                args, kwargs = _copy([sample.input, *sample.args]), _copy(dict(sample.kwargs))
                recorder.trace(name, lambda: op.inplace_variant(*args, **kwargs))
        if op.supports_autograd and dtype.is_floating_point:
            for sample in _samples(op, dtype, True, GRAD_SAMPLES_PER_OPINFO):
                recorder.trace(name, lambda: _backward(op(sample.input, *sample.args, **sample.kwargs),
                                                       _leaves([sample.input, sample.args, sample.kwargs])))


def _extra_calls() -> list:
    """[(source, fn)]: code that reaches ops no OpInfo does: hypershard's own ops, the CPU
    attention kernel, dropout, the fused optimizers."""
    from . import ops as hs_ops

    def grad_of(fn, *shapes):
        def run():
            _seed(0)
            leaves = [torch.randn(*s, requires_grad=True) for s in shapes]
            _backward(fn(*leaves), leaves)
        return run

    return [
        ("hypershard.ops.rms_norm", grad_of(lambda x, w: hs_ops.rms_norm(x, w), (4, 6, 16), (16,))),
        ("hypershard.ops.rotary_position_embedding",
         grad_of(lambda x, c, s: hs_ops.rotary_position_embedding(x, c, s, 0), (4, 2, 8, 16), (1, 1, 8, 16),
                 (1, 1, 8, 16))),
        ("F.scaled_dot_product_attention",
         grad_of(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v), (4, 2, 8, 16),
                 (4, 2, 8, 16), (4, 2, 8, 16))),
        ("F.dropout", grad_of(lambda x: torch.nn.functional.dropout(x, 0.5, training=True), (4, 6))),
        ("hypershard embedding_vocab_backward", lambda: torch.ops.hypershard.embedding_vocab_backward(
            torch.randn(4, 6, 16), torch.randint(0, 32, (4, 6)), 32, -1, False, [0])),
        *[(f"torch.optim.{name}(fused=True{', tensor lr' if tensor_lr else ''})", _optimizer_step(name, tensor_lr))
          for name in ("Adam", "AdamW", "SGD") for tensor_lr in (False, True)],
    ]


def _optimizer_step(name: str, tensor_lr: bool) -> Callable[[], None]:
    def run():
        _seed(0)
        params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
        for p in params:
            p.grad = torch.randn_like(p)
        lr = torch.tensor(0.01) if tensor_lr else 0.01
        kwargs = {"momentum": 0.9} if name == "SGD" else {}
        getattr(torch.optim, name)(params, lr=lr, fused=True, **kwargs).step()
    return run


def _manual_calls() -> list:
    """[(op name, arguments)]: calls written out for ops no trace reaches (composite ops that
    decompose before the dispatcher's Python mode, ops OpInfo has no sample for); TensorMeta
    stands for a tensor argument."""
    f32, i64 = torch.float32, torch.int64

    def t(*shape, dtype=f32):
        return TensorMeta(tuple(shape), dtype)

    x, y = t(4, 6), t(4, 6)
    return [
        ("aten::argsort", {"self": x, "dim": -1}),
        ("aten::argsort.stable", {"self": x, "stable": True, "dim": -1}),
        ("aten::msort", {"self": x}),
        ("aten::scatter.value_reduce", {"self": x, "dim": 1, "index": t(4, 3, dtype=i64), "value": 1.0,
                                        "reduce": "add"}),
        ("aten::_index_put_impl_", {"self": x, "indices": [t(3, dtype=i64)], "values": t(3, 6)}),
        ("aten::nll_loss2d_backward", {"grad_output": t(), "self": t(4, 6, 3, 3), "target": t(4, 3, 3, dtype=i64),
                                       "weight": None, "reduction": 1, "ignore_index": -100,
                                       "total_weight": t()}),
        ("aten::_grouped_mm", {"self": t(8, 16), "mat2": t(2, 16, 6), "offs": t(2, dtype=torch.int32)}),
        ("aten::contiguous", {"self": x}),
        ("aten::positive", {"self": x}),
        ("aten::square", {"self": x}),
        ("aten::bernoulli.Tensor", {"self": x, "p": y}),
        ("aten::bernoulli.p", {"self": x, "p": 0.5}),
        ("aten::bernoulli_.Tensor", {"self": x, "p": y}),
        ("aten::native_dropout", {"input": x, "p": 0.5, "train": True}),
        ("aten::rand_like", {"self": x}),
        ("aten::rand_like.generator", {"self": x, "generator": None}),
        ("aten::randn_like.generator", {"self": x, "generator": None}),
        ("aten::randint_like.generator", {"self": x, "high": 10, "generator": None}),
        ("aten::randint_like.low_generator_dtype", {"self": x, "low": 0, "high": 10, "generator": None}),
        ("aten::_reshape_alias", {"self": x, "size": [6, 4], "stride": [4, 1]}),
        ("aten::isfinite", {"self": x}),
        ("aten::relu6", {"self": x}),
        ("aten::selu", {"self": x}),
        ("aten::true_divide.Tensor", {"self": x, "other": y}),
        ("aten::max.other", {"self": x, "other": y}),
        ("aten::min.other", {"self": x, "other": y}),
        ("aten::float_power.Tensor_Tensor", {"self": x, "exponent": y}),
        ("aten::clip", {"self": x, "min": -1.0, "max": 1.0}),
        *[(f"aten::{name}.Tensor", {"self": t(4, 6, dtype=i64), "other": t(4, 6, dtype=i64)})
          for name in ("__lshift__", "__rshift__", "__xor__", "__ilshift__", "__irshift__", "__ixor__")],
    ]


def _meta_outputs(op, bound: dict) -> list:
    """TensorMeta of what `op` returns for `bound` (meta tensors: no data); [] when it cannot
    run on meta."""
    def real(value):
        if isinstance(value, TensorMeta):
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        if isinstance(value, list):
            return [real(v) for v in value]
        return value

    try:
        out = op(**{name: real(value) for name, value in bound.items()})
    except Exception:  # noqa: BLE001 -- the outputs only serve out= siblings
        return []
    return [_meta(t) for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]


def collect_samples(rules: Iterable[str]) -> dict:
    """{op name: [Call, ...]} for the ops in `rules` that a traced sample (or a written-out call)
    reaches, best first."""
    wanted = set(rules)
    recorder = _Recorder(wanted)
    with _fast_samples(), _saved_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trace_opinfo(recorder)
        for source, fn in _extra_calls():
            recorder.trace(source, fn)
    samples = recorder.result()
    for key, bound in _manual_calls():
        op = resolve(key)
        if op is not None and key in wanted:
            samples.setdefault(key, []).append(Call(op, bound, _meta_outputs(op, bound), "written out"))
    return samples


# --------------------------------------------------------------------------------------------
# Siblings: an overload no sample reaches takes a traced overload's arguments


def _stem(key: str) -> str:
    """aten::add_.Tensor, aten::add.out -> aten::add (one trailing "_" of an in-place name)."""
    name = key.split(".", 1)[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _type_ok(jit_type: str, value: Any) -> bool:
    if jit_type.startswith("Optional["):
        if value is None:
            return True
        jit_type = jit_type[len("Optional["):-1]
    if jit_type == "Tensor":
        return isinstance(value, TensorMeta)
    if jit_type.startswith("List["):
        inner = jit_type[len("List["):-1]
        if not isinstance(value, (list, tuple)):
            return inner in ("int", "SymInt") and isinstance(value, int) and not isinstance(value, bool)
        return all(_type_ok(inner, v) for v in value)
    if isinstance(value, (TensorMeta, list, tuple)) or value is None:
        return False
    if jit_type in ("int", "SymInt"):
        return isinstance(value, int) and not isinstance(value, bool)
    if jit_type == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if jit_type == "bool":
        return isinstance(value, bool)
    if jit_type == "number":
        return isinstance(value, (bool, int, float, complex))
    return True


_SCALARS = {"number": 2, "int": 2, "SymInt": 2, "float": 2.0, "bool": True}


def _rebind(call: Call, target, convert: bool) -> Optional[Call]:
    """`call`'s arguments for overload `target`, out= tensors from its outputs; None when the
    schema does not take them. convert: a tensor where `target` takes a scalar becomes the
    scalar 2 (True), a scalar where it takes a tensor a 0-d tensor (add.Tensor's call for
    add.Scalar and back)."""
    values, outs, bound = call.bound, list(call.outs), {}
    first = first_tensor(call.op, call.bound)
    for argument in target._schema.arguments:
        if argument.name in values:
            value = values[argument.name]
        elif argument.is_out:
            if not outs:
                return None
            value = outs.pop(0)
        elif argument.default_value is not None or str(argument.type).startswith("Optional["):
            continue
        else:
            return None
        jit_type = str(argument.type)
        if not _type_ok(jit_type, value):
            if not convert:
                return None
            if isinstance(value, TensorMeta) and jit_type in _SCALARS:
                value = _SCALARS[jit_type]
            elif (jit_type in ("Tensor", "Optional[Tensor]") and first is not None
                  and isinstance(value, (int, float)) and not isinstance(value, bool)):
                value = TensorMeta((), first.dtype)
            else:
                return None
        bound[argument.name] = value
    if set(values) - set(bound):
        return None
    return Call(target, bound, call.outs, f"{call.source} via {op_key(call.op).split('::')[1]}")


PROBED_NAMESPACES = ("aten", "hypershard")  # always loaded here: the document is the same
                                            # whether torch_npu or transformers is imported


def resolve(key: str):
    """The OpOverload of "ns::name.overload"; None for another library's op (npu::,
    transformers::), whether or not it is loaded."""
    namespace, _, rest = key.partition("::")
    if namespace not in PROBED_NAMESPACES:
        return None
    name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def sibling_calls(key: str, samples: dict) -> list:
    target = resolve(key)
    if target is None:
        return []
    stem = _stem(key)
    found = []
    for convert in (False, True):  # the calls that fit as they are first
        for other in sorted(k for k in samples if k != key and _stem(k) == stem):
            for call in samples[other]:
                rebound = _rebind(call, target, convert)
                if rebound is not None:
                    found.append((convert, -_score(rebound), len(found), rebound))
    return [call for *_, call in sorted(found, key=lambda item: item[:3])]


# --------------------------------------------------------------------------------------------
# Probing: the rule on Shard(0) / Shard(last) / Partial(sum) of the first tensor argument


@dataclass
class Probe:
    cells: dict = field(default_factory=dict)  # probe -> cell text
    kinds: dict = field(default_factory=dict)  # probe -> "local" | "moved" | "kept" | "refused" | ...
    expands: bool = False                      # for any probe
    expanded: dict = field(default_factory=dict)  # probe -> the plan expands
    sample: str = ""                           # the first tensor's shape and the call's source


def _house_clause(message: str) -> Optional[str]:
    """The problem of a hypershard error message, short: "self: Partial(sum) input is not
    supported by this op"; None for a message that is not hypershard's."""
    text = " ".join(message.split())
    if not text.startswith("hypershard: "):
        return None
    text = text[len("hypershard: "):]
    missing = re.match(r"Missing operator \S+ for these arguments \((.*?)\): no distributed rule", text)
    if missing:
        return "not covered: " + missing.group(1)
    if text.startswith("Missing operator"):
        return "no rule"
    text = text.split(": ", 1)[1] if ": " in text else text  # the op name
    argument = re.match(r"argument (\S+) \(#\d+\) \[[^\]]*\] \([^)]*\)(?: partial\([^)]*\))?: (.*)$", text)
    if argument:
        text = f"{argument.group(1)}: {argument.group(2)}"
    text = text.split("; allowed:", 1)[0].split(" (inputs:", 1)[0]
    return text if len(text) <= 90 else text[:87].rstrip() + "..."


def _spec_text(spec: Optional[list], ndim: Optional[int], negative: bool) -> str:
    if spec is None:
        return "none"
    text = spec[0]
    if negative and ndim and text.startswith("S("):
        text = f"S({int(text[2:-1]) - ndim})"
    return text


def _outputs_text(plan, negative: bool) -> str:
    texts = [_spec_text(spec, len(layout.global_shape) if layout is not None else None, negative)
             for spec, layout in zip(plan.output_specs, plan.outputs)]
    if not texts:
        return "—"
    runs = [(text, len(list(group))) for text, group in itertools.groupby(texts)]
    return ", ".join(text if count == 1 else f"{text} ×{count}" for text, count in runs)


def _movement(given: str, planned: str) -> Optional[str]:
    """The communication that takes `given` to `planned` on the one mesh axis, None for none
    (a Replicate cut to a shard or filled as a Partial moves nothing)."""
    if given == planned or given == "R":
        return None
    if given.startswith("P"):
        return "reduce-scattered" if planned.startswith("S(") else "reduced"
    if planned == "R":
        return "gathered"
    return f"resharded to {planned}" if planned.startswith("S(") else f"moved to {planned}"


def _tensor_items(call: Call) -> list:
    """[(argument name, item index or None, TensorMeta, is out=)] in schema order."""
    items = []
    for argument in call.op._schema.arguments:
        value = call.bound.get(argument.name)
        if isinstance(value, TensorMeta):
            items.append((argument.name, None, value, argument.is_out))
        elif isinstance(value, (list, tuple)):
            items.extend((argument.name, i, v, argument.is_out) for i, v in enumerate(value) if isinstance(v, TensorMeta))
    return items


def _given_spec(probe: str, meta: TensorMeta) -> str:
    if probe == "S(last)":
        return f"S({len(meta.shape) - 1})" if meta.shape else "R"
    if probe == "S(0)":
        return "S(0)" if meta.shape else "R"
    return probe  # "P", "R"


class Prober:
    """Plans a call with its first tensor argument laid out as a probe (every item of it, for a
    tensor list), the other tensor arguments shaped like it (item by item) laid out the same for
    the Shard probes, the rest Replicate."""

    def __init__(self):
        from .testing.planning import PlanningMesh

        self.mesh = PlanningMesh(MESH_SHAPE)

    def _run(self, call: Call, probe: str):
        """(plan or None, error text or None, [(argument, communication, planned spec)])."""
        from .testing.planning import plan

        items = _tensor_items(call)
        first_name = items[0][0]
        firsts = [meta for name, _, meta, _ in items if name == first_name]
        given = []
        for name, index, meta, _ in items:
            if name == first_name:
                spec = _given_spec(probe, meta)
            else:
                like = firsts[index] if index is not None and index < len(firsts) else firsts[0]
                spec = _given_spec(probe, meta) if probe.startswith("S") and meta.shape == like.shape else "R"
            given.append(spec)
        specs = iter(given)

        def realize(value):
            if isinstance(value, TensorMeta):
                return self.mesh.dtensor(list(value.shape), [next(specs)], value.dtype)
            if isinstance(value, (list, tuple)):
                return [realize(v) for v in value]
            return value

        # Schema order, the same order _tensor_items walks.
        args = {a.name: realize(call.bound[a.name]) for a in call.op._schema.arguments if a.name in call.bound}
        try:
            result = plan(call.op, **args)
        except Exception as exc:  # noqa: BLE001 -- the rule's refusal is the cell
            clause = _house_clause(str(exc))
            return None, (clause if clause is not None else "!" + type(exc).__name__), []
        moves = []
        planned = result.input_specs
        if len(planned) != len(given):  # not expected: the plan lists every tensor argument
            return None, f"!{len(planned)} input layouts for {len(given)} tensors", []
        for (name, _, _, is_out), spec, got in zip(items, given, planned):
            move = _movement(spec, got[0]) if got is not None and not is_out else None
            if move and not any(m[0] == name for m in moves):
                moves.append((name, move, got[0]))
        return result, None, moves

    def candidate_ok(self, call: Call) -> bool:
        """The rule plans the call all Replicate (the traced arguments fit the schema)."""
        if first_tensor(call.op, call.bound) is None:
            return False
        _, error, _ = self._run(call, "R")
        return error is None or not error.startswith("!")

    def probe(self, call: Call) -> Probe:
        items = _tensor_items(call)
        first_name = items[0][0]
        firsts = [meta for name, _, meta, _ in items if name == first_name]
        shapes = ", ".join(f"`{list(meta.shape)}`" for meta in firsts)
        out = Probe(sample=f"{shapes} {call.source}")
        for probe in PROBES:
            if probe != "P" and not firsts[0].shape:
                out.cells[probe], out.kinds[probe] = "0-d", "n/a"
                continue
            shown = {"S(0)": "S(0)", "S(last)": "S(-1)", "P": "P"}[probe]
            result, error, moves = self._run(call, probe)
            if result is None:
                if error.startswith("!"):
                    out.cells[probe], out.kinds[probe] = f"probe failed ({error[1:]})", "failed"
                elif error.startswith("not covered") or error == "no rule":
                    out.cells[probe], out.kinds[probe] = error, "not covered"
                else:
                    out.cells[probe], out.kinds[probe] = f"refused: {error}", "refused"
                continue
            out.expanded[probe] = bool(result.expands)
            out.expands = out.expands or bool(result.expands)
            own = [move for name, move, _ in moves if name == first_name]
            others = [f"{name} {move}" for name, move, _ in moves if name != first_name]
            cell = f"{own[0] if own else shown} → {_outputs_text(result, probe == 'S(last)')}"
            if others:
                cell += "; " + ", ".join(others)
            if result.refused:
                cell += " (strict: refused)"
            out.cells[probe] = cell
            out.kinds[probe] = "moved" if moves else "kept"
        return out


# --------------------------------------------------------------------------------------------
# The document


def family_header(family: str) -> Optional[str]:
    """The leading comment of csrc/ops/<family>.cpp, without the "// " marks; None without
    sources."""
    path = OPS_SOURCES / f"{family}.cpp"
    if not path.is_file():
        return None
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("//"):
            break
        lines.append(line[3:] if line.startswith("// ") else line[2:])
    return "\n".join(lines).rstrip()


def tabled_pointwise() -> Optional[set]:
    """The ops pointwise.cpp names in its tables (the rest come from the `pointwise` tag); None
    without sources."""
    path = OPS_SOURCES / "pointwise.cpp"
    if not path.is_file():
        return None
    return set(re.findall(r'"(aten::[A-Za-z0-9_.]+)"', path.read_text()))


@dataclass
class Row:
    op: str
    family: str
    probe: Optional[Probe]  # None: no sample
    why: str = "no sample"


def probe_rules(rules: list, samples: dict) -> list:
    """A Row per (op, family) of `rules`: probed with the first candidate call the rule plans."""
    from .dtensor import strict

    prober = Prober()
    with strict(False):  # plans do not depend on the mode; fixed all the same
        rows = [_probe_row(prober, op, family, samples) for op, family in sorted(rules)]
    return rows


def _probe_row(prober: Prober, op: str, family: str, samples: dict) -> Row:
    candidates = [*samples.get(op, []), *sibling_calls(op, samples)]
    chosen = next((c for c in candidates if prober.candidate_ok(c)), None)
    if chosen is not None:
        return Row(op, family, prober.probe(chosen))
    return Row(op, family, None, "no sample" if resolve(op) is not None else f"not probed: {op.split('::')[0]}'s op")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _short(op: str) -> str:
    return op[len("aten::"):] if op.startswith("aten::") else op


def _braces(ops: list) -> str:
    """["aten::acos", "aten::acos_", "aten::acos.out"] -> "acos{,_,.out}", per base name."""
    groups: dict = {}
    for op in ops:
        name = _short(op)
        base = _stem(name)
        groups.setdefault(base, []).append(name[len(base):])
    parts = []
    for base in sorted(groups):
        suffixes = sorted(groups[base])
        parts.append(f"`{base}{suffixes[0]}`" if len(suffixes) == 1 else f"`{base}{{{','.join(suffixes)}}}`")
    return ", ".join(parts)


def _table(rows: list) -> list:
    lines = ["| op | Shard(0) | Shard(last) | Partial(sum) | expands | probed on |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if row.probe is None:
            lines.append(f"| `{_short(row.op)}` | {row.why} | | | | |")
            continue
        p = row.probe
        lines.append(f"| `{_short(row.op)}` | " + " | ".join(_cell(p.cells[k]) for k in PROBES) +
                     f" | {'yes' if p.expands else ''} | {_cell(p.sample)} |")
    return lines


def _grouped(rows: list) -> list:
    """Rows listed compactly: one bullet per distinct probe result, the ops as brace lists."""
    groups: dict = {}
    for row in rows:
        key = (row.why,) if row.probe is None else tuple(row.probe.cells[k] for k in PROBES) + (row.probe.expands,)
        groups.setdefault(key, []).append(row.op)
    lines = []
    for key in sorted(groups, key=lambda k: (len(k) == 1, -len(groups[k]), k)):
        if len(key) == 1:
            head = f"**{key[0]}**"
        else:
            head = " · ".join(f"{name}: {_cell(cell)}" for name, cell in zip(("Shard(0)", "Shard(last)", "Partial(sum)"),
                                                                             key[:3]))
            head += " · expands" if key[3] else ""
        count = len(groups[key])
        lines.append(f"- {head} ({count} op{'' if count == 1 else 's'}): {_braces(groups[key])}")
    return lines


def _local(probe: Probe, which: str) -> bool:
    return probe.kinds[which] == "kept" and not probe.expanded.get(which, False)


def _counts(rows: list) -> dict:
    probed = [r for r in rows if r.probe is not None]
    return {
        "ops": len(rows),
        "probed": len(probed),
        "S(0) local": sum(_local(r.probe, "S(0)") for r in probed),
        "S(last) local": sum(_local(r.probe, "S(last)") for r in probed),
        "P kept": sum(r.probe.kinds["P"] == "kept" and "→ P" in r.probe.cells["P"] for r in probed),
        "P refused": sum(r.probe.kinds["P"] == "refused" for r in probed),
        "expands": sum(r.probe.expands for r in probed),
    }


INTRO = """\
# Operators

<!-- Generated by `python -m hypershard.operators_doc` from the operator registry; do not edit.
     tests/python/unit/test_operators_doc.py regenerates it and fails when it is stale. -->

Every ATen (and hypershard) operator with a distributed rule, by family. A family is one file,
`csrc/ops/<family>.cpp`; each section quotes that file's header comment (the ops, their sharding,
their Partial algebra, what is excluded) and tables what the rule plans.

**Strict and default mode.** In strict mode (`hs.set_strict(True)`, `with hs.strict():`,
`HYPERSHARD_STRICT=1`; the test suite runs strict) these rules are all there is: an op not listed
here raises `Missing operator`, and a layout a rule refuses raises before any collective. In
default mode an op not listed here runs through the fallback (inputs gathered to Replicate, the op
on whole tensors, outputs Replicate; a warning once per op), and a refused layout is redistributed
first (a Partial input reduced, a view that would cut a shard gathered), so a run never stops for
a missing rule.

**How the tables are made.** Each op's rule is probed without processes
(`hypershard.testing.planning`) on a 2-rank mesh `{"tp": 2}`. The arguments are those of a real
call of the op, traced from PyTorch's OpInfo samples (their forward, in-place variant and
backward, on CPU in float32, or int64/bool for ops without float samples), from a few calls of
hypershard's own ops and the fused optimizers, and from calls written out in the generator for
ops no trace reaches (composite ops that decompose first, ops OpInfo has no sample for). An
overload no call reaches borrows a sibling overload's arguments where its schema takes them
(`add.Tensor`'s for `add_.Tensor` and `add.out`, the out= tensors shaped like the sibling's
results; a tensor for a scalar argument, as for `add.Scalar`, becomes the scalar 2). The op's
first tensor argument is laid out three ways: **Shard(0)**, **Shard(last)** (its last dim,
written `S(-1)`) and **Partial(sum)**; every other tensor argument of the same shape is sharded
the same (for the Shard probes), the rest are Replicate.

A cell reads `<first argument> → <outputs>`:

- `S(0) → S(0)`: the rule keeps the given layout; the outputs are laid out as shown (several
  outputs in order, `×n` for repeats, `—` for an op that returns no tensor: an in-place list op,
  an optimizer step, `item()`). Nothing is communicated before the op; a Replicate operand may
  be cut to this rank's shard, which moves nothing.
- `gathered → R`, `reduced → R`, `reduce-scattered → S(0)`, `resharded to S(1) → S(1)`: the rule
  asks for another layout of the first argument: the per-op path communicates first.
  `; other gathered` names another argument that is communicated.
- `P → P`: the Partial is kept (the op is linear in that argument), nothing is reduced.
- `refused: <problem>`: the rule raises for this layout (strict mode stops there; default mode
  redistributes and runs the op). `(strict: refused)` marks a plan that default mode runs but
  strict mode refuses. `not covered: <why>`: the rule does not cover these arguments.
- `0-d`: the first argument is a scalar tensor (it cannot be sharded).
- **expands**: the op runs its own implementation, with collectives inside it, for at least one
  of the three layouts.
- **probed on**: the first tensor argument's global shape and where the call came from (an OpInfo
  name, a call of hypershard's own ops, `written out` for a call listed in the generator, `via
  <overload>` when borrowed).
- **no sample**: no call fits the op; its rule is registered but not probed here (see the
  family's comment and `tests/python/unit/test_rules.py`). **not probed: npu's op**: an op of
  another library (torch_npu, transformers), left out so that this document does not depend on
  what is installed.

Shard(last) cells write output shards relative to the output's rank (`S(-1)` is its last dim).
Output dims elsewhere are absolute. The probes use one sample shape; a rule's answer can depend on
the shapes (a broadcast dim, a size-1 dim), so the family comment is the specification and the
tables are its examples.
"""


def render(rules: list, samples: dict, sources: bool = True) -> str:
    """The document for `rules` ([(op, family)]) probed with `samples` (collect_samples)."""
    return document(probe_rules(rules, samples), sources)


def document(rows: list, sources: bool = True) -> str:
    """The document of probed rows (probe_rules). sources=False writes it as if csrc/ops were
    absent (no family comments, no split of the pointwise family)."""
    tabled = tabled_pointwise() if sources else None
    families = sorted({row.family for row in rows})
    by_family = {family: [r for r in rows if r.family == family] for family in families}

    lines = [INTRO]
    lines.append("## Summary\n")
    lines.append(f"{len(rows)} ops with a rule in {len(families)} families; {sum(r.probe is not None for r in rows)} "
                 "probed. *local*: the given layout of the first argument kept, nothing communicated before "
                 "or inside the op. *P kept*: a Partial(sum) first argument kept and a Partial output. "
                 "*P refused*: the rule raises for it (default mode reduces it first). *expands*: the op runs "
                 "collectives inside for at least one probe.\n")
    columns = ("ops", "probed", "S(0) local", "S(last) local", "P kept", "P refused", "expands")
    lines.append("| family | " + " | ".join(columns) + " |")
    lines.append("| --- |" + " ---: |" * len(columns))
    for family in families:
        counts = _counts(by_family[family])
        lines.append(f"| [{family}](#{family}) | " + " | ".join(str(counts[c]) for c in columns) + " |")
    total = _counts(rows)
    lines.append("| **all** | " + " | ".join(f"**{total[c]}**" for c in columns) + " |")
    lines.append("")

    for family in families:
        family_rows = by_family[family]
        lines.append(f"## {family}\n")
        header = family_header(family) if sources else None
        if header is None:
            lines.append(f"(`csrc/ops/{family}.cpp` is not in this checkout: the family's comment is left out.)\n")
        elif header:
            lines.append("```text\n" + header + "\n```\n")
        if family == "pointwise":
            if tabled is not None:
                table_rows = [r for r in family_rows if r.op in tabled]
                tagged = [r for r in family_rows if r.op not in tabled]
            else:
                table_rows, tagged = [], family_rows
            if table_rows:
                lines.append(f"The ops of pointwise.cpp's tables ({len(table_rows)}):\n")
                lines.extend(_table(table_rows))
                lines.append("")
            if tagged:
                what = ("registered by torch's `pointwise` tag (register_tagged_pointwise)" if tabled is not None
                        else "(the sources that tell tabled from tag-registered ops are absent)")
                lines.append(f"The other {len(tagged)} pointwise ops, {what}, grouped by what the probes "
                             "found; `acos{,_,.out}` is `acos`, `acos_` and `acos.out`:\n")
                lines.extend(_grouped(tagged))
                lines.append("")
        else:
            lines.extend(_table(family_rows))
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def registry() -> list:
    from . import _C

    return sorted((str(op), str(family)) for op, family in _C.rule_families())


def generate() -> str:
    rules = registry()
    return render(rules, collect_samples(op for op, _ in rules))


def check(text: str, path: Path) -> Optional[str]:
    """None when `path` holds `text`; otherwise the STALE message with the first lines of the
    difference."""
    current = path.read_text() if path.is_file() else ""
    if current == text:
        return None
    diff = difflib.unified_diff(current.splitlines(), text.splitlines(), f"{path.name} (checked in)",
                                f"{path.name} (generated)", lineterm="", n=1)
    return "\n".join([*itertools.islice(diff, 40), STALE])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hypershard.operators_doc",
                                     description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the file to write or check (default docs/operators.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when --out differs from a fresh run")
    args = parser.parse_args(argv)
    text = generate()
    out = Path(args.out)
    if args.check:
        problem = check(text, out)
        print(problem or f"{args.out} is current")
        return 1 if problem else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
