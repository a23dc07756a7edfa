"""Level1: a real HuggingFace Qwen3ForCausalLM (tiny config, random init, no hub) trains 5 steps
of AdamW with clip_grad_norm_ on dp=4, tp=4, dp=2 x tp=2 and an uneven case; every step's loss
equals the single-device run (rtol 1e-5) and every parameter after step 5 matches (rtol 1e-4,
atol 1e-6). parallelize() uses the model's own tensor-parallel plan. Determinism: two runs of
the dp=2 x tp=2 training in one process give bit-identical losses and parameter shards."""

import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

STEPS = 5


def trainer(config_overrides, batch, seq):
    def run(_dummy):
        from hypershard.models import make_batches, tiny_config, tiny_model, train

        config = tiny_config("qwen3", **config_overrides)
        batches = make_batches(config.vocab_size, STEPS, batch=batch, seq=seq)
        reference_model = tiny_model(config)
        reference = train(reference_model, batches)
        return reference_model, reference, config, batches

    def reference(dummy):
        _, losses, _, _ = run(dummy)
        return torch.tensor(losses, dtype=torch.float64)

    def distributed(dummy):
        import hypershard as hs
        from hypershard.models import tiny_model, train
        from hypershard.parallel import parallelize

        reference_model, _, config, batches = run(dummy)
        model = parallelize(tiny_model(config), current_mesh())
        losses = train(model, batches)
        for (name, p), (_, q) in zip(model.named_parameters(), reference_model.named_parameters()):
            assert isinstance(p, hs.DTensor), name
            full = p.detach().full_tensor()
            assert torch.allclose(full, q.detach(), rtol=1e-4, atol=1e-6), (
                f"{name}: max abs diff {(full - q).abs().max().item():.3e} after {STEPS} steps")
        return torch.tensor(losses, dtype=torch.float64)

    return reference, distributed


def deterministic_trainer(batch, seq):
    """Trains the distributed model twice from the same initialisation (the second run with warm
    plan caches) and requires bit-identical losses and parameter shards."""
    def run(_dummy, distributed):
        from hypershard.models import make_batches, tiny_config, tiny_model, train
        from hypershard.parallel import parallelize

        config = tiny_config("qwen3")
        batches = make_batches(config.vocab_size, STEPS, batch=batch, seq=seq)
        if not distributed:
            return torch.tensor(train(tiny_model(config), batches), dtype=torch.float64)
        runs = []
        for _ in range(2):
            model = parallelize(tiny_model(config), current_mesh())
            losses = train(model, batches)
            runs.append((losses, [p.detach().to_local().clone() for p in model.parameters()]))
        (losses_a, params_a), (losses_b, params_b) = runs
        assert losses_a == losses_b, f"losses differ between two identical runs: {losses_a} vs {losses_b}"
        for index, (a, b) in enumerate(zip(params_a, params_b)):
            assert torch.equal(a, b), f"parameter {index} differs between two identical runs"
        return torch.tensor(losses_a, dtype=torch.float64)

    return (lambda dummy: run(dummy, False)), (lambda dummy: run(dummy, True))


def qwen3_cases():
    cases = []
    for tag, mesh, overrides, batch in (
            ("dp4", ((4,), ("dp",)), {}, 4),
            ("tp4", ((4,), ("tp",)), {}, 2),
            ("dp2_tp2", ((2, 2), ("dp", "tp")), {}, 4),
            # uneven over tp=2: intermediate 65 (33 + 32 columns), vocab 129 (65 + 64 rows of lm_head).
            # (An uneven batch over dp is not used: HF's loss calls labels.view(-1), which cannot
            # alias torch.chunk shards of an uneven batch and correctly raises.)
            ("uneven_dp2_tp2", ((2, 2), ("dp", "tp")), {"intermediate_size": 65, "vocab_size": 129}, 4)):
        reference, distributed = trainer(overrides, batch, 16)
        cases.append(Case(f"qwen3_{tag}", reference, [Input((1,), requires_grad=False)], mesh,
                          dist_fn=distributed, check_grad=False, rtol=1e-5, atol=0.0))
    reference, distributed = deterministic_trainer(4, 16)
    cases.append(Case("qwen3_dp2_tp2_bit_identical_reruns", reference, [Input((1,), requires_grad=False)],
                      ((2, 2), ("dp", "tp")), dist_fn=distributed, check_grad=False, rtol=1e-5, atol=0.0))
    return cases


def test_qwen3_trains_like_one_device():
    assert_all_passed(run_cases(qwen3_cases(), backend="hypershard", timeout=900))
