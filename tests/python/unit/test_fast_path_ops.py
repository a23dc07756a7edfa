"""UT: the typed fast path covers every ruled op of a signature it reads, and only ops with a rule.

Adding an op is its rule's row (csrc/ops): the fast path gives a typed kernel to every op that has a
rule and one of the C++ signatures in fast_path.cpp's `Signatures`, so no op list is kept there.
"""

import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh

# The ops models and optimizers call most, each of a signature in the catalogue: all must be typed.
HOT = {
    "aten::add.Tensor", "aten::add_.Tensor", "aten::sub.Tensor", "aten::sub_.Tensor", "aten::mul.Tensor",
    "aten::mul_.Tensor", "aten::mul.Scalar", "aten::mul_.Scalar", "aten::div.Tensor", "aten::div_.Tensor",
    "aten::div.Scalar", "aten::neg", "aten::exp", "aten::sqrt", "aten::rsqrt", "aten::reciprocal",
    "aten::pow.Tensor_Scalar", "aten::sigmoid", "aten::tanh", "aten::relu", "aten::silu", "aten::sigmoid_backward",
    "aten::where.self", "aten::addcmul_", "aten::addcdiv_", "aten::lerp_.Scalar", "aten::copy_", "aten::fill_.Scalar",
    "aten::zero_", "aten::clone", "aten::_to_copy", "aten::view", "aten::_unsafe_view", "aten::t",
    "aten::transpose.int", "aten::permute", "aten::unsqueeze", "aten::squeeze.dim", "aten::expand", "aten::alias",
    "aten::select.int", "aten::slice.Tensor", "aten::mm", "aten::bmm", "aten::addmm", "aten::sum.dim_IntList",
    "aten::mean.dim", "aten::amax", "aten::_softmax", "aten::_log_softmax", "aten::cumsum", "aten::tril",
    "aten::triu", "aten::gather", "aten::index_select", "aten::flip", "aten::roll", "aten::_fft_r2c",
    "aten::avg_pool2d", "aten::_grouped_mm", "aten::convolution", "aten::constant_pad_nd",
    "aten::_foreach_add_.List", "aten::_foreach_add_.Scalar", "aten::_foreach_add.List", "aten::_foreach_sub_.List",
    "aten::_foreach_mul_.Scalar", "aten::_foreach_mul_.List", "aten::_foreach_mul_.Tensor",
    "aten::_foreach_div_.Scalar", "aten::_foreach_div_.ScalarList", "aten::_foreach_lerp_.Scalar",
    "aten::_foreach_addcmul_.Scalar", "aten::_foreach_addcdiv_.Scalar", "aten::_foreach_addcdiv_.ScalarList",
    "aten::_foreach_sqrt", "aten::_foreach_neg", "aten::_foreach_copy_", "aten::_foreach_zero_",
    "aten::_foreach_norm.Scalar",
}


def test_hot_ops_have_typed_kernels():
    fast = set(hs._C.fast_path_ops())
    assert HOT <= fast, f"no typed kernel on this torch for: {sorted(HOT - fast)}"


def test_every_typed_kernel_has_a_rule():
    rules = set(hs._C.rule_names())
    fast = hs._C.fast_path_ops()
    assert len(fast) == len(set(fast)), "an op registered twice"
    assert set(fast) <= rules, f"typed kernels without a rule: {sorted(set(fast) - rules)}"


def test_a_rule_row_is_enough():
    # Ops that no list names: their rows (pointwise tables, torch's pointwise tag, foreach) and a
    # catalogue signature give them a typed kernel, which runs them (the key check compares its
    # plan key with the boxed flow's on every call).
    fast = set(hs._C.fast_path_ops())
    calls = {
        "aten::cos": lambda a, b: torch.cos(a),
        "aten::maximum": lambda a, b: torch.maximum(a, b),
        "aten::clamp_max.Tensor": lambda a, b: torch.clamp_max(a, b),
        "aten::logical_not": lambda a, b: torch.logical_not(a),
        "aten::_foreach_sub_.Scalar": lambda a, b: torch._foreach_sub_([a, b], 0.5),
    }
    assert set(calls) <= fast, f"ruled ops of a catalogue signature without a typed kernel: {sorted(set(calls) - fast)}"
    one = PlanningMesh({"tp": 1})
    a = one.dtensor([4, 6], ["S(0)"])
    b = one.dtensor([4, 6], ["S(0)"])
    hs._C.set_key_check(True)
    try:
        for name, call in calls.items():
            call(a, b)  # the first call fills the fast path's slot
            before = hs._C.dispatch_stats()["fast_calls"]
            call(a, b)
            assert hs._C.dispatch_stats()["fast_calls"] == before + 1, f"{name} did not take its typed kernel"
    finally:
        hs._C.set_key_check(False)


def test_fast_path_switch():
    assert hs._C.fast_path_enabled()
    hs._C.set_fast_path(False)
    try:
        assert not hs._C.fast_path_enabled()
    finally:
        hs._C.set_fast_path(True)
