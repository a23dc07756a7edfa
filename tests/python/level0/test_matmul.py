"""Level 0: the matmul family (mm, bmm, addmm, baddbmm, mv, addmv, dot, and what matmul /
linear / einsum decompose to) on real multi-process gloo meshes, through hypershard.testing.

Every case runs forward AND backward (the gradient of each operand and of the bias) on DTensors
and compares the global values with the same computation on one process. The cases share one
launch per world size: 2 ranks for mesh (2,), 4 ranks for meshes (4,) and (2, 2).

Partial inputs are built with random parts that reduce to the global value (not the "rank 0
holds it, the others zero" fill), so a wrong Partial algebra -- such as the product of two
sum-Partials taken as a sum-Partial -- gives a wrong value. Some cases also assert the output
layout and the number of collectives of the forward op (no gather when a local plan exists).

A case whose single-process op trace reaches an op without a rule yet (another family's) is
skipped with the missing ops named, and runs once those rules land.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.nn.functional as F

hs = pytest.importorskip("hypershard")
from hypershard.testing import Case, Input, NoisyPartialAdapter, layout_problems, run_cases  # noqa: E402

LAUNCH_TIMEOUT_S = 240  # per launch; each takes ~10-40 s on 2 cores


# ---------------------------------------------------------------------------------- cases

def checked(fn, expect=None, fwd_collectives=None, min_fwd_collectives=0):
    """`fn` for the distributed run, asserting the output layout (placements, or (alias,
    partial)) and the number of collectives the forward op ran on this rank."""

    def run(*args, **kwargs):
        hs._C.reset_traffic()
        out = fn(*args, **kwargs)
        ran = hs._C.traffic()["collectives"]
        problems = layout_problems(out, expect)
        if fwd_collectives is not None and ran != fwd_collectives:
            problems.append(f"forward ran {ran} collectives, expected {fwd_collectives}")
        if ran < min_fwd_collectives:
            problems.append(f"forward ran {ran} collectives, expected at least {min_fwd_collectives}")
        if problems:
            raise AssertionError("; ".join(problems))
        return out

    return run


M2 = ((2,), ("x",))
M4 = ((4,), ("x",))
M22 = ((2, 2), ("x", "y"))

mm = torch.mm
bmm = torch.bmm
mv = torch.mv
dot = torch.dot
addmm = torch.addmm
baddbmm = torch.baddbmm
addmv = torch.addmv


def mm_t(x, w):  # x @ w^T with w (out, in): a linear layer without bias
    return torch.mm(x, w.t())


def addmm_t(bias, x, w):
    return torch.addmm(bias, x, w.t())


def addmm_scaled(bias, a, b):
    return torch.addmm(bias, a, b, beta=2.0, alpha=0.5)


def baddbmm_scaled(bias, a, b):
    return torch.baddbmm(bias, a, b, beta=0.5, alpha=2.0)


def einsum_bhsd(q, k):
    return torch.einsum("bhsd,bhtd->bhst", q, k)


def C(name, fn, inputs, mesh=M2, expect=None, fwd_collectives=None, min_fwd_collectives=0, **kw):
    dist_fn = None
    if expect is not None or fwd_collectives is not None or min_fwd_collectives:
        dist_fn = checked(fn, expect, fwd_collectives, min_fwd_collectives)
    return Case(name, fn=fn, inputs=inputs, mesh=mesh, dist_fn=dist_fn, **kw)


def I(shape, placements=None, grad=True, plain=False):  # noqa: E743
    return Input(shape, placements=placements, requires_grad=grad, plain=plain)


R, S0, S1, S2, P = ["R"], ["S(0)"], ["S(1)"], ["S(2)"], ["P(sum)"]
RR, PR = ["R", "R"], ["P(sum)", "R"]


def _cases() -> list:
    c = []
    add = c.append
    # ------------------------------------------------------------------ mesh (2,): mm
    add(C("mm_replicate", mm, [I((4, 6)), I((6, 8))], expect=RR[:1], fwd_collectives=0))
    add(C("mm_m_sharded", mm, [I((4, 6), S0), I((6, 8))], expect=S0, fwd_collectives=0))
    add(C("mm_n_sharded", mm, [I((4, 6)), I((6, 8), S1)], expect=S1, fwd_collectives=0))
    add(C("mm_m_and_n_sharded_same_axis", mm, [I((4, 6), S0), I((6, 8), S1)]))
    add(C("mm_k_both", mm, [I((4, 6), S1), I((6, 8), S0)], expect=P, fwd_collectives=0))
    add(C("mm_k_lhs_only_chunks_rhs", mm, [I((4, 6), S1), I((6, 8))], expect=P, fwd_collectives=0))
    add(C("mm_k_rhs_only_chunks_lhs", mm, [I((4, 6)), I((6, 8), S0)], expect=P, fwd_collectives=0))
    add(C("mm_m_lhs_k_rhs", mm, [I((4, 6), S0), I((6, 8), S0)]))
    add(C("mm_uneven_k5", mm, [I((4, 5), S1), I((5, 3), S0)], expect=P, fwd_collectives=0))
    add(C("mm_uneven_m3", mm, [I((3, 5), S0), I((5, 3))], expect=S0, fwd_collectives=0))
    add(C("mm_empty_shard_m1", mm, [I((1, 5), S0), I((5, 3))], expect=S0, fwd_collectives=0))
    add(C("mm_uneven_n7_k5", mm, [I((3, 5), S1), I((5, 7), S1)]))
    add(C("mm_partial_lhs", mm, [I((4, 6), P), I((6, 8))], expect=P, fwd_collectives=0))
    add(C("mm_partial_rhs", mm, [I((4, 6)), I((6, 8), P)], expect=P, fwd_collectives=0))
    add(C("mm_partial_rhs_lhs_sharded_m", mm, [I((4, 6), S0), I((6, 8), P)]))
    add(C("mm_partial_lhs_rhs_sharded_k", mm, [I((4, 6), P), I((6, 8), S0)]))
    add(C("mm_two_partials_same_axis", mm, [I((4, 6), P), I((6, 8), P)], min_fwd_collectives=1))
    add(C("mm_partial_avg", mm, [I((4, 6), ["P(avg)"]), I((6, 8))], expect=["P(avg)"], fwd_collectives=0))
    add(C("mm_partial_max_is_reduced", mm, [I((4, 6), ["P(max)"]), I((6, 8))], expect=R,
          min_fwd_collectives=1))
    add(C("mm_plain_rhs", mm, [I((4, 6), S0), I((6, 8), plain=True)], expect=S0))
    add(Case("mm_size_mismatch", fn=mm, inputs=[I((4, 6), S0), I((5, 8))], mesh=M2,
             expect_error="hypershard: aten::mm"))
    # linear layers written as mm(x, w.t()) with w (out, in)
    add(C("colwise_mm", mm_t, [I((4, 6)), I((8, 6), S0)], expect=S1, fwd_collectives=0))
    add(C("rowwise_mm", mm_t, [I((4, 6), S1), I((8, 6), S1)], expect=P, fwd_collectives=0))
    add(C("rowwise_mm_uneven_k5", mm_t, [I((3, 5), S1), I((4, 5), S1)], expect=P, fwd_collectives=0))
    # ------------------------------------------------------------------ mesh (2,): addmm
    add(C("addmm_rowwise_bias_filled", addmm_t, [I((4, 8)), I((4, 6), S1), I((8, 6), S1)],
          expect=P, fwd_collectives=0))
    add(C("addmm_colwise_bias1d_sharded", addmm_t, [I((8,), S0, grad=False), I((4, 6)), I((8, 6), S0)],
          expect=S1, fwd_collectives=0))
    add(C("addmm_bias1d_grad", addmm_t, [I((8,), S0), I((4, 6)), I((8, 6), S0)], expect=S1))
    add(C("addmm_bias_broadcast_row", addmm, [I((1, 8), grad=False), I((4, 6), S0), I((6, 8))], expect=S0))
    add(C("addmm_bias_partial_product_filled", addmm, [I((4, 8), P), I((4, 6)), I((6, 8))],
          expect=P, fwd_collectives=0))
    add(C("addmm_bias_and_lhs_partial", addmm, [I((4, 8), P), I((4, 6), P), I((6, 8))],
          expect=P, fwd_collectives=0))
    add(C("addmm_lhs_partial_bias_filled", addmm, [I((4, 8)), I((4, 6), P), I((6, 8))],
          expect=P, fwd_collectives=0))
    add(C("addmm_lhs_partial_alpha_beta", addmm_scaled, [I((4, 8)), I((4, 6), P), I((6, 8))],
          expect=P, fwd_collectives=0))
    add(C("addmm_bias_max_partial_reduced", addmm, [I((4, 8), ["P(max)"]), I((4, 6)), I((6, 8))],
          expect=R, min_fwd_collectives=1))
    add(C("addmm_two_partials_same_axis", addmm, [I((4, 8)), I((4, 6), P), I((6, 8), P)],
          min_fwd_collectives=1))
    add(C("addmm_bias_sharded_m_chunks_operands", addmm, [I((4, 8), S0), I((4, 6)), I((6, 8))],
          expect=S0, fwd_collectives=0))
    # ------------------------------------------------------------------ mesh (2,): bmm / baddbmm
    add(C("bmm_batch", bmm, [I((4, 3, 5), S0), I((4, 5, 2), S0)], expect=S0, fwd_collectives=0))
    add(C("bmm_batch_uneven3", bmm, [I((3, 3, 5), S0), I((3, 5, 2))], expect=S0, fwd_collectives=0))
    add(C("bmm_k", bmm, [I((2, 3, 5), S2), I((2, 5, 4), S1)], expect=P, fwd_collectives=0))
    add(C("bmm_m_vs_batch", bmm, [I((2, 3, 5), S1), I((2, 5, 4), S0)]))
    add(C("bmm_partial_rhs", bmm, [I((2, 3, 5)), I((2, 5, 4), P)], expect=P, fwd_collectives=0))
    add(C("baddbmm_batch", baddbmm, [I((4, 3, 2)), I((4, 3, 5), S0), I((4, 5, 2), S0)],
          expect=S0, fwd_collectives=0))
    add(C("baddbmm_k_bias_filled", baddbmm_scaled, [I((2, 3, 4)), I((2, 3, 5), S2), I((2, 5, 4), S1)],
          expect=P, fwd_collectives=0))
    add(C("baddbmm_broadcast_bias", baddbmm, [I((1, 3, 4), grad=False), I((2, 3, 5), S0), I((2, 5, 4))],
          expect=S0))
    # ------------------------------------------------------------------ mesh (2,): mv / dot / addmv
    add(C("mv_m", mv, [I((5, 4), S0, grad=False), I((4,))], expect=S0, fwd_collectives=0))
    add(C("mv_k", mv, [I((3, 5), S1, grad=False), I((5,), S0)], expect=P, fwd_collectives=0))
    add(C("mv_grads", mv, [I((5, 4), S0), I((4,))], expect=S0))
    add(C("dot_k_uneven", dot, [I((5,), S0), I((5,), S0)], expect=P, fwd_collectives=0))
    add(C("dot_partial", dot, [I((5,), P), I((5,))], expect=P, fwd_collectives=0))
    add(C("addmv_m", addmv, [I((5,), S0), I((5, 4), S0, grad=False), I((4,))], expect=S0, fwd_collectives=0))
    # ------------------------------------------------------------------ mesh (2,): decompositions
    add(C("linear2d_bias_colwise", F.linear, [I((4, 6)), I((8, 6), S0), I((8,), S0, grad=False)], expect=S1))
    add(C("linear3d_rowwise", F.linear, [I((2, 3, 6), S2), I((8, 6), S1), I((8,))]))
    add(C("linear3d_rowwise_bias_nograd", F.linear, [I((2, 3, 6), S2), I((8, 6), S1), I((8,), grad=False)]))
    add(C("linear3d_colwise_nobias", F.linear, [I((2, 3, 6)), I((8, 6), S0)]))
    add(C("matmul_3d_2d_batch", torch.matmul, [I((2, 3, 6), S0), I((6, 4))]))
    add(C("matmul_3d_3d_k", torch.matmul, [I((2, 3, 6), S2), I((2, 6, 4), S1)]))
    # ------------------------------------------------------------------ mesh (4,)
    add(C("m4_mm_empty_shard_m3", mm, [I((3, 5), S0), I((5, 2))], mesh=M4, expect=S0, fwd_collectives=0))
    add(C("m4_mm_uneven_k5", mm, [I((3, 5), S1), I((5, 2), S0)], mesh=M4, expect=P, fwd_collectives=0))
    add(C("m4_rowwise_mm", mm_t, [I((4, 8), S1), I((6, 8), S1)], mesh=M4, expect=P, fwd_collectives=0))
    add(C("m4_addmm_rowwise_k6", addmm_t, [I((3, 4)), I((3, 6), S1), I((4, 6), S1)], mesh=M4,
          expect=P, fwd_collectives=0))
    add(C("m4_two_partials", mm, [I((3, 5), P), I((5, 2), P)], mesh=M4, min_fwd_collectives=1))
    add(C("m4_bmm_batch_uneven", bmm, [I((3, 2, 4), S0), I((3, 4, 2), S0)], mesh=M4, expect=S0))
    # ------------------------------------------------------------------ mesh (2, 2)
    m22 = M22
    add(C("m22_mm_m_x_n_y", mm, [I((4, 6), ["S(0)", "R"]), I((6, 8), ["R", "S(1)"])], mesh=m22,
          expect=["S(0)", "S(1)"], fwd_collectives=0))
    add(C("m22_mm_k_xy", mm, [I((4, 6), ("None", ("x", "y"))), I((6, 8), (("x", "y"), "None"))],
          mesh=m22, expect=["P", "P"], fwd_collectives=0))
    add(C("m22_mm_k_xy_vs_yx", mm, [I((4, 7), ("None", ("x", "y"))), I((7, 3), (("y", "x"), "None"))],
          mesh=m22))
    add(C("m22_mm_partial_x_times_partial_y", mm, [I((4, 6), ["P", "R"]), I((6, 8), ["R", "P"])],
          mesh=m22, expect=["P", "P"], fwd_collectives=0))
    add(C("m22_mm_partials_same_axis", mm, [I((4, 6), ["P", "P"]), I((6, 8), ["P", "R"])], mesh=m22,
          min_fwd_collectives=1))
    add(C("m22_mm_avg_x_with_k_y", mm, [I((4, 6), ["P(avg)", "S(1)"]), I((6, 8), ["R", "S(0)"])],
          mesh=m22, min_fwd_collectives=1))
    add(C("m22_mm_partial_x_m_sharded_y", mm, [I((4, 6), ["P", "S(0)"]), I((6, 8))], mesh=m22,
          expect=["P", "S(0)"], fwd_collectives=0))
    add(C("m22_mm_uneven_m3_n3", mm, [I((3, 5), ["S(0)", "R"]), I((5, 3), ["R", "S(1)"])], mesh=m22,
          expect=["S(0)", "S(1)"], fwd_collectives=0))
    add(C("m22_addmm_dp_x_rowwise_y", addmm_t, [I((4, 8)), I((4, 6), ["S(0)", "S(1)"]), I((8, 6), ["R", "S(1)"])],
          mesh=m22, expect=["S(0)", "P"], fwd_collectives=0))
    add(C("m22_addmm_dp_x_colwise_y", addmm_t, [I((4, 8)), I((4, 6), ["S(0)", "R"]), I((8, 6), ["R", "S(0)"])],
          mesh=m22, expect=["S(0)", "S(1)"], fwd_collectives=0))
    add(C("m22_bmm_batch_xy", bmm, [I((4, 3, 5), ["S(0)", "S(0)"]), I((4, 5, 2), ["S(0)", "S(0)"])],
          mesh=m22, expect=["S(0)", "S(0)"], fwd_collectives=0))
    add(C("m22_bmm_batch_x_m_y", bmm, [I((2, 4, 5), ["S(0)", "S(1)"]), I((2, 5, 3), ["S(0)", "R"])],
          mesh=m22, expect=["S(0)", "S(1)"], fwd_collectives=0))
    add(C("m22_bmm_batch_x_k_y", bmm, [I((2, 3, 5), ["S(0)", "S(2)"]), I((2, 5, 3), ["S(0)", "S(1)"])],
          mesh=m22, expect=["S(0)", "P"], fwd_collectives=0))
    add(C("m22_baddbmm_batch_x_k_y", baddbmm, [I((2, 3, 3)), I((2, 3, 5), ["S(0)", "S(2)"]),
                                              I((2, 5, 3), ["S(0)", "S(1)"])], mesh=m22,
          expect=["S(0)", "P"], fwd_collectives=0))
    # batch and head dims sharded: matmul / einsum on 4-D inputs (view + bmm)
    add(C("m22_matmul_4d_batch_x_heads_y", torch.matmul,
          [I((2, 2, 3, 4), ["S(0)", "S(1)"]), I((2, 2, 4, 5), ["S(0)", "S(1)"])], mesh=m22))
    add(C("m22_einsum_bhsd_batch_x_heads_y", einsum_bhsd,
          [I((2, 2, 3, 4), ["S(0)", "S(1)"]), I((2, 2, 5, 4), ["S(0)", "S(1)"])], mesh=m22))
    add(C("m22_linear3d_dp_x_colwise_y_bias_nograd", F.linear,
          [I((2, 3, 6), ["S(0)", "R"]), I((8, 6), ["R", "S(0)"]), I((8,), ["R", "S(0)"], grad=False)], mesh=m22))
    add(C("m22_linear3d_dp_x_colwise_y", F.linear,
          [I((2, 3, 6), ["S(0)", "R"]), I((8, 6), ["R", "S(0)"]), I((8,), ["R", "S(0)"])], mesh=m22))
    # outer product + self, the batch-summed product + self, the conjugating dot
    add(C("addr_m_sharded", lambda b, u, v: torch.addr(b, u, v, beta=0.5, alpha=2.0), [I((5, 4)), I((5,), S0), I((4,))],
          expect=S0, fwd_collectives=0))
    add(C("addr_bias_sharded_n", torch.addr, [I((5, 4), S1), I((5,)), I((4,), S0)], expect=S1, fwd_collectives=0))
    add(C("addbmm_batch_sharded", torch.addbmm, [I((3, 4)), I((5, 3, 6), S0), I((5, 6, 4), S0)]))
    add(C("addbmm_m_sharded", torch.addbmm, [I((3, 4), S0), I((5, 3, 6), S1), I((5, 6, 4))], expect=S0,
          fwd_collectives=0))
    add(C("vdot_k_sharded", torch.vdot, [I((7,), S0), I((7,), S0)], expect=P, fwd_collectives=0))
    return c


CASES = _cases()


# ---------------------------------------------------------------------------------- rule coverage

def _op_name(func) -> str:
    s = func._schema
    return s.name + ("." + s.overload_name if s.overload_name else "")


def ops_reached(case: Case) -> set:
    """The ATen ops the single-process forward + backward of `case` reaches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(_op_name(func))
            return func(*args, **(kwargs or {}))

    leaves = [torch.randn(i.shape).requires_grad_(i.wants_grad) for i in case.inputs]
    try:
        with Record() as rec:
            out = case.fn(*leaves)
            out.backward(torch.ones_like(out))
    except RuntimeError:
        return set()  # an error case: it fails before any rule is needed
    return rec.ops - {"aten::ones_like"}


@functools.lru_cache(maxsize=None)
def missing() -> dict:
    """{case name: the ops it reaches without a rule}. Computed on first use, not at import: a
    backward starts the autograd engine's device threads, which initialises the CUDA driver in a
    process with a CUDA torch, and the GPU check forks its ranks from the process that imports
    this module (a forked rank then fails with "CUDA error: initialization error")."""
    rules = set(hs._C.rule_names())
    return {case.name: sorted(ops_reached(case) - rules) for case in CASES}


@pytest.fixture(scope="module")
def results():
    runnable = [case for case in CASES if not missing()[case.name]]
    start = time.perf_counter()
    result = run_cases(runnable, backend=NoisyPartialAdapter(), timeout=LAUNCH_TIMEOUT_S)
    print(f"\ntest_matmul: {len(runnable)} cases in {time.perf_counter() - start:.1f} s "
          f"({len(result.launches)} launches)")
    return result


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matmul(case: Case, results):
    if missing()[case.name]:
        pytest.skip("needs rules of other families: " + ", ".join(missing()[case.name]))
    results.check(case.name)
