"""The hand-written part of the samples: code that reaches ops no OpInfo sample does (traced like
a sample), and calls written out argument by argument for ops no trace reaches."""

from __future__ import annotations

from typing import Callable

import torch

from .calls import TensorMeta
from .tracing import backward, seed_cpu


def extra_calls() -> list:
    """[(source, fn)]: code that reaches ops no OpInfo does: hypershard's own ops, the CPU
    attention kernel, the CUDA ones (their CPU stand-ins: hypershard.testing.cuda_lowering),
    dropout, the fused optimizers, GradScaler."""
    from ...tensor import ops as hs_ops
    from ...testing import cuda_lowering

    cuda_lowering.install_cpu_kernels()
    mask = torch.zeros(4, 1, 8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))

    def grad_of(fn, *shapes):
        def run():
            seed_cpu(0)
            leaves = [torch.randn(*s, requires_grad=True) for s in shapes]
            backward(fn(*leaves), leaves)

        return run

    return [
        ("hypershard.ops.rms_norm", grad_of(lambda x, w: hs_ops.rms_norm(x, w), (4, 6, 16), (16,))),
        (
            "hypershard.ops.rotary_position_embedding",
            grad_of(
                lambda x, c, s: hs_ops.rotary_position_embedding(x, c, s, 0),
                (4, 2, 8, 16),
                (1, 1, 8, 16),
                (1, 1, 8, 16),
            ),
        ),
        (
            "F.scaled_dot_product_attention",
            grad_of(
                lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                (4, 2, 8, 16),
                (4, 2, 8, 16),
                (4, 2, 8, 16),
            ),
        ),
        *[
            (
                f"F.scaled_dot_product_attention, CUDA lowering: {backend}",
                grad_of(
                    lambda q, k, v, b=backend: cuda_lowering.lowered_sdpa(
                        b, q, k, v, attn_mask=None if b == "flash" else mask, is_causal=b == "flash"
                    ),
                    (4, 2, 8, 16),
                    (4, 2, 8, 16),
                    (4, 2, 8, 16),
                ),
            )
            for backend in ("flash", "efficient", "cudnn", "overrideable")
        ],
        ("torch.amp.GradScaler", _grad_scaler_step),
        ("F.dropout", grad_of(lambda x: torch.nn.functional.dropout(x, 0.5, training=True), (4, 6))),
        (
            "hypershard embedding_vocab_backward",
            lambda: torch.ops.hypershard.embedding_vocab_backward(
                torch.randn(4, 6, 16), torch.randint(0, 32, (4, 6)), 32, -1, False, [0]
            ),
        ),
        *[
            (f"torch.optim.{name}(fused=True{', tensor lr' if tensor_lr else ''})", _optimizer_step(name, tensor_lr))
            for name in ("Adam", "AdamW", "SGD")
            for tensor_lr in (False, True)
        ],
    ]


def _grad_scaler_step() -> None:
    """GradScaler's unscale (_amp_foreach_non_finite_check_and_unscale_) and update
    (_amp_update_scale_) around an SGD step."""
    seed_cpu(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((params[0] @ params[1]).sum()).backward()
    scaler.step(optimizer)
    scaler.update()


def _optimizer_step(name: str, tensor_lr: bool) -> Callable[[], None]:
    def run():
        seed_cpu(0)
        params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
        for p in params:
            p.grad = torch.randn_like(p)
        lr = torch.tensor(0.01) if tensor_lr else 0.01
        kwargs = {"momentum": 0.9} if name == "SGD" else {}
        getattr(torch.optim, name)(params, lr=lr, fused=True, **kwargs).step()

    return run


def manual_calls() -> list:
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
        (
            "aten::scatter.value_reduce",
            {"self": x, "dim": 1, "index": t(4, 3, dtype=i64), "value": 1.0, "reduce": "add"},
        ),
        ("aten::_index_put_impl_", {"self": x, "indices": [t(3, dtype=i64)], "values": t(3, 6)}),
        (
            "aten::nll_loss2d_backward",
            {
                "grad_output": t(),
                "self": t(4, 6, 3, 3),
                "target": t(4, 3, 3, dtype=i64),
                "weight": None,
                "reduction": 1,
                "ignore_index": -100,
                "total_weight": t(),
            },
        ),
        ("aten::_grouped_mm", {"self": t(8, 16), "mat2": t(2, 16, 6), "offs": t(2, dtype=torch.int32)}),
        # F.rms_norm's CUDA kernel: on CPU its composite kernel runs instead
        ("aten::_fused_rms_norm", {"input": t(4, 6, 16), "normalized_shape": [16], "weight": t(16), "eps": 1e-6}),
        (
            "aten::_fused_rms_norm_backward",
            {
                "grad_out": t(4, 6, 16),
                "input": t(4, 6, 16),
                "normalized_shape": [16],
                "rstd": t(4, 6, 1),
                "weight": t(16),
                "output_mask": [True, True],
            },
        ),
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
        *[
            (f"aten::{name}.Tensor", {"self": t(4, 6, dtype=i64), "other": t(4, 6, dtype=i64)})
            for name in ("__lshift__", "__rshift__", "__xor__", "__ilshift__", "__irshift__", "__ixor__")
        ],
    ]
