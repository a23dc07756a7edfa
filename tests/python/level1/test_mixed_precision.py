"""Level1: hs.mixed_precision (bf16 compute, fp32 master weights and optimizer state, fp32 gradient
sums) trains like ONE DEVICE RUNNING THE SAME RECIPE, on every mesh kind, in strict mode.

Tiny HuggingFace models (hypershard.testing.models.TINY_CONFIGS), 3 AdamW steps with clip_grad_norm_:

- tp: Qwen3 on dp=2 x tp=2 (parallelize's TP plan; inputs over dp);
- ep: Qwen3.5-MoE on dp=2 x ep=2 (the experts on local tensors, their bf16 copies' gradients
  Partial over the token axes until the fp32 buckets);
- dp: Qwen3 on dp=4 (Replicate parameters, fp32 gradient buckets);
- fully_shard: Qwen3 on dp=4, every layer and the root fully sharded WITHOUT a policy, which
  mixed_precision then gives them (bf16 gathers, fp32 reduce-scatters).

The reference is the same model with hs.mixed_precision on one process. Every case checks that
the module computes in bf16 (a Linear's weight inside its forward), that the parameters, their
.grad and AdamW's exp_avg / exp_avg_sq are fp32, and compares losses, first-step gradients and
final parameters within the bf16 tolerances argued below (`check_mixed`). Two planted faults must
break those checks: a bf16 copy made once and never refreshed after the optimizer steps, and a
model trained in bf16 without fp32 masters; gradients summed in bf16 are caught by an exact sum
(`gradient_sums_in_fp32`). Last, the SFT CLI trains a checkpoint saved in bf16 in this recipe by
default.
"""

from __future__ import annotations

import json
import math
import os

import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases
from hypershard.testing.training import check_final_params, check_first_grads

STEPS = 3
LR = float(os.environ.get("HS_MP_LR", "1e-3"))
DP4 = ((4,), ("dp",))
DP2_TP2 = ((2, 2), ("dp", "tp"))
DP2_EP2 = ((2, 2), ("dp", "ep"))

# ---------------------------------------------------------------------------------- tolerances
# Both runs do the same arithmetic recipe; they differ in WHICH values get rounded to bf16 (unit
# roundoff u = 2^-8; a rounding error is at most u|x|, zero-mean with standard deviation u|x|/sqrt 3)
# and where: a tp rank rounds its partial product of a row-parallel matmul to bf16 and the ranks'
# bf16 partials are summed (one device rounds the whole sum once); a dp rank rounds its partial
# weight gradient (a sum over its tokens) before the fp32 bucket adds the ranks (one device rounds
# the sum over all tokens once); matmuls of other shapes take other kernels. The fp32 sums
# (buckets, clip norms, AdamW) differ by summation order only: ~1e-6 relative, nothing next to u.
# The master weights are rounded to bf16 identically in both runs. So every compared quantity
# differs by a few differently placed bf16 roundings of the values it is made of; k counts them
# along one path (per layer: a row-parallel output and its sum, a residual add, a norm: for the
# 2-layer models k <= 12).
#
# - Loss. Per token, logsumexp(z) - z_y moves by <softmax - onehot, dz> for logit errors dz. A
#   logit z_j = sum_i W_ji h_i (hidden 32, weights ~0.02, RMS-normalised h ~1) whose h carries
#   independent relative errors of std s = sqrt(k) u / sqrt 3 = 7e-3 (k = 10) is off by
#   ~ s ||W_j h||_2 ~ 0.113 s = 8e-4; ||softmax - onehot||_2 ~ 1 for the near-uniform softmax of
#   these models, so one token's loss is off by ~8e-4 (std), and the mean over T ~ 58 trained
#   tokens by sigma_L = 8e-4 / sqrt 58 = 1.1e-4 (Higham's statistical bound: independent
#   roundings add in quadrature; the worst case, every rounding the same way, is 2 (k + 1) u
#   sum|W h| ~ 4e-2 and says nothing). Steps 2 and 3 add the parameter differences below, of the
#   same order. LOSS_ATOL = 5e-4 ~ 4.5 sigma_L, ABSOLUTE: the loss ~ ln 128 is not the scale of
#   its error, the logits are. (Measured: <= 9.3e-5 on every mesh.) A wrong recipe moves the loss
#   by what training does: the stale bf16 copy below by 9e-4 at step 2 and 1.3e-3 at step 3.
# - First-step gradients, per parameter, in norm: a gradient element is one bf16 rounding of sums
#   over terms carrying the forward's and backward's relative errors; the worst case over all
#   elements is (k + 1) u = 13 u = 5.1e-2 = GRAD_RTOL (the statistical estimate,
#   sqrt(k + 1) u / sqrt 3, is 7.5e-3; small tensors -- 8-element norms -- need the worst case).
#   A halved or missing data-parallel sum is off by 25-100 %. (Measured: <= 1.6e-2.)
# - Parameters after the last step, per parameter, in norm relative to the update (as in
#   hypershard/testing/training.py): AdamW's first step moves every element by exactly lr sign(g)
#   and later steps mostly keep that sign, so an element whose gradient the runs' rounding
#   differences r = ||dg|| / ||g|| (<= 1.25e-2 here, 3 u) flip moves up to 2 lr per step apart.
#   For gradients distributed like a normal near 0, a fraction 0.8 r of the elements can flip,
#   which is 2 sqrt(0.8 r) = 0.2 of the update's norm: UPDATE_RTOL = 0.2 (fp32 tests use 1e-2:
#   u32 makes r ~1e-6). Plus steps u32 |p| for the parameter's own fp32 rounding. A model without
#   fp32 masters loses every update below half a bf16 ulp of its weight (RMSNorm weights are 1.0,
#   ulp 2^-7 = 7.8e-3 > lr = 1e-3: they never move, 100 % of their update). (Measured: <= 7.8e-2.)
#
# Gradient sums in bf16 instead of fp32 add one rounding (u) to a gradient that one device also
# rounds to bf16: on dp <= 4 that is inside these tolerances (measured: the same deltas as fp32
# sums, 0.9 % vs 0.9 % on dp=4), so `gradient_sums_in_fp32` checks the sum's dtype exactly.
U_BF16 = 2.0 ** -8
LOSS_ATOL = 5e-4
GRAD_RTOL = 13 * U_BF16  # (k + 1) u, k = 12: 5.1e-2
UPDATE_RTOL = 0.2


def _norm(t):
    return float(torch.linalg.vector_norm(t)) if t.numel() else 0.0


def check_mixed(got, expected):
    """(problems, worst): a distributed TrainingRecord against the one-device one, within the
    tolerances above."""
    problems, worst = [], {"loss_abs": 0.0, "grad_rel": 0.0, "update_rel": 0.0}
    for step, (a, b) in enumerate(zip(got.losses, expected.losses), 1):
        worst["loss_abs"] = max(worst["loss_abs"], abs(a - b))
        if not abs(a - b) <= LOSS_ATOL:
            problems.append(f"loss of step {step}: {a!r} vs {b!r} (differ by {abs(a - b):.2e} > {LOSS_ATOL:g})")
    if len(got.losses) != len(expected.losses) or set(got.first_grads) != set(expected.first_grads):
        problems.append("the runs differ in steps or in the parameters with a gradient")
    check_first_grads(got, expected, GRAD_RTOL, problems, worst)
    err2 = moved2 = 0.0
    for name, p_ref in expected.final.items():
        err2 += _norm(got.final[name] - p_ref) ** 2
        moved2 += _norm(p_ref - expected.initial[name]) ** 2
    worst["update_rel_all"] = math.sqrt(err2 / moved2)
    err2 = scale2 = 0.0
    for name, g_ref in expected.first_grads.items():
        err2 += _norm(got.first_grads[name] - g_ref) ** 2
        scale2 += _norm(g_ref) ** 2
    worst["grad_rel_all"] = math.sqrt(err2 / scale2)
    check_final_params(got, expected, UPDATE_RTOL, problems, worst)
    return problems, worst


# ---------------------------------------------------------------------------------- the runs

def setup(model_type):
    from hypershard.testing.models import make_batches, tiny_config

    config = tiny_config(model_type)
    return config, make_batches(config.vocab_size, STEPS, batch=4, seq=16)


def train(model, batches, on_backward=None, seen=None):
    """hypershard.testing.models.train's loop (AdamW lr 1e-3, weight decay 0.01, clip 1.0), checking the
    dtypes: fp32 gradients and optimizer state."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step, (ids, labels) in enumerate(batches):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        if on_backward is not None:
            on_backward(step, model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach().item()))
    bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32
           or (p.grad is not None and p.grad.dtype != torch.float32)]
    bad += [f"state {k}" for state in optimizer.state.values() for k, v in state.items()
            if k != "step" and v.dtype != torch.float32]
    if seen is not None:
        seen["not fp32"] = bad
    return losses


def compute_dtype(model, seen):
    """Records the dtype of the first decoder layer's first Linear weight inside its forward."""
    linear = next(m for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear))

    def record(module, args):
        seen.setdefault("compute", module.weight.dtype)
    linear.register_forward_pre_hook(record)


def on_mesh(kind):
    """tp / ep / dp: parallelize (the mesh's axes decide the plans); fully_shard: parallelize,
    then fully_shard on every layer and the root, without a policy."""
    def wrap(model, mesh):
        import hypershard as hs

        model = hs.parallelize(model, mesh)
        if kind == "fully_shard":
            for layer in model.model.layers:
                hs.fully_shard(layer, mesh)
            hs.fully_shard(model, mesh)
        return model
    return wrap


def _stale_copy():
    """Fault: each bf16 copy's VALUE made at the first forward and kept (never refreshed after an
    optimizer step), its gradient still reaching the master. Returns the undo."""
    from hypershard.fsdp.mixed_precision import _OwnedCasts

    cache, original = {}, _OwnedCasts._cast

    def cast(self, master):
        fresh = original(self, master)
        stale = cache.setdefault(id(master), fresh.detach())
        return stale + (fresh - fresh.detach())
    _OwnedCasts._cast = cast
    return lambda: setattr(_OwnedCasts, "_cast", original)


def trains_like_one_device(model_type, kind, fault=None):
    def run(_dummy):
        import hypershard as hs
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import record_training

        config, batches = setup(model_type)
        expected = record_training(hs.mixed_precision(tiny_model(config)), batches, train=train)
        mesh = current_mesh()
        assert hs.is_strict()
        seen: dict = {}
        if fault == "no_master":          # bf16 parameters stepped directly
            model = on_mesh(kind)(tiny_model(config).to(torch.bfloat16), mesh)
        else:
            model = on_mesh(kind)(tiny_model(config), mesh)
            policy = hs.MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16 if fault == "bf16_sums" else torch.float32)
            model = hs.mixed_precision(model, policy)
        undo = _stale_copy() if fault == "stale_copy" else None
        compute_dtype(model, seen)
        try:
            got = record_training(model, batches, train=lambda m, b, on_backward=None: train(m, b, on_backward, seen))
        finally:
            if undo:
                undo()
        problems, worst = check_mixed(got, expected)
        _report(kind, model_type, fault, got, expected, worst, problems)
        if fault:
            assert problems, f"the planted fault {fault} was not caught: {worst}"
            return torch.zeros(1, dtype=torch.float64)
        assert seen["compute"] == torch.bfloat16, seen
        assert not seen["not fp32"], seen["not fp32"]
        for name, p in model.named_parameters():
            assert isinstance(p, hs.DTensor), name
        assert not problems, "\n".join(problems)
        return torch.zeros(1, dtype=torch.float64)
    return run


def _report(kind, model_type, fault, got, expected, worst, problems):
    """With HYPERSHARD_MP_REPORT=<dir>, rank 0 writes the measured deltas there (for docs)."""
    import torch.distributed as dist

    where = os.environ.get("HYPERSHARD_MP_REPORT")
    if where and dist.get_rank() == 0:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, f"{kind}_{model_type}_{fault or 'ok'}.json"), "w") as f:
            json.dump({"losses": got.losses, "expected": expected.losses, "worst": worst,
                       "problems": problems[:8]}, f, indent=1)


EXACT_FP32_SUM = 1.0 + 3 * 2.0 ** -9


def gradient_sums_in_fp32(_dummy):
    """The four dp ranks' weight gradients are 1, 2^-9, 2^-9, 2^-9 (each exact in bf16): summed in
    fp32 they give 1 + 3 * 2^-9 exactly, while every bf16 value near 1 is a multiple of 2^-7, so a
    bf16 sum cannot. Checked through the gradient buckets (parallelize) and through fully_shard's
    reduce-scatter; reduce_dtype=bf16 (the planted fault) must miss it. Also: a group fully
    sharded with another policy is refused."""
    import pytest

    import hypershard as hs

    mesh = current_mesh()
    x = torch.tensor([[1.0], [2.0 ** -9], [2.0 ** -9], [2.0 ** -9]])  # one row per dp rank
    sums = {}
    for kind in ("dp", "fully_shard"):
        for reduce in (torch.float32, torch.bfloat16):
            model = torch.nn.Linear(1, 1, bias=False)
            with torch.no_grad():
                model.weight.fill_(1.0)
            model = hs.parallelize(model, mesh)
            if kind == "fully_shard":
                hs.fully_shard(model, mesh)
            hs.mixed_precision(model, hs.MixedPrecisionPolicy(torch.bfloat16, reduce))
            out = model(x)
            assert out.dtype == torch.bfloat16
            out.sum().backward()
            assert model.weight.dtype == model.weight.grad.dtype == torch.float32
            sums[kind, reduce] = float(model.weight.grad.full_tensor())
    for kind in ("dp", "fully_shard"):
        assert sums[kind, torch.float32] == EXACT_FP32_SUM, sums
        assert sums[kind, torch.bfloat16] != EXACT_FP32_SUM, f"planted bf16 sums not caught: {sums}"
    model = hs.fully_shard(hs.parallelize(torch.nn.Linear(2, 2), mesh), mesh,
                           mp_policy=hs.MixedPrecisionPolicy(torch.float16))
    with pytest.raises(ValueError, match="was fully sharded with .* allowed: fully_shard without mp_policy"):
        hs.mixed_precision(model)
    return torch.zeros(1, dtype=torch.float64)


def _case(name, mesh, distributed):
    return Case(name, lambda _dummy: torch.zeros(1, dtype=torch.float64), [Input((1,), requires_grad=False)],
                mesh, dist_fn=distributed, check_grad=False, rtol=0.0, atol=0.0)


def cases():
    return [
        _case("qwen3_dp2_tp2_bf16", DP2_TP2, trains_like_one_device("qwen3", "tp")),
        _case("qwen3_5_moe_dp2_ep2_bf16", DP2_EP2, trains_like_one_device("qwen3_5_moe_text", "ep")),
        _case("qwen3_dp4_bf16", DP4, trains_like_one_device("qwen3", "dp")),
        _case("qwen3_dp4_fully_shard_bf16", DP4, trains_like_one_device("qwen3", "fully_shard")),
        _case("qwen3_dp2_tp2_planted_stale_copy_is_caught", DP2_TP2,
              trains_like_one_device("qwen3", "tp", fault="stale_copy")),
        _case("qwen3_dp4_planted_no_master_is_caught", DP4, trains_like_one_device("qwen3", "dp", fault="no_master")),
        _case("linear_dp4_gradient_sums_in_fp32", DP4, gradient_sums_in_fp32),
    ]


def test_bf16_mixed_precision_trains_like_one_device():
    assert_all_passed(run_cases(cases(), backend="hypershard", timeout=900))


def test_sft_trains_a_bf16_checkpoint_in_mixed_precision_by_default(tmp_path):
    """python -m hypershard.sft on a checkpoint saved in bf16 (config.json dtype bfloat16): the default
    (--mixed-precision auto) gives losses that differ from the fp32 run's (--mixed-precision none), so
    the bf16 recipe ran, by no more than bf16 rounding (LOSS_ATOL); which choice auto makes for which
    config is unit-tested in tests/python/unit/test_mixed_precision_policy.py."""
    import math
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from hypershard.testing.models import tiny_config, tiny_model
    from hypershard.testing.sft_fixtures import write_fixtures

    fixtures = write_fixtures(tmp_path / "data")
    vocab = len(AutoTokenizer.from_pretrained(str(fixtures["tokenizer"])))
    tiny_model(tiny_config("qwen3", vocab_size=8 * math.ceil(vocab / 8))).to(torch.bfloat16).save_pretrained(
        tmp_path / "bf16")

    def losses(*extra):
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        done = subprocess.run([sys.executable, "-m", "hypershard.sft", "--model", str(tmp_path / "bf16"),
                               "--tokenizer", str(fixtures["tokenizer"]), "--data", str(fixtures["alpaca"]),
                               "--output", str(out), "--mesh", "dp=2", "--batch-size", "4", "--max-steps", "2",
                               "--lr", "1e-3", "--save-steps", "0", "--strict", "--timeout", "300", *extra],
                              capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        return [r["loss"] for r in json.loads((out / "losses.json").read_text())["steps"]]

    auto, fp32 = losses(), losses("--mixed-precision", "none")
    assert auto != fp32 and max(abs(a - b) for a, b in zip(auto, fp32)) <= LOSS_ATOL, (auto, fp32)
