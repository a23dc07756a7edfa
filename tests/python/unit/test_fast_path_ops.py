"""UT: the typed fast path covers the hot ops on this torch, and only ops that have a rule."""

import hypershard as hs

HOT = {"aten::add.Tensor", "aten::add_.Tensor", "aten::mul.Tensor", "aten::mul_.Tensor", "aten::div.Tensor",
       "aten::view", "aten::t", "aten::transpose.int", "aten::expand", "aten::mm", "aten::addmm",
       "aten::sum.dim_IntList", "aten::mean.dim", "aten::_softmax", "aten::_foreach_add_.List",
       "aten::_foreach_mul_.Tensor", "aten::_foreach_lerp_.Scalar"}


def test_hot_ops_have_typed_kernels():
    fast = set(hs._C.fast_path_ops())
    assert HOT <= fast, f"no typed kernel on this torch for: {sorted(HOT - fast)}"


def test_every_typed_kernel_has_a_rule():
    rules = set(hs._C.rule_names())
    fast = hs._C.fast_path_ops()
    assert len(fast) == len(set(fast)), "an op registered twice"
    assert set(fast) <= rules, f"typed kernels without a rule: {sorted(set(fast) - rules)}"


def test_fast_path_switch():
    assert hs._C.fast_path_enabled()
    hs._C.set_fast_path(False)
    try:
        assert not hs._C.fast_path_enabled()
    finally:
        hs._C.set_fast_path(True)
