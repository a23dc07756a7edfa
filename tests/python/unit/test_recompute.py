"""UT for hs.recompute (hypershard/parallel/recompute.py) on one process, plain tensors: the selective
policy's op list, bit-for-bit equality with the run without recomputation (with dropout: the RNG
replayed; with hs.mixed_precision: the masters back in place after an early-stopped recomputation), the refusals, and
planted faults that the same checks must catch. The distributed runs are level1
(tests/python/level1/test_recompute.py)."""

import contextlib
import functools
import sys
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

import hypershard as hs
import hypershard.parallel.recompute  # noqa: F401  (hs.recompute, the function, shadows the module's name)

rc = sys.modules["hypershard.parallel.recompute"]


def test_selective_save_ops_are_the_matmuls_and_attention():
    aten = torch.ops.aten
    for op in (
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._grouped_mm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten.convolution.default,
    ):
        assert rc.is_saved_op(op), op
    for op in (
        aten.add.Tensor,
        aten.mul.Tensor,
        aten.silu.default,
        aten.rsqrt.default,
        aten._softmax.default,
        aten.view.default,
        aten._to_copy.default,
        aten.native_dropout.default,
    ):
        assert not rc.is_saved_op(op), op
    assert rc.is_saved_op("aten::mm") and rc.is_saved_op("aten::mm.default") and rc.is_saved_op(aten.mm)
    assert all(name.count("::") == 1 for name in rc.SELECTIVE_SAVE_OPS)


def _ops_run(model, x, mode):
    """The aten ops backward's recomputation runs (the forward's own ops not counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    hs.recompute(model, mode=mode, modules=[model[0]])
    out = model(x).sum()
    with Record() as seen:
        out.backward()
    return seen.ops


class Block(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.drop = nn.Dropout(p)
        self.down = nn.Linear(12, 6)

    def forward(self, x):
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(x))))


def _model(p=0.0, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(Block(p), Block(p), nn.Linear(6, 3))


def test_selective_recomputes_the_cheap_ops_and_not_the_products():
    x = torch.randn(4, 6, requires_grad=True)
    full = _ops_run(_model(), x, "full")
    selective = _ops_run(_model(), x, "selective")
    aten = torch.ops.aten
    # full: the block's forward runs again in backward, its products included
    assert aten.addmm.default in full and aten.gelu.default in full
    # selective: gelu again, the products' outputs handed back from the forward
    assert aten.gelu.default in selective
    assert aten.addmm.default not in selective


def _train(model, steps=3, seed=1, **recompute):
    if recompute:
        hs.recompute(model, **recompute)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(123)  # the dropout stream
    losses, grads = [], []
    for x, y in data:
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        losses.append(loss.detach())
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def _equal(a, b):
    return (
        all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        and all(torch.equal(x, y) for gx, gy in zip(a[1], b[1]) for x, y in zip(gx, gy))
        and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))
    )


@pytest.mark.parametrize("mode", rc.MODES)
def test_dropout_replays_the_same_stream_bit_for_bit(mode):
    plain = _train(_model(p=0.3))
    model = _model(p=0.3)
    got = _train(model, mode=mode, modules=[model[0], model[1]])
    assert _equal(got, plain)


@pytest.mark.parametrize("mode", rc.MODES)
def test_planted_fault_rng_not_replayed_is_caught(mode):
    plain = _train(_model(p=0.3))
    model = _model(p=0.3)
    no_rng = functools.partial(torch_checkpoint.checkpoint, preserve_rng_state=False)

    def faulty(fn, *args, preserve_rng_state=True, **kwargs):
        return no_rng(fn, *args, **kwargs)

    with mock.patch.object(rc, "checkpoint", faulty):
        got = _train(model, mode=mode, modules=[model[0], model[1]])
    assert not _equal(got, plain), "a recomputation with a fresh dropout mask was not caught"


def _mixed(model):
    return hs.mixed_precision(model)


@pytest.mark.parametrize("mode", rc.MODES)
def test_mixed_precision_composes_bit_for_bit(mode):
    plain = _train(_mixed(_model()))
    model = _model()
    hs.recompute(model, mode=mode, modules=[model[0], model[1]])
    got = _train(_mixed(model))
    assert _equal(got, plain)
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float32 for p in model.parameters())


def test_eval_and_no_grad_do_not_checkpoint():
    model = _model()
    hs.recompute(model, modules=[model[0]])
    with mock.patch.object(rc, "checkpoint", side_effect=AssertionError("checkpointed")):
        with torch.no_grad():
            model(torch.randn(2, 6))
        model.eval()
        model(torch.randn(2, 6))


def test_refusals():
    model = _model()
    with pytest.raises(
        ValueError, match=r"hypershard: recompute: mode 'some' is not implemented; allowed: \['full', 'selective'\]"
    ):
        hs.recompute(model, mode="some", modules=[model[0]])
    with pytest.raises(ValueError, match="has no ModuleList named"):
        hs.recompute(model)
    with pytest.raises(ValueError, match="not a submodule"):
        hs.recompute(model, modules=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="contains another module"):
        hs.recompute(model, modules=[model[0], model[0].up])
    hs.recompute(model, modules=[model[0]])
    with pytest.raises(ValueError, match="recomputed already"):
        hs.recompute(model, modules=[model[0]])
    assert rc.recompute_mode(model[0]) == "full" and rc.recompute_mode(model[1]) is None
    assert type(model[0]).__name__ == "RecomputedBlock" and isinstance(model[0], Block)


def _tiny_hf():
    from hypershard.testing.models import tiny_config, tiny_model

    return tiny_model(tiny_config("qwen3"))


def test_transformers_gradient_checkpointing_is_refused_in_both_orders():
    model = _tiny_hf()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        hs.recompute(model)
    model = _tiny_hf()
    hs.recompute(model, mode="selective")
    assert all(rc.recompute_mode(layer) == "selective" for layer in model.model.layers)
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(ValueError, match="recomputed twice over"):
        model(input_ids=ids, labels=ids)
    model.gradient_checkpointing_disable()
    model(input_ids=ids, labels=ids).loss.backward()


def test_decoder_layers_default_and_hf_model_bit_for_bit():
    from hypershard.testing.models import make_batches, train

    batches = make_batches(128, 2)
    plain = train(_tiny_hf(), batches)
    for mode in rc.MODES:
        model = hs.recompute(_tiny_hf(), mode=mode)
        assert [type(m).__name__ for m in rc.decoder_layers(model)] == ["RecomputedQwen3DecoderLayer"] * 2
        assert train(model, batches) == plain


def test_sft_recompute_flag_recomputes_every_decoder_layer():
    from hypershard.sft.cli import parser
    from hypershard.sft.train import _with_precision

    base = ["--model", "qwen3", "--mesh", "dp=2", "--data", "d.json", "--output", "o", "--mixed-precision", "none"]
    assert parser().parse_args(base).recompute == "none"
    for mode in rc.MODES:
        model = _with_precision(_tiny_hf(), parser().parse_args([*base, "--recompute", mode]))
        assert [rc.recompute_mode(m) for m in rc.decoder_layers(model)] == [mode, mode]
    with pytest.raises(SystemExit):
        parser().parse_args([*base, "--recompute", "some"])


class _OneRankChain:
    """The state chain of a cp axis of one rank (linear_attention._Chain's fields): no neighbour,
    no message, so _ChainedBlock runs on one process."""

    first = last = True
    position, size = 0, 1

    def __init__(self, state_shape):
        self.state_shape, self.dtype, self.device = state_shape, torch.float32, torch.device("cpu")


@pytest.mark.parametrize("mode", ["full", "selective", "kept_graph_planted"])
def test_gated_delta_block_is_recomputed_once_and_exactly(mode):
    """The gated delta rule's cp node (linear_attention._ChainedBlock) inside a checkpointed
    module: the module runs twice (forward, one recomputation) and its gradients equal the
    unrecomputed run's bit for bit. The node keeps no local graph under saved-tensor hooks: it
    rebuilds it in backward from its saved inputs and state. Planted: the local graph kept as
    without hooks -- differentiating it in backward (a graph task of its own) recomputes the
    module a second time (3 runs; on a cp mesh that second recomputation replays the chain's
    receive while the neighbour waits for a gradient: both ranks hang)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from hypershard.parallel import linear_attention as la

    torch.manual_seed(0)
    batch, length, heads, dim = 1, 80, 2, 8  # 80: a whole chunk of 64 and a padded one
    inputs = [
        torch.randn(batch, length, heads, dim),
        torch.randn(batch, length, heads, dim),
        torch.randn(batch, length, heads, dim),
        -torch.rand(batch, length, heads),
        torch.rand(batch, length, heads),
    ]
    chain = _OneRankChain((batch, heads, dim, dim))
    runs = []

    def rule(q, k, v, g, beta, initial_state):
        return torch_chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )

    def module(q, k, v, g, beta):
        runs.append(1)
        out, _ = la._ChainedBlock.apply(chain, rule, True, None, q * 1.5, k, v, g.exp().log(), beta.sigmoid())
        return out.tanh()

    def gradients(call):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = call(*leaves)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        return out.detach(), [t.grad for t in leaves]

    base_out, base_grads = gradients(module)
    runs.clear()
    extra = {"context_fn": rc._selective_contexts} if mode == "selective" else {}
    planted = mock.patch.object(la, "_saved_tensors_hooks_active", lambda: False)
    with planted if mode == "kept_graph_planted" else contextlib.nullcontext():
        out, grads = gradients(lambda *t: torch_checkpoint.checkpoint(module, *t, use_reentrant=False, **extra))
    assert torch.equal(out, base_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, base_grads))
    if mode == "kept_graph_planted":
        assert len(runs) == 3, f"planted fault not caught: the module ran {len(runs)} times"
        return
    assert len(runs) == 2, f"the module ran {len(runs)} times; expected forward and one recomputation"
