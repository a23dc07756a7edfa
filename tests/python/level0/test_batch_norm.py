"""Level0: batch normalization (F.batch_norm, F.instance_norm; csrc/ops/normalization.cpp) on
real meshes against one device, strict mode: the output, the gradients of input, weight and bias,
and the running stats after the call (written in place).

N (uneven: 5 or 7 rows over 2 and 4 ranks, one rank's block empty) and spatial dims sharded,
training: the statistics are GLOBAL (all-gathered per-rank count/mean/M2), the running stats get
the GLOBAL batch mean and unbiased variance on every rank. C sharded: local. Both on (2, 2).
Inference (training=False): local for any sharding.

Tolerances (float32 defaults, rtol 1e-5, atol 1e-6): the statistics of one device and of the
combined blocks differ only by float rounding of sums of at most a few hundred unit-scale terms
(each block's Welford pass, then a float64 combination); the output is (x - mean) * invstd with
|x - mean| * invstd = O(1), so its error is a few ulp. grad_input subtracts per-channel means of
grad_out and grad_out * xhat (sums of <= 140 unit-scale terms, all-reduced in float64 here, in
another order than one device), so its absolute error stays ~K u ~ 1e-6 at worst."""

import torch
import torch.nn.functional as F

from hypershard.testing import Case, Input, assert_all_passed, replicated, run_cases, uniform

M2 = ((2,), ("dp",))
M4 = ((4,), ("dp",))
M22 = ((2, 2), ("dp", "tp"))


def bn(training, momentum=0.1, eps=1e-5):
    def fn(x, w, b, rm, rv):
        return F.batch_norm(x, rm, rv, w, b, training=training, momentum=momentum, eps=eps)
    return fn


def bn_no_stats(x, w, b):
    return F.batch_norm(x, None, None, w, b, training=True)


def bn_inputs(shape, x_p, p_p, stat_p):
    c = shape[1]
    return [Input(shape, placements=x_p), Input((c,), placements=p_p), Input((c,), placements=p_p),
            Input((c,), placements=stat_p, requires_grad=False),
            Input((c,), placements=stat_p, requires_grad=False, init=uniform(0.5, 2.0))]


def batch_norm_cases():
    out = []

    def add(name, shape, mesh, x_p, p_p=None, stat_p=None, momentum=0.1):
        stat_p = p_p if stat_p is None else stat_p
        for training in (True, False):
            t = "train" if training else "eval"
            out.append(Case(f"bn_{name}_{t}", bn(training, momentum), bn_inputs(shape, x_p, p_p, stat_p), mesh,
                            check_inputs=True))
        c = shape[1]
        out.append(Case(f"bn_{name}_no_stats", bn_no_stats,
                        [Input(shape, placements=x_p), Input((c,), placements=p_p), Input((c,), placements=p_p)],
                        mesh))

    # N sharded, uneven: 5 rows over 2, 7 and 5 over 4 (chunk(5, 4): one rank's block is empty)
    add("1d_batch_2", (5, 3), M2, ["S(0)"])
    add("1d_seq_batch_2", (5, 3, 4), M2, ["S(0)"], momentum=0.3)
    add("2d_batch_2", (5, 3, 4, 3), M2, ["S(0)"])
    add("2d_batch_4", (7, 3, 4, 3), M4, ["S(0)"])
    add("2d_batch_empty_block_4", (5, 3, 2, 3), M4, ["S(0)"])
    # a spatial dim sharded (uneven), and N and a spatial dim on two axes
    add("2d_spatial_4", (2, 3, 7, 3), M4, ["S(2)"])
    add("2d_batch_spatial_2x2", (5, 3, 5, 2), M22, ["S(0)", "S(3)"])
    # C sharded: local (6 channels over 4 ranks: one empty block); weight/stats sharded alike
    add("2d_channel_4", (4, 6, 3, 2), M4, ["S(1)"], ["S(0)"])
    add("1d_channel_2", (4, 5), M2, ["S(1)"], ["S(0)"])
    # N and C on (2, 2)
    add("2d_batch_channel_2x2", (5, 4, 3, 3), M22, ["S(0)", "S(1)"], ["R", "S(0)"])
    add("1d_seq_channel_batch_2x2", (3, 5, 4), M22, ["S(1)", "S(0)"], ["S(0)", "R"])
    # replicated weight with a channel-sharded input (chunked locally); running stats whole while
    # the input's channels are sharded (the batch stats are made whole for the update)
    add("2d_channel_weight_whole_2", (4, 6, 3, 2), M2, ["S(1)"], ["R"])
    add("2d_channel_stats_whole_2x2", (5, 6, 3, 2), M22, ["S(0)", "S(1)"], ["R", "S(0)"], ["R", "R"])
    # running stats sharded while the input's channels are not: the input follows them
    add("2d_stats_sharded_batch_2", (4, 6, 3, 2), M2, ["S(0)"], ["R"], ["S(0)"])
    # plain running stats (nn.BatchNorm's buffers on a model whose input alone is a DTensor)
    c = 3
    plain = [Input((5, c, 4), placements=["S(0)"]), Input((c,)), Input((c,)),
             Input((c,), requires_grad=False, plain=True),
             Input((c,), requires_grad=False, plain=True, init=uniform(0.5, 2.0))]
    out.append(Case("bn_plain_stats_batch_4", bn(True), plain, M4, check_inputs=True))
    # everything replicated
    add("2d_replicate_2", (3, 3, 2, 2), M2, ["R"])
    return out


def cudnn_bn(training):
    """aten::cudnn_batch_norm, what F.batch_norm reaches on CUDA (cuDNN) -- here through
    hypershard.testing.cuda_lowering's CPU kernel, on a GPU through cuDNN's own. Its reserve is
    shaped by each rank's block; the backward (training) is the rule's formula, not cuDNN's."""

    def fn(x, w, b, rm, rv):
        from hypershard.testing import cuda_lowering

        cuda_lowering.install_cpu_kernels()
        return torch.ops.aten.cudnn_batch_norm(x, w, b, rm, rv, training, 0.1, 1e-5)[0]
    return fn


def cudnn_batch_norm_cases():
    out = []
    for name, shape, mesh, x_p, p_p, stat_p in (
        ("batch_2", (5, 3, 4), M2, ["S(0)"], None, None),
        ("batch_empty_block_4", (5, 3, 2, 3), M4, ["S(0)"], None, None),
        ("spatial_4", (2, 3, 7, 3), M4, ["S(2)"], None, None),
        ("channel_4", (4, 6, 3, 2), M4, ["S(1)"], ["S(0)"], None),
        ("batch_channel_2x2", (5, 4, 3, 3), M22, ["S(0)", "S(1)"], ["R", "S(0)"], None),
        ("channel_stats_whole_2x2", (5, 6, 3, 2), M22, ["S(0)", "S(1)"], ["R", "S(0)"], ["R", "R"]),
    ):
        for training in (True, False):
            t = "train" if training else "eval"
            stats = p_p if stat_p is None else stat_p
            out.append(Case(f"cudnn_bn_{name}_{t}", cudnn_bn(training), bn_inputs(shape, x_p, p_p, stats), mesh,
                            check_inputs=True))
    return out


def instance_norm_cases():
    out = []
    for name, shape, mesh, x_p in (("batch_2", (4, 3, 5), M2, ["S(0)"]),
                                   ("batch_4", (4, 3, 5, 2), M4, ["S(0)"]),
                                   ("batch_spatial_2x2", (4, 3, 5), M22, ["S(0)", "S(2)"])):
        c = shape[1]
        out.append(Case(f"instance_norm_{name}", lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
                        [Input(shape, placements=x_p), Input((c,)), Input((c,))], mesh))
        out.append(Case(f"instance_norm_stats_{name}",
                        lambda x, rm, rv: F.instance_norm(x, rm, rv, use_input_stats=True, momentum=0.2),
                        [Input(shape, placements=x_p), Input((c,), requires_grad=False),
                         Input((c,), requires_grad=False, init=uniform(0.5, 2.0))], mesh, check_inputs=True))
    # instance_norm views the input as [1, N*C, *]: the merged dim keeps whole shards only when N
    # is sharded in equal blocks; channels sharded, or an uneven N, the view refuses (strict mode)
    for name, shape, x_p in (("channel_2", (3, 4, 5), ["S(1)"]), ("uneven_batch_2", (5, 3, 4), ["S(0)"])):
        out.append(Case(f"instance_norm_{name}", lambda x: F.instance_norm(x), [Input(shape, placements=x_p)], M2,
                        expect_error="would cut through a sharded dim"))
    return out


def test_batch_norm_matches_one_device():
    assert_all_passed(run_cases(batch_norm_cases(), timeout=900))


def test_cudnn_batch_norm_matches_one_device():
    assert_all_passed(run_cases(cudnn_batch_norm_cases(), timeout=600))


def test_instance_norm_matches_one_device():
    assert_all_passed(run_cases(instance_norm_cases(), timeout=600))


def test_batch_norm_errors_on_every_rank():
    cases = [
        Case("bn_partial_input", bn(True), bn_inputs((4, 3, 2), ["P"], None, None), M2,
             expect_error="Partial(sum) input is not supported by this op"),
        Case("bn_partial_running_mean_train", bn(True),
             bn_inputs((4, 3, 2), ["S(0)"], None, None)[:3]
             + [Input((3,), placements=["P(max)"], requires_grad=False), Input((3,), requires_grad=False)], M2,
             expect_error="the running stats are updated in place"),
        Case("bn_stats_sharded_unlike", bn(True),
             bn_inputs((4, 4, 2), ["S(0)"], None, None)[:3]
             + [Input((4,), placements=["S(0)"], requires_grad=False), Input((4,), requires_grad=False)], M2,
             expect_error="is sharded unlike running_mean"),
        Case("bn_weight_shape", bn(True),
             [Input((4, 3, 2), placements=["S(0)"]), Input((4,)), Input((3,)), Input((3,), requires_grad=False),
              Input((3,), requires_grad=False)], M2, expect_error="weight should contain 3 elements not 4"),  # torch checks first
    ]
    assert_all_passed(run_cases(cases, timeout=300))


def conv_bn_train(x, conv_w, bn_w, bn_b, rm, rv):
    """A tiny conv + BatchNorm2d block trained 3 SGD steps (data parallel when x is batch-sharded
    and the parameters replicated): the losses, the parameters after every step and the running
    stats at the end."""
    params = [conv_w, bn_w, bn_b]
    for p in params:
        p.grad = None
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    losses, snapshots = [], []
    for _ in range(3):
        opt.zero_grad()
        h = F.batch_norm(F.conv2d(x, conv_w, padding=1), rm, rv, bn_w, bn_b, training=True, momentum=0.1)
        loss = replicated(torch.relu(h).pow(2).mean())
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        snapshots += [p.detach().clone() for p in params]
    return [torch.stack(losses)] + snapshots + [rm.clone(), rv.clone()]


def test_conv_batch_norm_training_matches_one_device():
    cases = []
    # batch-sharded only (uneven: 5 over 2, 7 over 4); a spatially sharded x that needs no
    # gradient crashes conv2d's backward (the convolution family's halo path), not batch norm's
    for name, mesh, n in (("dp2", M2, 5), ("dp4", M4, 7)):
        inputs = [Input((n, 2, 6, 6), placements=["S(0)"], requires_grad=False), Input((4, 2, 3, 3)), Input((4,)),
                  Input((4,)), Input((4,), requires_grad=False),
                  Input((4,), requires_grad=False, init=uniform(0.5, 2.0))]
        cases.append(Case(f"conv_bn_train_{name}", conv_bn_train, inputs, mesh, check_grad=False, check_inputs=True))
    assert_all_passed(run_cases(cases, timeout=300))


def _local_stats_bn(x, w, b, rm, rv):
    """A planted fault: each rank normalises its block with its own statistics."""
    import hypershard as hs
    local = F.batch_norm(x.to_local(), rm.to_local(), rv.to_local(), w.to_local(), b.to_local(), training=True)
    return hs.DTensor.from_local(local, x.device_mesh, x.placements)


def test_local_statistics_would_be_caught():
    case = Case("planted_local_stats", bn(True), bn_inputs((5, 3, 4), ["S(0)"], None, None), M2,
                dist_fn=_local_stats_bn, check_grad=False)
    assert not run_cases([case], timeout=300).ok, "the planted local statistics passed"
