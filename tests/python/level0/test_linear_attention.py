"""Level 0: the gated delta rule (Qwen3.5's linear attention) with the sequence sharded over a mesh
axis "cp" (hypershard.parallel.linear_attention, docs/context_parallel.md): each rank runs transformers'
torch_chunk_gated_delta_rule on its local block, the recurrent state passed rank to rank (forward)
and its gradient back (backward). Real gloo meshes (2,), (4,) and (2, 2) = (dp, cp), strict mode,
against transformers' function on the whole sequence on one device: the output, the final state
where asked, and the gradients of query, key, value, g, beta (and of the initial state); and the
bytes: one state per rank boundary each way, no collective.

Inputs as Qwen3.5 makes them: g = log-decay < 0, beta in (0, 1), query/key L2-normalised in the
kernel (use_qk_l2norm_in_kernel=True). Natural order (rank r holds the r-th block).

Tolerances:
- Blocks of a multiple of the chunk size (64): every rank's chunks are the reference's chunks, fed
  the same state, so each chunk computes the same products; only the batch a BLAS call sees
  differs (one chunk, or half the batch on dp x cp, instead of all), which may change its
  blocking. float32 defaults (rtol 1e-5, atol 1e-6); measured: bitwise equal on (2,) and (4,),
  1.2e-7 at most on (2, 2).
- Blocks that are not (20 and 21 rows): the chunked rule is exact for ANY split into chunks (the
  padding rows have g = 0, beta = 0, k = v = 0: they leave the state alone), so only rounding
  differs: the in-chunk cumulative decays, the triangular solves and the state products are
  summed over other spans. A gradient element is a sum of up to L = 41 positions' terms of size
  |t| <= a few units, each off by K u |t| with K <= 64 + head dims, u = 2^-24: at most about
  41 * 80 * 6e-8 * 3 = 6e-4 by the bound, in practice a random walk of that (measured: 2.4e-6).
  rtol 1e-5 with atol 3e-5; a lost state moves outputs by 0.1 and more.
Planted fault that must fail: the state not passed (every rank starts from zeros).
"""

from __future__ import annotations

import pytest
import torch

hs = pytest.importorskip("hypershard")
pytest.importorskip("transformers")
from hypershard.testing import Case, Input, current_mesh, run_cases, uniform  # noqa: E402

M2 = ((2,), ("cp",))
M4 = ((4,), ("cp",))
M22 = ((2, 2), ("dp", "cp"))
TIMEOUT = 300
B, H, DK, DV = 2, 2, 8, 8
CHUNK = 64
UNALIGNED = dict(rtol=1e-5, atol=3e-5)


def transformers_rule():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


def without_state_passing(rule):
    """The planted fault: every rank's block starts from zeros (the received state ignored)."""

    def forgetful(*args, initial_state=None, **kwargs):
        return rule(*args, initial_state=None, **kwargs)

    return forgetful


def call(rule, q, k, v, g, beta, initial):
    return rule(q, k, v, g, beta, chunk_size=CHUNK, initial_state=initial, output_final_state=initial is not None,
                use_qk_l2norm_in_kernel=True)


def reference(q, k, v, g, beta, *initial):
    out, final = call(transformers_rule(), q, k, v, g, beta, initial[0] if initial else None)
    return (out, final) if initial else out


def distributed(fault=None):
    def run(q, k, v, g, beta, *initial):
        from hypershard.parallel.linear_attention import context_parallel_chunk_gated_delta_rule

        mesh = current_mesh()
        mesh.load_balanced_sequence_axis = -1  # natural order (one launch's cases share the mesh)
        original = transformers_rule()
        if fault == "state_not_passed":
            original = without_state_passing(original)
        rule = context_parallel_chunk_gated_delta_rule(original, mesh, list(mesh.mesh_dim_names).index("cp"))
        out, final = call(rule, q, k, v, g, beta, initial[0] if initial else None)
        return (out, final) if initial else out

    return run


def without_grad(fn):
    """`fn` under torch.no_grad (inference: no local graph kept, the chain runs forward only)."""

    def run(*args):
        with torch.no_grad():
            return fn(*args)

    return run


def with_traffic_check(dist):
    """dist_fn that also runs forward + backward on fresh leaves with the counters reset and checks
    the bytes: no collective at all (hypershard._C.traffic: nothing gathered), and one state
    [B / dp, H, DK, DV] float32 per rank boundary each way: forward, every rank but the last sends
    its final state up; backward, every rank but the first sends the state's gradient down."""
    from hypershard.parallel import linear_attention

    def run(*args):
        mesh = current_mesh()
        axis = list(mesh.mesh_dim_names).index("cp")
        position, n = mesh.coordinate(axis), mesh.shape[axis]
        dp = mesh.shape[0] if len(mesh.shape) == 2 else 1
        state_bytes = (B // dp) * H * DK * DV * 4
        leaves = [t.detach().requires_grad_() for t in args]
        hs._C.reset_traffic()
        linear_attention.reset_traffic()
        out = dist(*leaves)
        forward = linear_attention.traffic()
        torch.autograd.grad(out, leaves, grad_outputs=out.detach())
        total = linear_attention.traffic()
        collectives = hs._C.traffic()["bytes_sent"]
        expected_forward = state_bytes if position < n - 1 else 0
        expected_total = expected_forward + (state_bytes if position > 0 else 0)
        problems = []
        if collectives:
            problems.append(f"collectives sent {collectives} bytes; the state chain needs none")
        if forward["bytes_sent"] != expected_forward:
            problems.append(f"forward sent {forward}, expected {expected_forward} bytes")
        if total["bytes_sent"] != expected_total:
            problems.append(f"forward + backward sent {total}, expected {expected_total} bytes")
        if problems:
            raise AssertionError(f"cp rank {position}: " + "; ".join(problems))
        return dist(*args)

    return run


def inputs(mesh, L, initial=False):
    two_d = len(mesh[0]) == 2
    seq = ["S(0)", "S(1)"] if two_d else ["S(1)"]
    items = [
        Input((B, L, H, DK), placements=seq),
        Input((B, L, H, DK), placements=seq),
        Input((B, L, H, DV), placements=seq),
        Input((B, L, H), placements=seq, init=uniform(-1.0, -0.01)),  # log-decay
        Input((B, L, H), placements=seq, init=uniform(0.1, 0.9)),  # beta
    ]
    if initial:
        items.append(Input((B, H, DK, DV), placements=["S(0)", "R"] if two_d else ["R"]))
    return items


def cases():
    c = []
    for mesh, tag in ((M2, "m2"), (M4, "m4"), (M22, "m22")):
        n = mesh[0][-1]
        c.append(Case(f"aligned_{tag}", reference, inputs(mesh, CHUNK * n), mesh=mesh,
                      dist_fn=with_traffic_check(distributed())))
    c += [
        Case("unaligned_m2", reference, inputs(M2, 41), mesh=M2, dist_fn=distributed(), **UNALIGNED),
        Case("unaligned_m4", reference, inputs(M4, 83), mesh=M4, dist_fn=distributed(), **UNALIGNED),
        Case("initial_and_final_state_m2", reference, inputs(M2, 2 * CHUNK, initial=True), mesh=M2,
             dist_fn=distributed()),
        Case("initial_and_final_state_m22", reference, inputs(M22, 2 * CHUNK, initial=True), mesh=M22,
             dist_fn=distributed()),
        Case("no_grad_m4", without_grad(reference), inputs(M4, 4 * CHUNK), mesh=M4,
             dist_fn=without_grad(distributed())),
        Case("planted_state_not_passed_m2", reference, inputs(M2, 2 * CHUNK), mesh=M2,
             dist_fn=distributed("state_not_passed")),
        Case("planted_state_not_passed_m4", reference, inputs(M4, 4 * CHUNK), mesh=M4,
             dist_fn=distributed("state_not_passed")),
    ]
    # Bad input, refused alike on every rank before any message.
    c.append(Case("sequence_sharded_unlike_refused_m2", reference,
                  [Input((B, 8, H, DK), placements=["S(1)"]) for _ in range(3)]
                  + [Input((B, 8, H), placements=["R"]) for _ in range(2)],
                  mesh=M2, dist_fn=distributed(), expect_error="sharded alike in every input"))
    c.append(Case("head_dim_sharded_refused_m2", reference,
                  [Input((B, 8, H, DK), placements=["S(3)"]) for _ in range(3)]
                  + [Input((B, 8, H), placements=["R"]) for _ in range(2)],
                  mesh=M2, dist_fn=distributed(), expect_error="allowed: whole head dims"))
    return c


@pytest.fixture(scope="module")
def results():
    return run_cases(cases(), timeout=TIMEOUT)  # the hypershard adapter runs strict


def test_gated_delta_rule_on_cp_equals_one_device(results):
    failures = [r for r in results if not r.passed and not r.name.startswith("planted_")]
    assert not failures and not results.problems, results.summary()


def test_planted_faults_fail(results):
    planted = [r for r in results if r.name.startswith("planted_")]
    assert len(planted) == 2, [r.name for r in planted]
    for r in planted:
        assert not r.passed, f"{r.name} passed: the planted fault went unnoticed"
        assert "elements differ" in r.message, r.describe()  # a wrong value, not a crash
