"""Level1: a tiny Qwen3ForCausalLM trains with the CUDA lowering of its attention, on CPU meshes.

No GPU: hypershard.testing.cuda_lowering gives the CUDA attention ops CPU kernels (exact attention
with their schemas and their Meta kernels' extra outputs) and routes F.scaled_dot_product_attention
to the kernel torch's CUDA chooser would call (flash, efficient, cuDNN, or the PrivateUse1 hook
_scaled_dot_product_fused_attention_overrideable), with AdamW's foreach path (CUDA's default).
So the distributed rules of _scaled_dot_product_{flash,efficient,cudnn}_attention(_backward) run
exactly as on a GPU, only the local arithmetic differs. Cases (4 query / 2 key-value heads, strict
mode, the model's own tensor-parallel plan, 3 AdamW steps against the same lowering on one device;
hypershard.testing.training's checks: losses rtol 1e-5, first-step gradients and final
parameters in norm, no fallback op, no implicit redistribution):

- flash, efficient, cuDNN and overrideable on dp=2 x tp=2 (heads split with their KV groups);
- efficient, cuDNN and overrideable with a padding mask (the mask a bool (b, 1, L, S) HF builds,
  made additive and, for efficient, padded and expanded to (b, h, L, S));
- flash on tp=4, where 2 KV heads cannot follow 4 head shards: key/value replicated, each rank's
  kernel reading its group's KV head, their gradients Partial(sum);
- GradScaler (fp32, growth every step) on dp=2 x tp=2: found_inf all-reduced over tp.
"""

import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

STEPS = 3
DP2_TP2 = ((2, 2), ("dp", "tp"))
TP4 = ((4,), ("tp",))
HEADS = {"num_key_value_heads": 2}
KERNEL_OPS = {"flash": "aten::_scaled_dot_product_flash_attention",
              "efficient": "aten::_scaled_dot_product_efficient_attention",
              "cudnn": "aten::_scaled_dot_product_cudnn_attention",
              "overrideable": "aten::_scaled_dot_product_fused_attention_overrideable"}


def _scenario(backend, padding=False, scaler=False):
    from hypershard.testing.cuda_lowering import Scenario

    return Scenario(f"{backend}{' + padding' if padding else ''}", backend, padding=padding, scaler=scaler)


def trainer(backend, padding=False, scaler=False):
    def setup():
        from hypershard.testing import cuda_lowering
        from hypershard.testing.models import tiny_config

        config = tiny_config("qwen3", **HEADS)
        return config, cuda_lowering.batches(config, STEPS, padding)

    def train_fn():
        import functools

        from hypershard.testing import cuda_lowering

        return functools.partial(cuda_lowering.train, scenario=_scenario(backend, padding, scaler))

    def reference(_dummy):
        from hypershard.testing.models import tiny_model

        config, batches = setup()
        return torch.tensor(train_fn()(tiny_model(config), batches), dtype=torch.float64)

    def distributed(_dummy):
        import hypershard as hs
        from hypershard.parallel import parallelize
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import check_training, record_training

        assert hs.is_strict()
        config, batches = setup()
        expected = record_training(tiny_model(config), batches, train=train_fn())
        model = parallelize(tiny_model(config), current_mesh())
        hs._C.reset_op_counts()
        hs._C.reset_dispatch_stats()
        got = record_training(model, batches, train=train_fn())
        stats = hs._C.dispatch_stats()
        assert stats["implicit_calls"] == 0 and stats["fallback_calls"] == 0, stats
        reached = {name for name, count, *_ in hs._C.op_counts() if count}
        assert KERNEL_OPS[backend] in reached and KERNEL_OPS[backend] + "_backward" in reached, sorted(reached)
        if scaler:
            assert "aten::_amp_foreach_non_finite_check_and_unscale_" in reached, sorted(reached)
        problems, _ = check_training(got, expected)
        assert not problems, "\n".join(problems)
        return torch.tensor(got.losses, dtype=torch.float64)

    return reference, distributed


def _case(name, mesh, backend, **kwargs):
    reference, distributed = trainer(backend, **kwargs)
    return Case(name, reference, [Input((1,), requires_grad=False)], mesh, dist_fn=distributed,
                check_grad=False, rtol=1e-5, atol=0.0)


def cases():
    out = [_case(f"qwen3_{backend}_dp2_tp2", DP2_TP2, backend)
           for backend in ("flash", "efficient", "cudnn", "overrideable")]
    out += [_case(f"qwen3_{backend}_padding_dp2_tp2", DP2_TP2, backend, padding=True)
            for backend in ("efficient", "cudnn", "overrideable")]
    out.append(_case("qwen3_flash_replicated_kv_tp4", TP4, "flash"))
    out.append(_case("qwen3_efficient_gradscaler_dp2_tp2", DP2_TP2, "efficient", scaler=True))
    return out


def test_qwen3_trains_with_the_cuda_lowering():
    assert_all_passed(run_cases(cases(), backend="hypershard", timeout=600))
