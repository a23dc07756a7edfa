"""UT: the requirement's operator list (../shared/design/OPERATORS.md, first table), without
processes: which ATen / custom op overloads each name reaches, that each of them has a
hypershard rule, and what those rules plan on a {"dp": 2, "tp": 2} mesh -- one accepted layout per
op and the error paths (Partial inputs included), in the house format
"hypershard: <op>: argument <name> (#i) ...; allowed: ...".

- REACHES: requirement name -> the overloads it reaches, forward and backward (what the DTensor
  path of tests/python/level0/test_requirement_ops.py reaches, read from hypershard._C.op_counts()
  on a (2, 2) mesh -- the optimizer's plain step counters excluded --, plus gather's backward on
  plain tensors, scatter_add).
  test_reached_overloads_have_rules: each is in hypershard._C.rule_names(); one_hot and
  cross_entropy (label smoothing) are served by hypershard's own kernels at the autograd key
  (csrc/ops/tensor_ops.cpp, csrc/ops/loss.cpp), checked with the dispatcher
  (test_autograd_key_kernels); tolist is hypershard's Python override of Tensor.tolist (the GLOBAL
  value, through full_tensor) and item() reaches _local_scalar_dense (test_tolist_is_global).
- test_plain_trace: each name's Python form run forward and backward on plain CPU tensors under a
  TorchDispatchMode: every traced overload that takes a tensor has a rule (none would stop strict
  mode), and REACHES names only overloads the trace shows, except NOT_TRACED (reached only on the
  DTensor path: hypershard's autograd-key kernels, a device move, torch_npu's names, other
  argument forms).
- ROWS (accepted layouts: what each input is planned as, the outputs, whether the op runs its
  own collectives) and ERRORS (error paths: Partial inputs -- offs among them --, a sharded
  rotary head dim, out-of-range dims, a vector for tril), each tagged with
  the requirement names it serves; test_every_name_has_rows: every name has an accepted row and an
  error row, or (cpu, to, type_as, new_zeros, tolist, one-argument where) a row showing its rule
  keeps or reduces a Partial input -- those have no refusal to pin.

Not repeated here (tests/python/unit/test_rules.py pins them): histc's Partial counts (data range
and given range) and its Partial refusal; gather with the index following self or made whole;
scatter_add along a sharded dim; new_zeros of a sharded input; conv1d batch-sharded, channels
gathered and its backward's Partial weight gradient; nll_loss's global count, none-reduction and
vocab-parallel plans; log_softmax along a sharded dim; a float cast keeping a Partial and an
integer cast refusing it. The fused ops' full tables: tests/python/unit/test_rms_norm_rules.py,
test_rotary_rules.py.

Not pinned (hypershard's plan differs from OPERATORS.md, so a row would pin the difference):
index_add(_) with a Partial(sum) self and source (the requirement: stays Partial; the rule
refuses it), and index_add_ / scatter_ along the SHARDED dim, whose plan leaves self Replicate
on that axis (the requirement: in-place ops keep their placements).

One test per name, traced form, row and error (parametrized, so a failure names its case); no
processes, a few seconds.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hypershard as hs
from hypershard import ops as hops
from hypershard.testing.planning import Arg as T
from hypershard.testing.planning import PlanningMesh, plan, realise
from hypershard.testing.planning import spec as S

importlib.import_module("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback

aten = torch.ops.aten
hsops = torch.ops.hypershard
i64, i32, boolean = torch.int64, torch.int32, torch.bool
MESH = {"dp": 2, "tp": 2}

# ------------------------------------------------------------------------------ what each name reaches

REACHES = {
    "cpu": ("aten::_to_copy",),
    "to": ("aten::_to_copy",),
    "type_as": ("aten::_to_copy",),
    "bool": ("aten::_to_copy",),
    # label smoothing: hypershard's cross_entropy_loss kernel (log_softmax + nll + the smoothing sum,
    # masked with where); 3-D and 4-D logits reach nll_loss2d
    "cross_entropy": ("aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::nll_loss_forward",
                      "aten::nll_loss_backward", "aten::nll_loss2d_forward", "aten::nll_loss2d_backward",
                      "aten::ne.Scalar", "aten::where.self", "aten::neg", "aten::sum.dim_IntList"),
    "gather": ("aten::gather", "aten::new_zeros", "aten::scatter_add", "aten::scatter_add_"),
    "histc": ("aten::histc",),
    "index_add_": ("aten::index_add_", "aten::index_select"),
    "index_add": ("aten::index_add", "aten::index_select"),
    "new_zeros": ("aten::new_zeros",),
    "npu_rms_norm": ("hypershard::rms_norm", "hypershard::rms_norm_backward", "npu::npu_rms_norm",
                     "npu::npu_rms_norm_backward"),
    "npu_rotary_mul": ("hypershard::rotary_position_embedding", "hypershard::rotary_position_embedding_backward",
                       "npu::npu_rotary_mul", "npu::npu_rotary_mul_backward"),
    "tolist": ("aten::_local_scalar_dense",),
    "vstack": ("aten::cat", "aten::unsqueeze", "aten::slice.Tensor"),
    "conv1d": ("aten::convolution", "aten::convolution_backward", "aten::slice.Tensor", "aten::slice_backward"),
    "softplus": ("aten::softplus", "aten::softplus_backward"),
    "tril": ("aten::tril",),
    "triu": ("aten::triu",),
    "greater": ("aten::gt.Tensor", "aten::gt.Scalar"),
    "one_hot": ("aten::one_hot",),
    "where": ("aten::where.self",),
    "where_1arg": ("aten::nonzero", "aten::unbind.int"),
    "scatter_": ("aten::scatter_.src", "aten::scatter.value", "aten::gather"),
    "scatter_.value": ("aten::scatter_.value", "aten::scatter.value"),
    "scatter_.reduce": ("aten::scatter_.reduce", "aten::scatter_.value_reduce"),
    "clamp_": ("aten::clamp_", "aten::ge.Scalar", "aten::le.Scalar", "aten::logical_and_", "aten::where.self"),
    "_grouped_mm": ("aten::_grouped_mm", "aten::transpose.int"),
    "grouped_mm_fallback": ("transformers::grouped_mm_fallback", "aten::mm.out", "aten::zeros_like",
                            "aten::select.int", "aten::slice.Tensor", "aten::permute"),
    "adamw": ("aten::_foreach_lerp_.Scalar", "aten::_foreach_mul_.Scalar", "aten::_foreach_addcmul_.Scalar",
              "aten::_foreach_sqrt", "aten::_foreach_div_.ScalarList", "aten::_foreach_add_.Scalar",
              "aten::_foreach_addcdiv_.ScalarList"),
    "fused_adamw": ("aten::_fused_adamw_", "aten::_fused_adamw_.tensor_lr"),
}
NAMES = tuple(REACHES)
assert len(NAMES) == 30

# overloads of REACHES the plain-tensor forms below do not reach, and why
NOT_TRACED = {
    "cpu": {"aten::_to_copy"},                                   # cpu() of a CPU tensor is the tensor itself
    "cross_entropy": {"aten::ne.Scalar", "aten::where.self",     # hypershard's autograd-key kernel
                      "aten::nll_loss2d_forward", "aten::nll_loss2d_backward"},   # 3-D/4-D logits
    "npu_rms_norm": {"npu::npu_rms_norm", "npu::npu_rms_norm_backward"},           # torch_npu's names
    "npu_rotary_mul": {"npu::npu_rotary_mul", "npu::npu_rotary_mul_backward"},
    "gather": {"aten::scatter_add_"},                            # gather's backward on a DTensor grad
    "tolist": {"aten::_local_scalar_dense"},                     # item(); tolist is hypershard's override
    "one_hot": {"aten::one_hot"},                                # decomposed above the dispatch mode
    "fused_adamw": {"aten::_fused_adamw_.tensor_lr"},            # a tensor learning rate
}
AUTOGRAD_KERNELS = ("aten::one_hot", "aten::cross_entropy_loss")


def _x(*shape):
    return torch.randn(*shape, requires_grad=True)


OFFS = torch.tensor([3, 7, 7, 11], dtype=i32)
TARGETS = torch.tensor([1, -100, 3, 4, -100, 6])


def _adamw(fused):
    def run():
        lin = torch.nn.Linear(6, 5)
        opt = torch.optim.AdamW(lin.parameters(), lr=1e-2, foreach=not fused, fused=fused or None)
        lin(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
    return run


FORMS = {
    "cpu": lambda: _x(4, 3).cpu() * 2,
    "to": lambda: _x(4, 3).to(torch.float64),
    "type_as": lambda: _x(4, 3).type_as(torch.zeros(1, dtype=torch.float64)),
    "bool": lambda: _x(4, 3).bool(),
    "cross_entropy": lambda: F.cross_entropy(_x(6, 7), TARGETS, ignore_index=-100, label_smoothing=0.1),
    "gather": lambda: torch.gather(_x(5, 7), 1, torch.randint(0, 7, (5, 3))),
    "histc": lambda: torch.histc(_x(5, 6).detach(), 5, -2, 2),
    "index_add_": lambda: _x(5, 6).clone().index_add_(0, torch.tensor([0, 2, 2]), _x(3, 6)),
    "index_add": lambda: torch.index_add(_x(5, 6), 0, torch.tensor([0, 2, 2]), _x(3, 6)),
    "new_zeros": lambda: _x(5, 6).new_zeros((3, 4)),
    "npu_rms_norm": lambda: hops.rms_norm(_x(5, 3, 8), _x(8)),
    "npu_rotary_mul": lambda: hops.rotary_mul(_x(5, 3, 2, 8), _x(1, 3, 1, 8), _x(1, 3, 1, 8)),
    "tolist": lambda: torch.tensor(_x(4, 3).tolist()),
    "vstack": lambda: (torch.vstack([_x(4, 3), _x(2, 3)]), torch.vstack([_x(4), _x(4)])),
    "conv1d": lambda: F.conv1d(_x(5, 4, 9), _x(4, 1, 3), _x(4), padding=2, groups=4)[..., :9],
    "softplus": lambda: F.softplus(_x(5, 4)),
    "tril": lambda: torch.tril(_x(2, 6, 5), 1),
    "triu": lambda: torch.triu(_x(2, 6, 5), -1),
    "greater": lambda: (torch.greater(_x(3, 4), _x(3, 4)), _x(3, 4).gt(0.3)),
    "one_hot": lambda: F.one_hot(torch.randint(0, 6, (5,)), 6),
    "where": lambda: torch.where(torch.rand(3, 4) > 0.5, _x(3, 4), _x(3, 4)),
    "where_1arg": lambda: torch.where(_x(3, 4) > 0),
    "scatter_": lambda: _x(3, 4).clone().scatter_(1, torch.tensor([[0, 1], [2, 3], [1, 0]]), _x(3, 2)),
    "scatter_.value": lambda: _x(3, 4).clone().scatter_(1, torch.tensor([[0, 1], [2, 3], [1, 0]]), 1.5),
    "scatter_.reduce": lambda: (
        _x(3, 4).detach().clone().scatter_(1, torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.randn(3, 2), reduce="add"),
        _x(3, 4).detach().clone().scatter_(1, torch.tensor([[0, 1], [2, 3], [1, 0]]), 1.5, reduce="multiply")),
    "clamp_": lambda: _x(3, 4).clone().clamp_(-0.5, 0.5),
    "_grouped_mm": lambda: torch._grouped_mm(_x(11, 8), _x(4, 8, 12), offs=OFFS),
    "grouped_mm_fallback": lambda: torch.ops.transformers.grouped_mm_fallback(_x(11, 8), _x(4, 8, 12), OFFS),
    "adamw": _adamw(False),
    "fused_adamw": _adamw(True),
}


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        name = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        self.ops[name] = schema
        return func(*args, **(kwargs or {}))


def _takes_tensor(schema) -> bool:
    def tensorish(t):
        return isinstance(t, torch.TensorType) or (isinstance(t, (torch.ListType, torch.OptionalType))
                                                   and tensorish(t.getElementType()))
    return any(tensorish(a.type) for a in schema.arguments)


def trace(form):
    with _Record() as record:
        out = form()
        roots = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    return record.ops


@pytest.mark.parametrize("name", NAMES)
def test_reached_overloads_have_rules(name):
    rules = set(hs._C.rule_names())
    missing = [op for op in REACHES[name] if op not in rules and op not in AUTOGRAD_KERNELS]
    assert not missing, f"{name}: no rule for {missing}"


def test_autograd_key_kernels():
    """one_hot and cross_entropy_loss: hypershard's kernels at AutogradPrivateUse2 (registry.cpp's
    aten_autograd_kernels), which DTensor arguments dispatch to before the composite decomposition."""
    for op in AUTOGRAD_KERNELS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutogradPrivateUse2"), op
        line = [row for row in torch._C._dispatch_dump(op).splitlines() if row.startswith("AutogradPrivateUse2:")]
        assert line and "csrc/ops/registry.cpp" in line[0], (op, line)


def test_tolist_is_global():
    """tolist: hypershard's override (the GLOBAL value via full_tensor); item: _local_scalar_dense,
    whose rule gathers (a Partial reduced) so every rank reads the same value."""
    assert torch.Tensor.tolist.__module__ == "hypershard.tensor.dtensor"
    mesh = PlanningMesh(MESH)
    for spec in (["P", "R"], ["S(0)", "S(0)"]):
        result = plan(aten._local_scalar_dense.default, mesh.dtensor([1] if spec[0] != "P" else [], spec))
        assert result.input_specs == [["R", "R"]] and result.outputs == []


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")
@pytest.mark.parametrize("name", list(FORMS))
def test_plain_trace(name):
    traced = trace(FORMS[name])
    rules = set(hs._C.rule_names())
    ruleless = sorted(op for op, schema in traced.items() if _takes_tensor(schema) and op not in rules)
    assert not ruleless, f"{name}: reaches ops without a rule: {ruleless}"
    expected = set(REACHES[name]) - NOT_TRACED.get(name, set())
    assert expected <= set(traced), f"{name}: REACHES names {sorted(expected - set(traced))}, not traced"


# ------------------------------------------------------------------------------ planning


R, P, PMAX = ["R", "R"], ["P", "R"], ["P(max)", "R"]
ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
GMM_FALLBACK = torch.ops.transformers.grouped_mm_fallback.default

# (id, requirement names, op, args, kwargs, expected input specs (None: as given), output specs, expands)
ROWS = [
    ("to_float64_keeps", ("to", "type_as"), aten._to_copy.default, (T([8, 6], S(0, 1)),), {"dtype": torch.float64},
     None, [S(0, 1)], False),
    ("cpu_keeps_partial", ("cpu", "to"), aten._to_copy.default, (T([8, 6], P),), {"device": torch.device("cpu")},
     None, [P], False),
    ("type_as_float64_keeps_partial", ("type_as", "to"), aten._to_copy.default, (T([8, 6], P),),
     {"dtype": torch.float64}, None, [P], False),
    ("bool_keeps", ("bool",), aten._to_copy.default, (T([8, 6], S(0, None)),), {"dtype": boolean}, None, [S(0, None)],
     False),
    # cross entropy: batch on dp, vocab on tp -- the collective (vocab-parallel) variants
    ("log_softmax_batch_vocab", ("cross_entropy",), aten._log_softmax.default, (T([8, 7], S(0, 1)), 1, False), {},
     None, [S(0, 1)], True),
    ("nll_mean_batch_vocab", ("cross_entropy",), aten.nll_loss_forward.default,
     (T([8, 7], S(0, 1)), T([8], S(0, None), i64), None, 1, -100), {}, None, [R, R], True),
    ("nll_sum_batch_two_axes", ("cross_entropy",), aten.nll_loss_forward.default,
     (T([8, 7], S(0, 0)), T([8], S(0, 0), i64), None, 2, -100), {}, None, [["P", "P"], ["P", "P"]], False),
    ("nll2d_batch_vocab", ("cross_entropy",), aten.nll_loss2d_forward.default,
     (T([4, 7, 3, 1], S(0, 1)), T([4, 3, 1], S(0, None), i64), None, 1, -100), {}, None, [R, R], True),
    ("nll_backward_batch_vocab", ("cross_entropy",), aten.nll_loss_backward.default,
     (T([], R), T([8, 7], S(0, 1)), T([8], S(0, None), i64), None, 1, -100, T([], R)), {}, None, [S(0, 1)], True),
    # gather / scatter_ / index_add_: GLOBAL indices; along a sharded dim by ownership (reads Partial,
    # writes keep self's layout), along another dim the operands follow self
    ("gather_dim0_sharded_by_ownership", ("gather",), aten.gather.default, (T([8, 6], S(0, 1)), 0, T([3, 6], R, i64)),
     {}, [S(0, 1), S(None, 1)], [["P", "S(1)"]], True),
    ("gather_partial_index_reduced", ("gather",), aten.gather.default, (T([8, 6], R), 1, T([8, 3], P, i64)), {},
     [R, R], [R], False),
    ("index_add__other_dim", ("index_add_",), aten.index_add_.default,
     (T([8, 6], S(0, None)), 1, T([3], R, i64), T([8, 3], S(0, None))), {}, None, [S(0, None)], False),
    # self sharded, a Partial source: the source is reduced (self is not Partial to carry it)
    # index_add is linear in self and source together: a Partial source stays Partial (self filled)
    ("index_add__partial_source_kept", ("index_add_",), aten.index_add_.default,
     (T([8, 6], S(0, None)), 1, T([3], R, i64), T([8, 3], P)), {}, [P, R, P], [P], False),
    ("index_add_sharded_dim_by_ownership_2d", ("index_add",), aten.index_add.default,
     (T([8, 6], S(0, 1)), 1, T([3], R, i64), T([8, 3], S(0, None))), {}, [S(0, 1), R, S(0, None)], [S(0, 1)],
     True),
    ("index_select_sharded_dim_by_ownership", ("index_add_", "index_add"), aten.index_select.default,
     (T([8, 6], S(0, 1)), 0, T([3], R, i64)), {}, [S(0, 1), R], [["P", "S(1)"]], True),
    ("scatter__src_other_dim", ("scatter_",), aten.scatter_.src,
     (T([8, 6], S(0, None)), 1, T([8, 3], S(0, None), i64), T([8, 3], S(0, None))), {}, None, [S(0, None)], False),
    ("scatter__src_partial_reduced", ("scatter_",), aten.scatter_.src,
     (T([8, 6], R), 1, T([8, 3], R, i64), T([8, 3], P)), {}, [R, R, R], [R], False),
    ("scatter__value", ("scatter_.value",), aten.scatter_.value,
     (T([8, 6], S(0, None)), 1, T([8, 3], S(0, None), i64), 1.5),
     {}, None, [S(0, None)], False),
    ("scatter_value_functional_by_ownership", ("scatter_.value",), aten.scatter.value,
     (T([8, 6], S(0, 1)), 1, T([8, 3], S(0, None), i64), 0.0), {}, [S(0, 1), S(0, None)], [S(0, 1)], True),
    ("scatter__reduce", ("scatter_.reduce",), aten.scatter_.reduce,
     (T([8, 6], S(0, None)), 1, T([8, 3], S(0, None), i64), T([8, 3], S(0, None))), {"reduce": "add"},
     None, [S(0, None)], False),
    ("scatter__value_reduce", ("scatter_.reduce",), aten.scatter_.value_reduce,
     (T([8, 6], S(0, None)), 1, T([8, 3], S(0, None), i64), 2.0), {"reduce": "multiply"}, None, [S(0, None)], False),
    # histc: the accepted rows are test_rules.py's (histc_counts_partial_*); tolist below
    ("new_zeros_of_partial_replicate", ("new_zeros",), aten.new_zeros.default, (T([8, 6], P), [3, 5]), {}, None, [R],
     False),
    ("rms_norm_leading_dims", ("npu_rms_norm",), hsops.rms_norm.default, (T([4, 3, 8], S(0, 1)), T([8], R), 1e-6), {},
     None, [S(0, 1), S(0, 1)], False),
    ("rms_norm_hidden_gathered", ("npu_rms_norm",), hsops.rms_norm.default, (T([4, 3, 8], S(0, 2)), T([8], R), 1e-6),
     {}, [S(0, None), R], [S(0, None), S(0, None)], False),
    ("rotary_batch_heads", ("npu_rotary_mul",), hsops.rotary_position_embedding.default,
     (T([4, 3, 2, 8], S(0, 2)), T([1, 3, 1, 8], R), T([1, 3, 1, 8], R), 0), {}, None, [S(0, 2)], False),
    ("local_scalar_partial_reduced", ("tolist",), aten._local_scalar_dense.default, (T([], P),), {}, [R], [], False),
    # vstack = atleast_2d + cat on dim 0: the cat dim made whole; a 1-D input's new leading dim
    ("cat_dim_made_whole", ("vstack",), aten.cat.default, ([T([8, 6], S(0, 1)), T([3, 6], S(0, 1))], 0), {},
     [S(None, 1), S(None, 1)], [S(None, 1)], False),
    ("cat_rows_of_1d", ("vstack",), aten.cat.default, ([T([1, 6], S(None, 1)), T([1, 6], S(None, 1))], 0), {},
     None, [S(None, 1)], False),
    ("cat_partial_and_replicate", ("vstack",), aten.cat.default, ([T([8, 6], P), T([3, 6], R)], 0), {},
     [P, P], [P], False),
    ("conv1d_depthwise_batch_two_axes", ("conv1d",), aten.convolution.default,
     (T([8, 4, 9], S(0, 0)), T([4, 1, 3], R), T([4], R), [1], [2], [1], False, [0], 4), {}, None, [S(0, 0)], False),
    ("softplus_pointwise", ("softplus",), aten.softplus.default, (T([8, 6], S(0, 1)), 1.0, 20.0), {}, None, [S(0, 1)],
     False),
    ("softplus_backward_pointwise", ("softplus",), aten.softplus_backward.default,
     (T([8, 6], S(0, 1)), T([8, 6], S(0, 1)), 1.0, 20.0), {}, None, [S(0, 1)], False),
    # tril/triu with the last two dims sharded: kept, the diagonal shifted per rank (localizes)
    ("tril_last_two_sharded", ("tril",), aten.tril.default, (T([2, 6, 5], S(1, 2)), -1), {}, None, [S(1, 2)], False),
    ("triu_last_two_sharded", ("triu",), aten.triu.default, (T([2, 6, 5], S(2, 1)), 2), {}, None, [S(2, 1)], False),
    ("tril_keeps_partial", ("tril", "triu"), aten.tril.default, (T([2, 6, 5], P), 1), {}, None, [P], False),
    ("gt_broadcast", ("greater",), aten.gt.Tensor, (T([8, 6], S(0, 1)), T([6], S(None, 0))), {}, None, [S(0, 1)],
     False),
    ("gt_scalar", ("greater",), aten.gt.Scalar, (T([8, 6], S(0, 1)), 0.3), {}, None, [S(0, 1)], False),
    ("where_scalar_other", ("where", "bool"), aten.where.self,
     (T([8, 6], S(0, 1), boolean), T([8, 6], S(0, 1)), T([], R)), {}, None, [S(0, 1)], False),
    ("where_two_partials", ("where",), aten.where.self, (T([8, 6], R, boolean), T([8, 6], P), T([8, 6], P)), {},
     None, [P], False),
    ("nonzero_gathered", ("where_1arg",), aten.nonzero.default, (T([8, 6], S(0, 1), boolean),), {}, [R], [R], False),
    ("nonzero_partial_reduced", ("where_1arg",), aten.nonzero.default, (T([8, 6], P, boolean),), {}, [R], [R], False),
    ("clamp__keeps", ("clamp_",), aten.clamp_.default, (T([8, 6], S(0, 1)), -0.5, 0.5), {}, None, [S(0, 1)], False),
    ("clamp__keeps_partial_max", ("clamp_",), aten.clamp_.default, (T([8, 6], PMAX), -0.5, 0.5), {}, None, [PMAX],
     False),
    # grouped matmuls: experts on dp, N on tp -> Partial(sum) over dp (the other experts' rows are
    # 0), sharded on N; offs Replicate (a sharded offs is gathered)
    ("grouped_mm_expert_and_colwise", ("_grouped_mm",), aten._grouped_mm.default,
     (T([11, 8], R), T([4, 8, 12], S(0, 2))), {"offs": T([4], R, i32)}, None, [["P", "S(1)"]], True),
    ("grouped_mm_offs_gathered", ("_grouped_mm",), aten._grouped_mm.default,
     (T([11, 8], R), T([4, 8, 12], S(None, 2))), {"offs": T([4], S(0, None), i32)}, [R, S(None, 2), R], [S(None, 1)],
     True),
    # integer counts summed over dp (histc of expert ids a sort left sharded, then cumsum): reduced
    ("grouped_mm_offs_partial_counts_reduced", ("_grouped_mm",), aten._grouped_mm.default,
     (T([11, 8], S(0, None)), T([4, 8, 12], S(None, 2))), {"offs": T([4], P, i32)}, [R, S(None, 2), R],
     [S(None, 1)], True),
    ("grouped_mm_partial_tokens", ("_grouped_mm",), aten._grouped_mm.default,
     (T([11, 8], P), T([4, 8, 12], S(None, 2))), {"offs": T([4], R, i32)}, None, [["P", "S(1)"]], True),
    ("fallback_expert_and_colwise", ("grouped_mm_fallback",), GMM_FALLBACK,
     (T([11, 8], R), T([4, 8, 12], S(0, 2)), T([4], R, i32)), {}, None, [["P", "S(1)"]], True),
    ("fallback_partial_tokens", ("grouped_mm_fallback",), GMM_FALLBACK,
     (T([11, 8], P), T([4, 8, 12], S(None, 2)), T([4], R, i32)), {}, None, [["P", "S(1)"]], True),
    ("foreach_lerp__mixed", ("adamw",), aten._foreach_lerp_.Scalar,
     ([T([8, 6], S(0, 1)), T([5], R)], [T([8, 6], S(0, 1)), T([5], R)], 0.1), {}, None, [], False),
    ("foreach_addcdiv_", ("adamw",), aten._foreach_addcdiv_.ScalarList,
     ([T([8, 6], S(0, 1))], [T([8, 6], S(0, 1))], [T([8, 6], S(0, 1))], [0.1]), {}, None, [], False),
    # a Partial gradient is reduced before the update
    ("fused_adamw_partial_grad", ("fused_adamw",), aten._fused_adamw_.default,
     ([T([8, 6], S(0, 1))], [T([8, 6], P)], [T([8, 6], S(0, 1))], [T([8, 6], R)], [], [T([], R)]), ADAMW,
     None, [], True),
]

# (id, requirement names, op, args, kwargs, op name, argument "name (#i)" (None: an error about the
# call, not one argument: no "allowed"), text)
ERRORS = [
    ("bool_of_partial", ("bool",), aten._to_copy.default, (T([8, 6], P),), {"dtype": boolean},
     "aten::_to_copy", "self (#0)", "Partial(sum) input is not supported by this op"),
    ("log_softmax_of_partial", ("cross_entropy",), aten._log_softmax.default, (T([8, 7], P), 1, False), {},
     "aten::_log_softmax", "self (#0)", "a softmax of a sum is not the sum of the parts' softmaxes"),
    ("nll_of_partial", ("cross_entropy",), aten.nll_loss_forward.default,
     (T([8, 7], P), T([8], R, i64), None, 1, -100), {},
     "aten::nll_loss_forward", "self (#0)", "log-probabilities of a sum are not the sum of the parts'"),
    # documented (docs/operators.md, along_dims): only flip, roll and cumsum pass a sum Partial
    ("gather_of_partial", ("gather",), aten.gather.default, (T([8, 6], P), 1, T([8, 3], R, i64)), {},
     "aten::gather", "self (#0)", "Partial(sum) input is not supported by this op"),
    ("scatter__of_partial", ("scatter_",), aten.scatter_.src, (T([8, 6], P), 1, T([8, 3], R, i64), T([8, 3], R)), {},
     "aten::scatter_.src", "self (#0)", "Partial(sum) input is not supported by this op"),
    ("scatter__value_of_partial", ("scatter_.value",), aten.scatter_.value, (T([8, 6], P), 1, T([8, 3], R, i64), 1.5),
     {}, "aten::scatter_.value", "self (#0)", "Partial(sum) input is not supported by this op"),
    ("scatter__reduce_of_partial", ("scatter_.reduce",), aten.scatter_.reduce,
     (T([8, 6], P), 1, T([8, 3], R, i64), T([8, 3], R)), {"reduce": "add"},
     "aten::scatter_.reduce", "self (#0)", "Partial(sum) input is not supported by this op"),
    ("scatter__value_reduce_of_partial", ("scatter_.reduce",), aten.scatter_.value_reduce,
     (T([8, 6], P), 1, T([8, 3], R, i64), 2.0), {"reduce": "multiply"},
     "aten::scatter_.value_reduce", "self (#0)", "Partial(sum) input is not supported by this op"),
    ("index_add__dim_out_of_range", ("index_add_", "index_add"), aten.index_add_.default,
     (T([8, 6], S(0, None)), 2, T([3], R, i64), T([8, 3], S(0, None))), {},
     "aten::index_add_", None, "dim 2 is out of range for a 2-d tensor"),
    ("nll_partial_target", ("cross_entropy",), aten.nll_loss_forward.default,
     (T([8, 7], S(0, None)), T([8], P, i64), None, 1, -100), {},
     "aten::nll_loss_forward", "target (#1)", "a class index has no sum"),
    ("cat_dim_out_of_range", ("vstack",), aten.cat.default, ([T([8, 6], S(0, None))], 2), {},
     "aten::cat", None, "dim 2 is out of range for a 2-d tensor"),
    ("tril_of_a_vector", ("tril", "triu"), aten.tril.default, (T([8], S(0, None)),), {},
     "aten::tril", "self (#0)", "has fewer than 2 dims"),
    # offs summed over ranks is reduced first (integer counts); a max of offsets means nothing
    ("grouped_mm_partial_max_offs", ("_grouped_mm",), aten._grouped_mm.default,
     (T([11, 8], R), T([4, 8, 12], S(None, 2))), {"offs": T([4], PMAX, i32)},
     "aten::_grouped_mm", "offs (#2)", "allowed: offs Replicate (whole cumulative counts)"),
    ("fallback_partial_max_offs", ("grouped_mm_fallback",), GMM_FALLBACK,
     (T([11, 8], R), T([4, 8, 12], S(None, 2)), T([4], PMAX, i32)), {},
     "transformers::grouped_mm_fallback", "offs (#2)", "allowed: offs Replicate (whole cumulative counts)"),
    ("rms_norm_of_partial", ("npu_rms_norm",), hsops.rms_norm.default, (T([4, 3, 8], P), T([8], R), 1e-6), {},
     "hypershard::rms_norm", "x (#0)", "Partial(sum) input is not supported by this op (it is not linear in it)"),
    ("rotary_of_partial", ("npu_rotary_mul",), hsops.rotary_position_embedding.default,
     (T([4, 3, 2, 8], P), T([1, 3, 1, 8], R), T([1, 3, 1, 8], R), 0), {},
     "hypershard::rotary_position_embedding", "x (#0)", "the rotation is not linear in x and cos/sin together"),
    ("rotary_head_dim_sharded", ("npu_rotary_mul",), hsops.rotary_position_embedding.default,
     (T([4, 3, 2, 8], S(0, 3)), T([1, 3, 1, 8], R), T([1, 3, 1, 8], R), 1), {},
     "hypershard::rotary_position_embedding", "x (#0)", "the last dim (D) is sharded on mesh axis 'tp'"),
    ("conv1d_of_partial", ("conv1d",), aten.convolution.default,
     (T([8, 4, 9], P), T([4, 1, 3], R), None, [1], [2], [1], False, [0], 4), {},
     "aten::convolution", "input (#0)", "a convolution adds its bias once"),
    ("softplus_of_partial", ("softplus",), aten.softplus.default, (T([8, 6], P), 1.0, 20.0), {},
     "aten::softplus", "self (#0)", "Partial(sum) input is not supported by this op"),
    ("gt_of_partial", ("greater",), aten.gt.Tensor, (T([8, 6], P), T([8, 6], R)), {},
     "aten::gt.Tensor", "self (#0)", "Partial(sum) input is not supported by this op"),
    ("gt_scalar_of_partial", ("greater",), aten.gt.Scalar, (T([8, 6], P), 0.3), {},
     "aten::gt.Scalar", "self (#0)", "Partial(sum) input is not supported by this op"),
    ("where_partial_condition", ("where",), aten.where.self,
     (T([8, 6], P, boolean), T([8, 6], R), T([8, 6], R)), {},
     "aten::where.self", "condition (#0)", "Partial(sum) input is not supported by this op"),
    ("clamp__of_sum_partial", ("clamp_",), aten.clamp_.default, (T([8, 6], P), -0.5, 0.5), {},
     "aten::clamp_", "self (#0)", "Partial(sum) input is not supported by this op"),
    ("fused_adamw_partial_param", ("fused_adamw",), aten._fused_adamw_.default,
     ([T([8, 6], P)], [T([8, 6], R)], [T([8, 6], R)], [T([8, 6], R)], [], [T([], R)]), ADAMW,
     "aten::_fused_adamw_", "self[0] (#0)", "a Partial parameter cannot be updated in place"),
    ("foreach_sqrt_of_partial", ("adamw",), aten._foreach_sqrt.default, ([T([8, 6], P)],), {},
     "aten::_foreach_sqrt", "self[0] (#0)", "Partial(sum) input is not supported by this op"),
    # histc's refusal is test_rules.py's histc_of_partial; this one on the 2-D mesh
    ("histc_of_partial_2d", ("histc",), aten.histc.default, (T([8, 6], ["R", "P"]), 6, -2, 2), {},
     "aten::histc", "self (#0)", "a histogram of a Partial tensor counts its parts"),
]

# names without an error row: their rules keep or reduce a Partial input (a row above shows it)
# and have no other refusal a model could reach
ACCEPT_PARTIAL = {"cpu", "to", "type_as", "new_zeros", "tolist", "where_1arg"}
ROW_COUNT, ERROR_COUNT = 52, 26


@pytest.mark.parametrize("name,tags,op,args,kwargs,inputs,outputs,expands", [pytest.param(*r, id=r[0]) for r in ROWS])
def test_inference(name, tags, op, args, kwargs, inputs, outputs, expands):
    mesh = PlanningMesh(MESH)
    result = plan(op, *[realise(a, mesh) for a in args], **realise(kwargs, mesh))
    given = [a.spec for arg in list(args) + list(kwargs.values())
             for a in (arg if isinstance(arg, list) else [arg]) if isinstance(a, T)]
    assert result.input_specs == (inputs if inputs is not None else given)
    assert result.output_specs == outputs
    assert result.expands == expands
    assert result.refused == ""


@pytest.mark.parametrize("name,tags,op,args,kwargs,op_name,argument,text", [pytest.param(*r, id=r[0]) for r in ERRORS])
def test_error_paths(name, tags, op, args, kwargs, op_name, argument, text):
    mesh = PlanningMesh(MESH)
    with pytest.raises((hs.LayoutError, RuntimeError)) as raised:
        plan(op, *[realise(a, mesh) for a in args], **realise(kwargs, mesh))
    message = str(raised.value)
    if argument is None:
        assert message.startswith(f"hypershard: {op_name}: {text}"), message
    else:
        assert message.startswith(f"hypershard: {op_name}: argument {argument} "), message
        assert text in message and "; allowed: " in message, message


def test_one_hot_kernel_keeps_the_index_sharding():
    """one_hot (hypershard's autograd-key kernel, no planner): the index keeps its sharding, the new
    class dim is whole. num_classes=-1 takes the global max (a collective: level0 covers it)."""
    mesh = PlanningMesh(MESH)
    out = F.one_hot(mesh.dtensor([8, 3], S(0, 1), i64), 6)
    assert tuple(out.shape) == (8, 3, 6)
    assert out.placements == (hs.Shard(0), hs.Shard(1))


def test_one_hot_kernel_refuses_a_partial_index():
    mesh = PlanningMesh(MESH)
    with pytest.raises(RuntimeError) as raised:
        F.one_hot(mesh.dtensor([8], P, i64), 6)
    message = str(raised.value)
    assert message.startswith("hypershard: aten::one_hot: argument self (#0) "), message
    assert "a Partial index has no meaning; allowed: Replicate or Shard" in message


def _has_partial(args):
    return any(isinstance(a, T) and any(p.startswith("P") for p in a.spec)
               for arg in args for a in (arg if isinstance(arg, list) else [arg]))


def test_every_name_has_rows():
    accepted = {tag for row in ROWS for tag in row[1]} | {"one_hot", "histc"}   # kernel tests; test_rules.py
    errors = {tag for row in ERRORS for tag in row[1]} | {"one_hot"}
    assert set(NAMES) <= accepted, sorted(set(NAMES) - accepted)
    assert set(NAMES) <= errors | ACCEPT_PARTIAL, sorted(set(NAMES) - errors - ACCEPT_PARTIAL)
    partial_rows = {tag for row in ROWS if _has_partial(row[3]) for tag in row[1]}
    assert ACCEPT_PARTIAL <= partial_rows, sorted(ACCEPT_PARTIAL - partial_rows)
    assert not ACCEPT_PARTIAL & errors
    assert (len(ROWS), len(ERRORS)) == (ROW_COUNT, ERROR_COUNT)
