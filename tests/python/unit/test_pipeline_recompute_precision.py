"""UT: hs.pipeline's recompute= and mixed_precision= (hypershard.pipelining.recompute_and_precision) on one
process: which modules each applies to, a one-stage pipeline equal bit for bit to the whole model under
the same hs.recompute + hs.mixed_precision recipe, and the refusals (one line, hypershard's format).
The distributed runs are tests/python/level1/test_pipelining_recompute_precision.py."""

import types

import pytest
import torch

import hypershard as hs
from hypershard.fsdp.mixed_precision import BF16, mixed_precision_policy
from hypershard.parallel.recompute import recompute_mode
from hypershard.pipelining import PipelineError, StageModule, split_model, stage_model
from hypershard.pipelining.recompute_and_precision import apply_stage_options
from hypershard.pipelining.split import text_model
from hypershard.testing.models import make_batches, tiny_config, tiny_model


def _config():
    return tiny_config("qwen3", num_hidden_layers=4)


def test_only_the_stage_s_own_layers_are_recomputed():
    model = tiny_model(_config())
    specs = split_model(model, 2)
    for spec in specs:
        module = StageModule(stage_model(model, spec), spec)
        apply_stage_options(module, "selective", BF16)
        layers = text_model(module.model).layers
        modes = [recompute_mode(layer) for layer in layers]
        assert modes == ["selective" if i in spec.layers else None for i in range(4)], (spec.index, modes)
        assert mixed_precision_policy(module) == BF16


def test_one_stage_equals_the_model_under_the_same_recipe():
    """pp=1 (no mesh): the StageModule's logits and every gradient equal hs.recompute("full") +
    hs.mixed_precision on the whole model bit for bit: the same modules, the same casts."""
    ids, labels = make_batches(_config().vocab_size, 1, batch=2, seq=8)[0]

    expected_model = hs.mixed_precision(hs.recompute(tiny_model(_config()), mode="full"))
    expected = expected_model(input_ids=ids, use_cache=False).logits
    expected.float().sum().backward()

    pipe = hs.pipeline(tiny_model(_config()), None, n_microbatches=1, recompute="full", mixed_precision=True)
    (stage,) = pipe.modules
    got = stage(ids)
    got.float().sum().backward()

    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    grads = dict(expected_model.named_parameters())
    for name, p in pipe.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, grads[name].grad), name


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"recompute": "partial"},
            "hypershard: pipeline: recompute='partial' is not a recomputation mode; "
            "allowed: None or one of ['full', 'selective']",
        ),
        (
            {"mixed_precision": "bf16"},
            "hypershard: pipeline: mixed_precision='bf16' is a str; allowed: None, True (bf16 compute, fp32 "
            "gradient sums) or a hypershard.MixedPrecisionPolicy",
        ),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(PipelineError) as error:
        hs.pipeline(tiny_model(_config()), None, n_microbatches=1, **kwargs)
    assert str(error.value) == message


def test_a_policy_without_a_floating_param_dtype_is_refused():
    with pytest.raises(ValueError, match="hypershard: mixed_precision: param_dtype=None gives nothing to compute in"):
        hs.pipeline(tiny_model(_config()), None, n_microbatches=1, mixed_precision=hs.MixedPrecisionPolicy())


@pytest.mark.parametrize(
    "option, message",
    [
        ({"fully_shard": lambda model, mesh: model}, "a callable fully_shard with a pp axis; allowed: fully_shard=True"),
        ({"mp_policy": BF16}, r"mp_policy with a pp axis; allowed: mixed_precision=<policy>"),
    ],
)
def test_from_pretrained_with_pp_refuses_before_reading(tmp_path, option, message):
    """Refused before the folder (empty here) or the mesh is read: a stand-in mesh with a pp axis."""
    mesh = types.SimpleNamespace(mesh_dim_names=("pp", "dp"))
    with pytest.raises(ValueError, match=message):
        hs.from_pretrained(tmp_path, mesh, n_microbatches=2, **option)
