"""UT (no processes): hs.mixed_precision's policy checks (house error format, nothing changed when it
refuses) and the recipe on one device: bf16 compute, fp32 masters and gradients, the masters back
in place after forward (also when forward raises), activation checkpointing's recomputation."""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import hypershard as hs
from hypershard.fsdp.mixed_precision import BF16, mixed_precision_policy


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("policy, match", [
    ("bf16", r"hypershard: mixed_precision: policy 'bf16' is a str; allowed: a hypershard.MixedPrecisionPolicy"),
    (hs.MixedPrecisionPolicy(), r"param_dtype=None gives nothing to compute in; allowed: a floating dtype"),
    (hs.MixedPrecisionPolicy(torch.int8), r"param_dtype=torch.int8 gives nothing to compute in"),
    (hs.MixedPrecisionPolicy(torch.bfloat16, torch.int32), r"reduce_dtype=torch.int32 is not a floating dtype; "
                                                           r"allowed: None or a floating dtype"),
    (hs.MixedPrecisionPolicy(torch.bfloat16, output_dtype="fp32"), r"output_dtype='fp32' is not a floating dtype"),
])
def test_bad_policies(policy, match):
    model = _mlp()
    with pytest.raises(ValueError, match=match):
        hs.mixed_precision(model, policy)
    assert not model._forward_pre_hooks and mixed_precision_policy(model) is None


def test_parameters_no_wider_than_param_dtype():
    model = _mlp().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"parameter 0.weight is torch.bfloat16, no wider than "
                                         r"param_dtype=torch.bfloat16: there would be no master copy"):
        hs.mixed_precision(model)
    assert not model[0]._forward_pre_hooks


def test_twice_and_no_floating_parameters():
    model = hs.mixed_precision(_mlp())
    with pytest.raises(ValueError, match=r"Sequential is already under mixed precision; allowed: one"):
        hs.mixed_precision(model)
    with pytest.raises(ValueError, match=r"ReLU has no floating parameters to compute in torch.bfloat16"):
        hs.mixed_precision(nn.ReLU())


def test_bf16_compute_fp32_masters_and_gradients():
    model = _mlp()
    masters = list(model.parameters())
    assert hs.mixed_precision(model) is model and mixed_precision_policy(model) == BF16
    seen = []
    model[2].register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)) or None)
    x = torch.randn(3, 4)
    out = model(x)  # an fp32 input: cast_forward_inputs
    assert out.dtype == torch.bfloat16 and seen == [(torch.bfloat16, torch.bfloat16)]
    out.float().sum().backward()
    assert list(model.parameters()) == masters  # the masters are back in place
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in masters)
    by_hand = _mlp().to(torch.bfloat16)  # the same computation on a bf16 copy
    by_hand(x.to(torch.bfloat16)).float().sum().backward()
    for p, q in zip(masters, by_hand.parameters()):
        assert torch.equal(p.grad, q.grad.float())


def test_output_dtype_and_reduce_dtype_other_than_the_masters():
    model = hs.mixed_precision(_mlp(), hs.MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16,
                                                               output_dtype=torch.float32))
    out = model(torch.randn(3, 4))
    assert out.dtype == torch.float32
    out.sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_masters_restored_when_forward_raises():
    model = hs.mixed_precision(_mlp())
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 5))  # wrong width
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float32 for p in model[0]._parameters.values())


def test_activation_checkpointing_recomputes_with_bf16_copies():
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    plain, checkpointed = hs.mixed_precision(_mlp()), hs.mixed_precision(_mlp())
    plain(x).float().sum().backward()
    checkpoint(checkpointed, x, use_reentrant=False).float().sum().backward()
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_sft_default_is_bf16_for_bf16_checkpoints(tmp_path):
    import json
    from types import SimpleNamespace

    from hypershard.sft.train import checkpoint_dtype, precision_of

    for name, config in {"bf16": {"torch_dtype": "bfloat16"}, "fp32": {"dtype": "float32"},
                         "vl": {"text_config": {"dtype": "bfloat16"}}, "none": {}}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert checkpoint_dtype(tmp_path / "bf16") == "bfloat16" and checkpoint_dtype(tmp_path / "none") is None
    auto = {name: precision_of(SimpleNamespace(model=str(tmp_path / name), mixed_precision="auto"))
            for name in ("bf16", "fp32", "vl", "none")}
    assert auto == {"bf16": "bf16", "fp32": "none", "vl": "bf16", "none": "none"}
    assert precision_of(SimpleNamespace(model="qwen3", mixed_precision="auto")) == "none"  # a tiny type: fp32
    assert precision_of(SimpleNamespace(model=str(tmp_path / "fp32"), mixed_precision="bf16")) == "bf16"
