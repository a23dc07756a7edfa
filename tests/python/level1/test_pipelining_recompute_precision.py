"""Level1, strict mode: activation recomputation and mixed precision inside the stages of hs.pipeline
(hypershard.pipelining.recompute_and_precision), Qwen3 (4 layers) on pp2 x dp2 with 1F1B, batch 8 x
16 tokens in 4 microbatches, 3 AdamW steps, in ONE 4-rank launch:

- recompute="full": BIT FOR BIT equal to the same pipeline without recomputation (losses,
  first-step gradients, final parameters: the same ops on the same values in the same order; the
  backward of each microbatch only reads rebuilt tensors instead of kept ones), and equal to one
  device within hypershard.testing.training's fp32 tolerances (microbatching changes only the order
  of float32 sums: tests/python/level1/test_pipelining.py). Each of the stage's own layers is
  checkpointed once per microbatch, the pass-through stand-ins for the other stage's layers never.
- mixed_precision=True (bf16 compute, fp32 masters, fp32 gradient sums) against ONE DEVICE running
  hs.mixed_precision on the same model, within test_mixed_precision.py's bf16 tolerances (argued
  there: differently placed bf16 roundings of the same values). Here a dp rank and a microbatch
  each round their partial weight gradient to bf16 before the fp32 sums (the bucket over dp, the
  accumulation over microbatches), where one device rounds the whole batch's sum once: the dp
  case argued there, with more partial sums; the hidden states cross the stage boundary in bf16,
  as one device's residual stream passes between its layers, so the boundary adds no rounding.
  With twice the trained tokens of that test (8 samples, not 4), sigma_L is smaller, not larger.
  Every stage computes in bf16 (a Linear's weight inside its forward) while its parameters,
  gradients and AdamW state stay fp32.
- fully_shard + recompute="selective" + mixed precision together (the documented order): bit for
  bit equal to the same pipeline without recomputation, with as many parameter gathers, and
  within the bf16 tolerances of one device.

Planted faults that must fail: each recomputation fed its input off by 2^-20 relative (the bitwise
check catches what the fp32 tolerances would let through), and stages trained in bf16 without fp32
masters (every RMSNorm weight misses its whole update: lr 1e-3 is below half a bf16 ulp of 1.0).
"""

import contextlib
import sys
from unittest import mock

import torch
from test_mixed_precision import check_mixed
from test_pipelining import _only, _record

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases
from hypershard.testing.training import bitwise_differences

STEPS = 3
PP2_DP2 = ((2, 2), ("pp", "dp"))
N_MICROBATCHES = 4


def _gathers(pipe) -> int:
    return sum(
        m._hs_fully_shard.cgroup.stats()["gathers"]
        for s in pipe.modules
        for m in s.modules()
        if hasattr(m, "_hs_fully_shard")
    )


def _perturbed(fn, hidden, *args, **kwargs):
    """Fault: the recomputation (inside backward) sees its input off by 2^-20 relative."""

    def run(hidden, *args, **kwargs):
        if torch._C._current_graph_task_id() != -1:
            hidden = hidden * (1 + 2.0**-20)
        return fn(hidden, *args, **kwargs)

    return torch.utils.checkpoint.checkpoint(run, hidden, *args, **kwargs)


def _compute_dtypes(pipe) -> list:
    """Records, per stage, the dtype of its first own layer's first Linear weight inside its forward."""
    from hypershard.pipelining.split import text_model

    seen: list = []
    for stage in pipe.modules:
        layer = text_model(stage.model).layers[stage.spec.layers[0]]
        linear = next(m for m in layer.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    return seen


def trainer(recompute=None, mixed=False, fully_shard=False, fault=None):
    def distributed(_dummy):
        import hypershard as hs
        import hypershard.parallel.recompute  # noqa: F401
        from hypershard.testing.models import make_batches, tiny_config, tiny_model
        from hypershard.testing.training import check_training, record_training

        rc = sys.modules["hypershard.parallel.recompute"]
        assert hs.is_strict()
        config = tiny_config("qwen3", num_hidden_layers=4)
        batches = make_batches(config.vocab_size, STEPS, batch=8, seq=16)
        if mixed:
            from test_mixed_precision import train as train_checking_dtypes

            seen_one: dict = {}
            expected = record_training(
                hs.mixed_precision(tiny_model(config)),
                batches,
                train=lambda m, b, on_backward=None: train_checking_dtypes(m, b, on_backward, seen_one),
            )
            assert not seen_one["not fp32"], seen_one
        else:
            expected = record_training(tiny_model(config), batches)

        def build(with_recompute):
            model = tiny_model(config)
            if fault == "no_master":  # the stages' parameters themselves in bf16
                model = model.to(torch.bfloat16)
            return hs.pipeline(
                model,
                current_mesh(),
                n_microbatches=N_MICROBATCHES,
                schedule="1f1b",
                fully_shard=fully_shard,
                recompute=recompute if with_recompute else None,
                mixed_precision=mixed and fault != "no_master",
            )

        base_pipe = build(False) if recompute else None
        base = _record(base_pipe, batches) if recompute else None
        pipe = build(True)
        names = {n for n, _ in pipe.named_parameters()}
        own = [text_model_layer for s in pipe.modules for text_model_layer in _own_layers(s)]
        if recompute:
            assert all(rc.recompute_mode(m) == recompute for m in own), [rc.recompute_mode(m) for m in own]
            others = [m for s in pipe.modules for m in s.modules() if rc.recompute_mode(m) and m not in own]
            assert not others, others
        dtypes = _compute_dtypes(pipe)
        calls = []
        patch = contextlib.nullcontext()
        if fault == "perturbed_recompute":
            patch = mock.patch.object(rc, "checkpoint", _perturbed)
        elif recompute:
            counted = rc.checkpoint

            def counting(*args, **kwargs):
                calls.append(1)
                return counted(*args, **kwargs)

            patch = mock.patch.object(rc, "checkpoint", counting)
        with patch:
            got = _record(pipe, batches)
        bad = bitwise_differences(got, base) if recompute else []
        if fully_shard and recompute and _gathers(pipe) != _gathers(base_pipe):
            bad.append(f"{_gathers(pipe)} parameter gathers with recomputation, {_gathers(base_pipe)} without")
        check = check_mixed if mixed or fault == "no_master" else check_training
        problems, worst = check(got, _only(expected, names))
        if fault is not None:
            _report(recompute, mixed, fully_shard, expected.losses, got.losses, worst, fault, bad[:4] + problems[:4])
            assert bad or problems, f"planted fault {fault} was NOT caught; worst {worst}"
            return torch.zeros(1, dtype=torch.float64)
        assert not bad, "not bit-for-bit equal to the pipeline without recomputation: " + "; ".join(bad[:8])
        assert not problems, "\n".join(problems)
        if recompute:
            # each own layer checkpointed once per microbatch of each step (and once more in the
            # first step, when torch's stage runs its module to infer the boundary metadata)
            assert len(calls) == len(own) * (STEPS * N_MICROBATCHES + 1), (len(calls), len(own))
        want = torch.bfloat16 if mixed else torch.float32
        assert dtypes and set(dtypes) == {want}, set(dtypes)
        for name, p in pipe.named_parameters():
            assert isinstance(p, hs.DTensor) and p.dtype == torch.float32, (name, p.dtype)
            assert p.grad is not None and p.grad.dtype == torch.float32, (name, p.grad)
        _report(recompute, mixed, fully_shard, expected.losses, got.losses, worst)
        return torch.zeros(1, dtype=torch.float64)

    return distributed


def _own_layers(stage) -> list:
    from hypershard.pipelining.split import text_model

    layers = text_model(stage.model).layers
    return [layers[i] for i in stage.spec.layers]


def _report(recompute, mixed, fully_shard, expected, got, worst, fault=None, caught=()):
    """With HYPERSHARD_PP_REPORT=FILE, rank 0 appends the case's losses and worst deltas to FILE."""
    import json
    import os

    import torch.distributed as dist

    path = os.environ.get("HYPERSHARD_PP_REPORT")
    if path and dist.get_rank() == 0:
        with open(path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "recompute": recompute,
                        "mixed": mixed,
                        "fully_shard": fully_shard,
                        "one_device": expected,
                        "pipeline": got,
                        "worst": worst,
                        "fault": fault,
                        "caught": list(caught),
                    }
                )
                + "\n"
            )


def _case(name, distributed):
    # The real checks (bitwise against the pipeline without recomputation, the tolerances against
    # one device) run inside each rank; the harness only sees that every rank returned.
    return Case(
        name,
        lambda _dummy: torch.zeros(1, dtype=torch.float64),
        [Input((1,), requires_grad=False)],
        PP2_DP2,
        dist_fn=distributed,
        check_grad=False,
        rtol=0.0,
        atol=0.0,
    )


def cases():
    return [
        _case("qwen3_pp2_dp2_1f1b_recompute_full", trainer(recompute="full")),
        _case("qwen3_pp2_dp2_1f1b_bf16", trainer(mixed=True)),
        _case(
            "qwen3_pp2_dp2_1f1b_fully_shard_selective_bf16",
            trainer(recompute="selective", mixed=True, fully_shard=True),
        ),
        _case(
            "qwen3_pp2_dp2_planted_perturbed_recompute_is_caught",
            trainer(recompute="full", fault="perturbed_recompute"),
        ),
        _case("qwen3_pp2_dp2_planted_no_master_is_caught", trainer(mixed=True, fault="no_master")),
    ]


def test_pipeline_stages_with_recompute_and_mixed_precision_strict():
    assert_all_passed(run_cases(cases(), backend="hypershard", timeout=600))
