"""Level1: Qwen3.5's gated delta rule routed through a user region (hs.local_map, via
hypershard.parallel.linear_attention.route_gated_delta_rule), standing in for a fused kernel -- here a
pure-torch custom op (`hs_l1::gated_delta_rule`, transformers' chunked rule inside
torch.library.custom_op, so hypershard sees an op it has no rule for) -- trains 3 AdamW steps on
tp2 (heads over tp in the region) and cp2 (the sequence gathered for the region), strict, against
one device (hypershard.testing.training's checks, tolerances argued there; the float64 run as
`exact` for dt_bias and A_log, as test_linear_attention_cp.py explains). Every step's forward
must have run the region once per gated delta net.

Planted fault: the region declared with the sequence SHARDED on cp (each rank runs the recurrence
on its block from a zero state, as a kernel without a state chain would): the same checks fail."""

import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

STEPS = 3
SEQ = 128
CALLS = {"n": 0}


def _kernel():
    """transformers' chunked rule as a custom op (its own autograd through torch's): the stand-in for
    flash-linear-attention's kernel, which hypershard cannot see into either."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    def kernel(query, key, value, g=None, beta=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, **kwargs):
        CALLS["n"] += 1
        assert not any(hasattr(t, "placements") for t in (query, key, value, g, beta)), "a DTensor reached the kernel"
        return torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                            output_final_state=output_final_state,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    return kernel


def _sequence_sharded_region(model, mesh):
    """The planted fault: route_gated_delta_rule with cp laid out on the sequence (dim 1)."""
    from unittest import mock

    from hypershard.parallel import linear_attention

    dims = dict(linear_attention._REGION_DIMS)
    original = linear_attention._region_spec

    def spec(mesh, kind):
        out = original(mesh, kind)
        if kind in ("qkv", "gate"):
            from hypershard.tensor.placement_types import Shard
            out = [Shard(1) if n == "cp" else p for n, p in zip(mesh.mesh_dim_names, out)]
        return out

    with mock.patch.object(linear_attention, "_region_spec", spec):
        linear_attention.route_gated_delta_rule(model, mesh, _kernel())
    assert dims == linear_attention._REGION_DIMS


def trainer(fault=False):
    def config():
        from hypershard.testing.models import tiny_config
        return tiny_config("qwen3_5_text", max_position_embeddings=SEQ)

    def batches(config):
        from hypershard.testing.models import make_batches
        return make_batches(config.vocab_size, STEPS, batch=1, seq=SEQ)

    def reference(_dummy):
        from hypershard.testing.models import tiny_model, train
        return torch.tensor(train(tiny_model(config()), batches(config())), dtype=torch.float64)

    def distributed(_dummy):
        from hypershard.parallel import parallelize
        from hypershard.parallel.linear_attention import route_gated_delta_rule
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import check_training, record_cp_training, record_training

        expected = record_training(tiny_model(config()), batches(config()))
        exact = record_training(tiny_model(config()).double(), batches(config()))
        mesh = current_mesh()
        model = parallelize(tiny_model(config()), mesh)
        if fault:
            _sequence_sharded_region(model, mesh)
        else:
            assert route_gated_delta_rule(model, mesh, _kernel()) == 1
        CALLS["n"] = 0
        if "cp" in mesh.mesh_dim_names:  # restores the mesh's cp declarations for the next case
            got, stats, _ = record_cp_training(model, batches(config()), mesh)
        else:
            got = record_training(model, batches(config()))
        problems, worst = check_training(got, expected, exact)
        if fault:
            assert problems, f"planted fault was NOT caught; worst ratios {worst}"
            return torch.tensor(expected.losses, dtype=torch.float64)
        assert not problems, "\n".join(problems)
        assert CALLS["n"] >= STEPS, CALLS  # the region ran every step (and again for the records)
        return torch.tensor(got.losses, dtype=torch.float64)

    return reference, distributed


def _case(name, mesh, reference, distributed):
    return Case(name, reference, [Input((1,), requires_grad=False)], mesh, dist_fn=distributed,
                check_grad=False, rtol=1e-5, atol=0.0)


def test_gated_delta_rule_through_a_region_trains_like_one_device():
    cases = [
        _case("qwen3_5_region_tp2", ((2,), ("tp",)), *trainer()),
        _case("qwen3_5_region_cp2", ((2,), ("cp",)), *trainer()),
        _case("qwen3_5_region_cp2_planted_sequence_sharded_is_caught", ((2,), ("cp",)), *trainer(fault=True)),
    ]
    assert_all_passed(run_cases(cases, backend="hypershard", timeout=600))
