"""Level1: hs.recompute (activation recomputation, docs/recompute.md) on the four target models,
one mesh each, in strict mode, in ONE 2-rank launch:

- Qwen3.5 dense on tp2, selective (its gated delta nets' and attention's tp collectives recomputed);
- Qwen3.5-MoE on ep2, full (the experts' all-to-all / reduction over ep recomputed);
- Qwen3-VL-MoE on cp2, selective (K/V all-gathered again in the recomputation);
- Qwen3.5 dense on cp2, full and selective (the gated delta net's conv halo exchange and state
  chain run again in the recomputation; its node rebuilds its local graph in backward; one
  sequence of 128 and dt_bias / A_log against float64, as test_linear_attention_cp.py argues);
- DeepSeek-V3.2 with fully_shard on dp2, full: the recomputation gathers no parameter a third time
  (FullyShardGroup.stats(): as many gathers per step as without recomputation);
- Qwen3.5 dense on tp2 with hs.mixed_precision (bf16 compute, fp32 masters), selective;
- Qwen3 with fully_shard on dp2 and hs.compile (aot_eager: each block compiled, the groups' hooks
  and the checkpoint eager around it), selective, compared with the compiled run without
  recomputation (bitwise, and the gather count).

Each run is compared twice: with the SAME mesh and model without recomputation, BIT FOR BIT
(losses, first-step gradients, final parameters: the same ops on the same values in the same
order; backward only reads rebuilt tensors instead of kept ones), and with one device by
hypershard.testing.training (losses rtol 1e-5, gradients and parameters in norm, tolerances argued
there; the mixed-precision run is compared bitwise only, its one-device comparison is
tests/python/level1/test_mixed_precision.py's). Planted faults that must fail: the Qwen3.5 tp2
run with each recomputation fed its input off by 2^-20 relative (the bitwise check catches what
check_training's tolerances would let through), the DeepSeek-V3.2
fully_shard run with each module's pre-backward gather freed before its recomputation (the
recomputation then gathers a third time: same values, caught by the gather count), and the
Qwen3.5 cp2 run with the gated delta block rebuilt in backward from zeros instead of the state
it received (bitwise check).
"""

import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases
from hypershard.testing.training import bitwise_differences

STEPS = 3
TP2 = ((2,), ("tp",))
EP2 = ((2,), ("ep",))
CP2 = ((2,), ("cp",))
DP2 = ((2,), ("dp",))
# Qwen3.5 on cp as tests/python/level1/test_linear_attention_cp.py runs it: one sequence of 128 (each
# cp rank's block one whole chunk of the gated delta rule), dt_bias / A_log checked against float64
QWEN3_5_CP = dict(seq=128, batch=1, exact=True)


def _gathers(model) -> int:
    from hypershard.fsdp.fully_shard import _groups

    return sum(g.cgroup.stats()["gathers"] for g in _groups(model, True))


def trainer(
    model_type, mode, *, fully_shard=False, mixed=False, compiled=False, fault=None, seq=16, batch=4, exact=False
):
    def setup():
        from hypershard.testing.models import make_batches, tiny_config

        # (no KV cache: a compiled block handed one runs eagerly, and a recomputed one drops it)
        overrides = {"use_cache": False} if model_type == "qwen3" else {}
        config = tiny_config(model_type, **overrides, **({"max_position_embeddings": seq} if seq > 64 else {}))
        return config, make_batches(config.get_text_config().vocab_size, STEPS, batch=batch, seq=seq)

    def reference(_dummy):
        from hypershard.testing.models import tiny_model, train

        config, batches = setup()
        return torch.tensor(train(tiny_model(config), batches), dtype=torch.float64)

    def distributed(_dummy):
        import contextlib
        import sys
        from unittest import mock

        import hypershard as hs
        import hypershard.parallel.recompute  # noqa: F401

        rc = sys.modules["hypershard.parallel.recompute"]
        from hypershard.checkpoint.pretrained import fully_shard_layers
        from hypershard.parallel import parallelize
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import check_training, record_cp_training, record_training

        assert hs.is_strict()
        config, batches = setup()
        mesh = current_mesh()

        def build(recompute: bool):
            model = parallelize(tiny_model(config), mesh)
            if fully_shard:
                fully_shard_layers(model, mesh)
            if recompute:
                hs.recompute(model, mode=mode)
                layers = rc.decoder_layers(model)
                assert layers and all(rc.recompute_mode(m) == mode for m in layers)
            if mixed:
                hs.mixed_precision(model)
            if compiled:
                hs.compile(model, backend="aot_eager")
            return model

        def record(model):
            if "cp" in mesh.mesh_dim_names:
                got, stats, _ = record_cp_training(model, batches, mesh)
            else:
                hs._C.reset_dispatch_stats()
                got = record_training(model, batches)
                stats = hs._C.dispatch_stats()
            assert stats["implicit_calls"] == 0 and stats["fallback_calls"] == 0, stats
            return got

        base_model = build(False)
        base = record(base_model)
        model = build(True)
        patch = contextlib.nullcontext()
        if fault == "perturbed_recompute":

            def perturbed(fn, hidden, *args, **kwargs):  # the recomputation sees its input off by 2^-20
                def run(hidden, *args, **kwargs):
                    if torch._C._current_graph_task_id() != -1:
                        hidden = hidden * (1 + 2.0**-20)
                    return fn(hidden, *args, **kwargs)

                return torch.utils.checkpoint.checkpoint(run, hidden, *args, **kwargs)

            patch = mock.patch.object(rc, "checkpoint", perturbed)
        if fault == "third_gather":
            fs = sys.modules["hypershard.fsdp.fully_shard"]

            def wasteful(ctx, *grads):  # the pre-backward gather dropped before the recomputation
                out = original(ctx, *grads)
                if ctx.group is not ctx.group.context.root:  # (the root is not recomputed)
                    ctx.group.cgroup.free_unsharded()
                return out

            original = fs._PreBackward.backward
            patch = mock.patch.object(fs._PreBackward, "backward", staticmethod(wasteful))
        if fault == "rebuilt_from_zeros":
            from hypershard.parallel import linear_attention as la

            def forgetful(ctx):  # the gated delta block rebuilt in backward from zeros, not the received state
                if ctx.rebuild:
                    run = ctx.run
                    ctx.run = lambda *block, initial_state: run(*block, initial_state=torch.zeros_like(initial_state))
                return rebuild(ctx)

            rebuild = la._ChainedBlock._local_graph
            patch = mock.patch.object(la._ChainedBlock, "_local_graph", staticmethod(forgetful))
        calls = []
        if fault is None:
            counted = rc.checkpoint

            def counting(*args, **kwargs):
                calls.append(1)
                return counted(*args, **kwargs)

            patch = mock.patch.object(rc, "checkpoint", counting)
        with patch:
            got = record(model)
        if fault is None and not compiled:  # every decoder layer checkpointed in every step
            assert len(calls) == STEPS * len(rc.decoder_layers(model)), len(calls)
        bad = bitwise_differences(got, base)
        if fully_shard:
            gathers, base_gathers = _gathers(model), _gathers(base_model)
            if gathers != base_gathers:
                bad.append(f"{gathers} parameter gathers with recomputation, {base_gathers} without")
        if fault:
            assert bad, f"planted fault {fault!r} was not caught"
            return torch.tensor(base.losses, dtype=torch.float64) if not mixed else torch.zeros(1, dtype=torch.float64)
        assert not bad, "not bit-for-bit equal to the run without recomputation: " + "; ".join(bad[:8])
        if mixed:
            return torch.zeros(1, dtype=torch.float64)
        expected = record_training(tiny_model(config), batches)
        # (Qwen3.5 on cp: dt_bias's and A_log's gradients nearly cancel, so they are checked against
        # the float64 run, as tests/python/level1/test_linear_attention_cp.py argues)
        exact_record = record_training(tiny_model(config).double(), batches) if exact else None
        problems, _ = check_training(got, expected, exact_record)
        assert not problems, "\n".join(problems)
        return torch.tensor(got.losses, dtype=torch.float64)

    if mixed:
        return (lambda _dummy: torch.zeros(1, dtype=torch.float64)), distributed
    return reference, distributed


def _case(name, mesh, reference, distributed):
    # The losses the case returns are compared again by the harness (rtol 1e-5); the real checks
    # (bitwise against the run without recomputation, check_training against one device) ran inside.
    return Case(
        name,
        reference,
        [Input((1,), requires_grad=False)],
        mesh,
        dist_fn=distributed,
        check_grad=False,
        rtol=1e-5,
        atol=0.0,
    )


def cases():
    return [
        _case("qwen3_5_text_tp2_selective", TP2, *trainer("qwen3_5_text", "selective")),
        _case("qwen3_5_moe_ep2_full", EP2, *trainer("qwen3_5_moe_text", "full")),
        _case("qwen3_vl_moe_cp2_selective", CP2, *trainer("qwen3_vl_moe", "selective")),
        _case("qwen3_5_text_cp2_full", CP2, *trainer("qwen3_5_text", "full", **QWEN3_5_CP)),
        _case("qwen3_5_text_cp2_selective", CP2, *trainer("qwen3_5_text", "selective", **QWEN3_5_CP)),
        _case("deepseek_v32_fully_shard_dp2_full", DP2, *trainer("deepseek_v32", "full", fully_shard=True)),
        _case(
            "qwen3_fully_shard_dp2_compiled_selective",
            DP2,
            *trainer("qwen3", "selective", fully_shard=True, compiled=True),
        ),
        _case("qwen3_5_text_tp2_mixed_precision_selective", TP2, *trainer("qwen3_5_text", "selective", mixed=True)),
        _case(
            "qwen3_5_text_tp2_planted_perturbed_recompute_is_caught",
            TP2,
            *trainer("qwen3_5_text", "full", fault="perturbed_recompute"),
        ),
        _case(
            "qwen3_5_text_cp2_planted_rebuilt_from_zeros_is_caught",
            CP2,
            *trainer("qwen3_5_text", "full", fault="rebuilt_from_zeros", **QWEN3_5_CP),
        ),
        _case(
            "deepseek_v32_fully_shard_dp2_planted_third_gather_is_caught",
            DP2,
            *trainer("deepseek_v32", "full", fully_shard=True, fault="third_gather"),
        ),
    ]


def test_recompute_equals_no_recompute_and_one_device():
    assert_all_passed(run_cases(cases(), backend="hypershard", timeout=600))
