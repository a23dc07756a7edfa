"""UT: how parallelize prepares a model with linear-attention layers for a context-parallel mesh
(hypershard.parallel.linear_attention, docs/context_parallel.md), no processes: the inputs stay in natural
order (labels still shifted over the whole sequence, position ids made, any length), every gated
delta net of a tiny Qwen3.5 gets the cp-aware chunk function for that instance only, and plain
tensors still run transformers' function unchanged (the model's output bitwise the same)."""

import pytest
import torch

pytest.importorskip("transformers")
from hypershard.parallel import linear_attention  # noqa: E402
from hypershard.parallel.inputs import _head_tail_inputs  # noqa: E402


def test_natural_order_inputs():
    ids = torch.arange(7).reshape(1, 7) + 10  # any length: no head-tail chunks to divide it
    out = _head_tail_inputs({"input_ids": ids, "labels": ids.clone()}, chunks=None)
    assert torch.equal(out["input_ids"], ids)
    assert out["position_ids"].tolist() == [list(range(7))]
    assert out["shift_labels"].tolist() == [[11, 12, 13, 14, 15, 16, -100]]


def test_install_on_qwen3_5_instances_only():
    from hypershard.testing.models import tiny_config, tiny_model

    config = tiny_config("qwen3_5_text")
    model, untouched = tiny_model(config), tiny_model(config)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    nets = [m for m in model.modules() if linear_attention.is_gated_delta_net(m)]
    assert len(nets) == config.layer_types.count("linear_attention") == 1
    assert linear_attention.install_context_parallel_linear_attention(model, None, 0) == 1
    net = nets[0]
    assert "forward" in vars(net)  # this instance's forward
    installed = net.forward.__func__.__globals__[linear_attention._FUNCTION_NAME]
    assert installed.__name__ == "chunk_gated_delta_rule" and hasattr(installed, "__wrapped__")
    other = next(m for m in untouched.modules() if linear_attention.is_gated_delta_net(m))
    assert "forward" not in vars(other)  # the class and other instances keep transformers' function
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)  # plain tensors: transformers' function, unchanged


def test_refuses_a_gated_delta_net_it_cannot_reach():
    class OtherGatedDeltaNet(torch.nn.Module):
        def forward(self, x):
            return x

    model = torch.nn.Sequential(OtherGatedDeltaNet())
    with pytest.raises(ValueError, match="recurrence cannot be run on a context-parallel sequence"):
        linear_attention.install_context_parallel_linear_attention(model, None, 0)
