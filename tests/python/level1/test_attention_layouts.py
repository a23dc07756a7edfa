"""Level1: attention whose KV heads tp does not divide trains in strict mode, as parallelize decided.

A new user's setup: a Qwen3ForCausalLM (tiny config, random init) with 6 query heads and 3 KV heads
on dp=2 x tp=2, the model's own plan, strict mode (every rank, by the harness). 3 KV heads over 2 tp
ranks cannot be split into whole heads, and with the 6 query heads sharded 3 + 3 each rank's query
heads read two KV heads, one of them shared (rank 0: KV heads 0-1, rank 1: 1-2), which no layout of
key/value serves. parallelize therefore replicates that attention on tp up front (with a warning)
and keeps the MLP sharded, instead of accepting a plan whose first forward stops inside attention.
3 AdamW steps match the single-device run (hypershard.testing.training: losses rtol 1e-5, gradients
and parameters in norm) with no fallback op and no implicit redistribution.
"""

import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

STEPS = 3
DP2_TP2 = ((2, 2), ("dp", "tp"))
HEADS = {"num_attention_heads": 6, "num_key_value_heads": 3}


def _setup():
    from hypershard.testing.models import make_batches, tiny_config

    config = tiny_config("qwen3", **HEADS)
    return config, make_batches(config.vocab_size, STEPS, batch=4, seq=16)


def reference(_dummy):
    from hypershard.testing.models import tiny_model, train

    config, batches = _setup()
    return torch.tensor(train(tiny_model(config), batches), dtype=torch.float64)


def distributed(_dummy):
    import warnings

    import hypershard as hs
    from hypershard.parallel import parallelize
    from hypershard.testing.models import tiny_model
    from hypershard.testing.training import check_training, record_training

    assert hs.is_strict()
    config, batches = _setup()
    expected = record_training(tiny_model(config), batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = parallelize(tiny_model(config), current_mesh())
    assert any("3 key/value heads (grouped under 6 query heads)" in str(w.message) for w in caught), caught
    layer = model.model.layers[0]
    for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
        weight = getattr(layer.self_attn, projection).weight
        assert [list(axes) for axes in hs.layout_of(weight).dim_axes] == [[], []], (projection, hs.layout_of(weight))
    assert [list(axes) for axes in hs.layout_of(layer.mlp.up_proj.weight).dim_axes] == [[1], []]
    hs._C.reset_dispatch_stats()
    got = record_training(model, batches)
    stats = hs._C.dispatch_stats()
    assert stats["implicit_calls"] == 0 and stats["fallback_calls"] == 0, stats
    problems, _ = check_training(got, expected)
    assert not problems, "\n".join(problems)
    return torch.tensor(got.losses, dtype=torch.float64)


def test_qwen3_6_query_3_kv_heads_trains_strict_on_dp2_tp2():
    case = Case("qwen3_6q_3kv_dp2_tp2_strict", reference, [Input((1,), requires_grad=False)], DP2_TP2,
                dist_fn=distributed, check_grad=False, rtol=1e-5, atol=0.0)
    assert_all_passed(run_cases([case], backend="hypershard", timeout=300))
