"""UT (no processes): what the batch-norm rules plan (csrc/ops/normalization.cpp). The input
keeps its sharding; the [C] tensors follow its channel axes; training with N or spatial dims
sharded runs the expand (GLOBAL statistics) and its save_mean/save_invstd are whole on those
axes; inference is local; training writes the running stats in place, so they keep their layout
(the input's channels follow them); the backward's parameter gradients are whole after the
training expand and Partial(sum) in inference; errors raise before anything runs."""

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh, plan

A = torch.ops.aten


def bn_args(m, shape, x, p, stats=None):
    c = shape[1]
    stats = p if stats is None else stats
    return (m.dtensor(shape, x), m.dtensor([c], p), m.dtensor([c], p), m.dtensor([c], stats), m.dtensor([c], stats))


def test_batch_sharded_training_expands_and_keeps_the_input_sharding():
    m = PlanningMesh({"dp": 2, "tp": 2})
    p = plan(A.native_batch_norm.default, *bn_args(m, [5, 4, 3, 3], ["S(0)", "S(1)"], ["R", "S(0)"]), True, 0.1, 1e-5)
    assert p.input_specs == [["S(0)", "S(1)"]] + [["R", "S(0)"]] * 4
    assert p.output_specs == [["S(0)", "S(1)"], ["R", "S(0)"], ["R", "S(0)"]] and p.expands
    assert list(p.outputs[1].global_shape) == [4]
    # spatial dims sharded: the same
    p = plan(A._native_batch_norm_legit.default, *bn_args(m, [2, 3, 5, 4], ["S(3)", "S(2)"], ["R", "R"]),
             True, 0.1, 1e-5)
    assert p.output_specs[0] == ["S(3)", "S(2)"] and p.output_specs[1] == ["R", "R"] and p.expands


def test_channel_sharded_and_inference_are_local():
    m = PlanningMesh({"dp": 2, "tp": 2})
    p = plan(A.native_batch_norm.default, *bn_args(m, [4, 8, 3], ["R", "S(1)"], ["R", "S(0)"]), True, 0.1, 1e-5)
    assert p.output_specs == [["R", "S(1)"], ["R", "S(0)"], ["R", "S(0)"]] and not p.expands
    # a replicated weight is chunked like the channel dim
    p = plan(A.native_batch_norm.default, *bn_args(m, [4, 8, 3], ["R", "S(1)"], ["R", "R"], ["R", "S(0)"]),
             True, 0.1, 1e-5)
    assert p.input_specs[1] == ["R", "S(0)"] and not p.expands
    for op, args in ((A.native_batch_norm.default, (False, 0.1, 1e-5)),
                     (A._native_batch_norm_legit_no_training.default, (0.1, 1e-5)),
                     (A._batch_norm_no_update.default, (0.1, 1e-5))):
        p = plan(op, *bn_args(m, [5, 4, 3], ["S(0)", "S(2)"], ["R", "R"]), *args)
        assert p.output_specs[0] == ["S(0)", "S(2)"] and not p.expands
        assert list(p.outputs[1].global_shape) == [0]


def test_with_update_and_no_stats():
    m = PlanningMesh({"dp": 4})
    p = plan(A._batch_norm_with_update.default, *bn_args(m, [7, 3, 2], ["S(0)"], ["R"]), 0.1, 1e-5)
    assert p.output_specs == [["S(0)"], ["R"], ["R"], ["R"]] and p.expands
    assert list(p.outputs[3].global_shape) == [0]
    x = m.dtensor([7, 3, 2], ["S(2)"])
    p = plan(A._native_batch_norm_legit.no_stats, x, None, None, True, 0.1, 1e-5)
    assert p.output_specs == [["S(2)"], ["R"], ["R"]] and p.expands


def test_training_keeps_the_running_stats_layout():
    m = PlanningMesh({"dp": 2})
    # sharded running stats: the input's channels follow them (its batch gathered on that axis)
    p = plan(A.native_batch_norm.default, *bn_args(m, [4, 6, 2], ["S(0)"], ["R"], ["S(0)"]), True, 0.1, 1e-5)
    assert p.input_specs == [["S(1)"], ["S(0)"], ["S(0)"], ["S(0)"], ["S(0)"]] and not p.expands
    # whole running stats with channel-sharded input: the input keeps its sharding, the expand
    # makes the batch statistics whole for the update
    p = plan(A.native_batch_norm.default, *bn_args(m, [4, 6, 2], ["S(1)"], ["S(0)"], ["R"]), True, 0.1, 1e-5)
    assert p.input_specs == [["S(1)"], ["S(0)"], ["S(0)"], ["R"], ["R"]] and p.expands
    # in inference the running stats are only read: chunked like the channels
    p = plan(A.native_batch_norm.default, *bn_args(m, [4, 6, 2], ["S(1)"], ["S(0)"], ["R"]), False, 0.1, 1e-5)
    assert p.input_specs[3:] == [["S(0)"], ["S(0)"]] and not p.expands


def test_backward_layouts():
    m = PlanningMesh({"dp": 2, "tp": 2})
    shape = [5, 4, 3]
    g, x = m.dtensor(shape, ["S(0)", "S(1)"]), m.dtensor(shape, ["S(0)", "S(1)"])
    w, rm, rv, sm, si = (m.dtensor([4], ["R", "S(0)"]) for _ in range(5))
    p = plan(A.native_batch_norm_backward.default, g, x, w, rm, rv, sm, si, True, 1e-5, [True, True, True])
    assert p.output_specs == [["S(0)", "S(1)"], ["R", "S(0)"], ["R", "S(0)"]] and p.expands
    # inference: local, the parameter gradients Partial(sum) over the batch axis
    p = plan(A.native_batch_norm_backward.default, g, x, w, rm, rv, None, None, False, 1e-5, [True, True, True])
    assert p.output_specs == [["S(0)", "S(1)"], ["P", "S(0)"], ["P", "S(0)"]] and not p.expands
    # channel-sharded only: local in training too
    g, x = m.dtensor(shape, ["R", "S(1)"]), m.dtensor(shape, ["R", "S(1)"])
    reserve = m.dtensor([0], ["R", "R"], dtype=torch.uint8)
    p = plan(A.batch_norm_backward.default, g, x, w, rm, rv, sm, si, True, 1e-5, [True, True, True], reserve)
    assert p.output_specs == [["R", "S(1)"], ["R", "S(0)"], ["R", "S(0)"]] and not p.expands


def test_backward_partial_grad():
    m = PlanningMesh({"dp": 2, "tp": 2})
    shape = [4, 4, 3]
    x = m.dtensor(shape, ["R", "S(0)"])
    w, sm, si = (m.dtensor([4], ["R", "R"]) for _ in range(3))
    # linear in grad_out: a sum Partial on an axis the input does not shard is kept
    g = m.dtensor(shape, [hs.Partial(), "S(0)"])
    p = plan(A.native_batch_norm_backward.default, g, x, w, None, None, sm, si, True, 1e-5, [True, True, True])
    assert p.input_specs[0] == ["P", "S(0)"] and p.output_specs == [["P", "S(0)"], ["P", "R"], ["P", "R"]]
    # on an axis the input shards: an error outside a backward pass
    g = m.dtensor(shape, ["R", hs.Partial()])
    with pytest.raises(Exception, match=r"argument grad_out \(#0\).*Partial\(sum\) input is not supported"):
        plan(A.native_batch_norm_backward.default, g, x, w, None, None, sm, si, True, 1e-5, [True, True, True])


def test_errors_raise_before_anything_runs():
    m = PlanningMesh({"dp": 2})
    x, w, b, rm, rv = bn_args(m, [4, 3, 2], ["S(0)"], ["R"])
    with pytest.raises(Exception, match=r"hypershard: aten::native_batch_norm: argument input \(#0\).*"
                                         r"Partial\(sum\) input is not supported by this op"):
        plan(A.native_batch_norm.default, m.dtensor([4, 3, 2], [hs.Partial()]), w, b, rm, rv, True, 0.1, 1e-5)
    with pytest.raises(Exception, match=r"argument running_mean \(#3\).*the running stats are updated in place"):
        plan(A.native_batch_norm.default, x, w, b, m.dtensor([3], [hs.Partial("max")]), rv, True, 0.1, 1e-5)
    with pytest.raises(Exception, match=r"argument running_var \(#4\).*is sharded unlike running_mean"):
        plan(A.native_batch_norm.default, *bn_args(m, [4, 4, 2], ["S(0)"], ["R"])[:3], m.dtensor([4], ["S(0)"]),
             m.dtensor([4], ["R"]), True, 0.1, 1e-5)
    with pytest.raises(Exception, match=r"argument weight \(#1\).*is not the input's channel count; "
                                         r"allowed: a 1-d tensor of 3 elements"):
        plan(A.native_batch_norm.default, x, m.dtensor([4], ["R"]), b, rm, rv, True, 0.1, 1e-5)
    with pytest.raises(Exception, match=r"argument input \(#0\).*has 1 dims"):
        plan(A.native_batch_norm.default, m.dtensor([4], ["S(0)"]), None, None, None, None, True, 0.1, 1e-5)
    with pytest.raises(Exception, match="running_mean and running_var must be defined in evaluation mode"):
        plan(A.native_batch_norm.default, x, w, b, None, None, False, 0.1, 1e-5)
    with pytest.raises(Exception, match=r"argument input \(#0\).*has no element"):
        plan(A.native_batch_norm.default, m.dtensor([0, 3, 2], ["S(0)"]), None, None, None, None, True, 0.1, 1e-5)
    with pytest.raises(Exception, match=r"argument weight \(#1\).*dtype Double with a Float input"):
        plan(A.native_batch_norm.default, x, m.dtensor([3], ["R"], dtype=torch.float64), None, None, None,
             True, 0.1, 1e-5)


def test_cudnn_and_miopen_batch_norm_plan_as_native_batch_norm():
    # what F.batch_norm reaches on CUDA / ROCm: the same plans, the reserve Replicate
    m = PlanningMesh({"dp": 2, "tp": 2})
    args = bn_args(m, [5, 4, 3, 3], ["S(0)", "S(1)"], ["R", "S(0)"])
    native = plan(A.native_batch_norm.default, *args, True, 0.1, 1e-5)
    for op in (A.cudnn_batch_norm.default, A.miopen_batch_norm.default):
        p = plan(op, *args, True, 0.1, 1e-5)
        assert p.input_specs == native.input_specs and p.output_specs[:3] == native.output_specs and p.expands
    assert plan(A.cudnn_batch_norm.default, *args, True, 0.1, 1e-5).output_specs[3] == ["R", "R"]
    # inference: local
    p = plan(A.cudnn_batch_norm.default, *args, False, 0.1, 1e-5)
    assert p.output_specs[0] == ["S(0)", "S(1)"] and not p.expands
    with pytest.raises(Exception, match=r"aten::cudnn_batch_norm: argument input \(#0\).*Partial\(sum\) input"):
        plan(A.cudnn_batch_norm.default, m.dtensor([5, 4, 3], [hs.Partial(), "R"]), *args[1:], True, 0.1, 1e-5)


def test_cudnn_and_miopen_backward_take_the_formula():
    # cuDNN's order (input, grad_output, ...), no train flag (called when training), no mask: the
    # expand's formula on the block, even channel-sharded alone (cuDNN's reserve is not needed)
    m = PlanningMesh({"dp": 2, "tp": 2})
    shape = [5, 4, 3]
    x, g = m.dtensor(shape, ["S(0)", "S(1)"]), m.dtensor(shape, ["S(0)", "S(1)"])
    w, rm, rv, sm, si = (m.dtensor([4], ["R", "S(0)"]) for _ in range(5))
    reserve = m.dtensor([0], ["R", "R"], dtype=torch.uint8)
    p = plan(A.cudnn_batch_norm_backward.default, x, g, w, rm, rv, sm, si, 1e-5, reserve)
    assert p.output_specs == [["S(0)", "S(1)"], ["R", "S(0)"], ["R", "S(0)"]] and p.expands
    x, g = m.dtensor(shape, ["R", "S(1)"]), m.dtensor(shape, ["R", "S(1)"])
    p = plan(A.miopen_batch_norm_backward.default, x, g, w, rm, rv, sm, si, 1e-5)
    assert p.output_specs == [["R", "S(1)"], ["R", "S(0)"], ["R", "S(0)"]] and p.expands
    with pytest.raises(Exception, match=r"argument grad_output \(#1\).*shape differs from input"):
        plan(A.cudnn_batch_norm_backward.default, x, m.dtensor([5, 4, 2], ["R", "S(1)"]), w, rm, rv, sm, si,
             1e-5, reserve)
