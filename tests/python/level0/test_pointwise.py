"""Level0: pointwise ops with broadcasting and the Partial algebra, forward and backward, on real
multi-process meshes. Every case is compared with one device; rejected Partial combinations must
raise the same error on every rank (and the group keeps working)."""

import torch

from hypershard.testing import Case, Input, assert_all_passed, run_cases, sweep_cases, uniform

MESH2 = ((2,), ("a",))
MESH4 = ((4,), ("a",))
MESH22 = ((2, 2), ("a", "b"))


def placements_must_be(expected, fn):
    """dist_fn that also checks the output's placements (as strings)."""
    def check(*args):
        out = fn(*args)
        got = [repr(p) for p in out.placements]
        if got != expected:
            raise AssertionError(f"placements {got}, expected {expected}")
        return out
    return check


def broadcasting_cases():
    cases = []
    for name, fn in [("add", torch.add), ("mul", torch.mul), ("sub_alpha", lambda a, b: torch.sub(a, b, alpha=0.5)),
                     ("maximum", torch.maximum), ("div", lambda a, b: a / (b.abs() + 1))]:
        cases += sweep_cases(f"bcast_{name}", fn, [Input((4, 6)), Input((6,))], mesh=MESH22)
        cases += sweep_cases(f"bcast41_{name}", fn, [Input((4, 1)), Input((1, 6))], mesh=MESH2)
    # uneven: 5 rows over 4 ranks (one empty shard), 3 columns over 2
    cases += sweep_cases("uneven_add", torch.add, [Input((5, 3)), Input((5, 3))], mesh=MESH4)
    cases += sweep_cases("uneven_mul22", torch.mul, [Input((5, 3)), Input((3,))], mesh=MESH22)
    cases += sweep_cases("where", lambda c, a, b: torch.where(c > 0, a, b),
                         [Input((4, 6), requires_grad=False), Input((4, 6)), Input((6,))], mesh=MESH2)
    return cases


def unary_cases():
    cases = []
    for name, fn in [("exp", torch.exp), ("relu", torch.relu), ("sigmoid", torch.sigmoid), ("tanh", torch.tanh),
                     ("gelu", torch.nn.functional.gelu), ("silu", torch.nn.functional.silu),
                     ("softplus", torch.nn.functional.softplus), ("neg", torch.neg), ("rsqrt", lambda x: (x.abs() + 1).rsqrt()),
                     ("pow", lambda x: x.pow(2)), ("clamp", lambda x: x.clamp(-0.5, 0.5)),
                     ("gt", lambda x: (x > 0).float()), ("cast_double", lambda x: x.double()),
                     ("cast_int", lambda x: (x * 10).to(torch.int64).float())]:
        for placements in (["S(0)"], ["S(1)"], ["R"]):
            cases.append(Case(f"{name}{placements}", fn, [Input((5, 3), placements=placements)], mesh=MESH2))
    return cases


def partial_cases():
    P, R, S0 = ["P"], ["R"], ["S(0)"]
    cases = [
        # linear: P + P stays P(sum); P + R fills R on one rank (no traffic) and stays P
        Case("add_PP", torch.add, [Input((4, 3), placements=P), Input((4, 3), placements=P)], MESH2,
             dist_fn=placements_must_be(["Partial(sum)"], torch.add)),
        Case("add_PR", torch.add, [Input((4, 3), placements=P), Input((4, 3), placements=R)], MESH2,
             dist_fn=placements_must_be(["Partial(sum)"], torch.add)),
        Case("sub_PS", torch.sub, [Input((4, 3), placements=P), Input((4, 3), placements=S0)], MESH2),
        Case("where_PP", lambda c, a, b: torch.where(c > 0, a, b),
             [Input((4, 3), requires_grad=False), Input((4, 3), placements=P), Input((4, 3), placements=P)], MESH2,
             dist_fn=placements_must_be(["Partial(sum)"], lambda c, a, b: torch.where(c > 0, a, b))),
        # bilinear: one Partial operand stays Partial; two are never multiplied as Partials
        Case("mul_PR", torch.mul, [Input((4, 3), placements=P), Input((4, 3), placements=R)], MESH2,
             dist_fn=placements_must_be(["Partial(sum)"], torch.mul)),
        Case("mul_PP", torch.mul, [Input((4, 3), placements=P), Input((4, 3), placements=P)], MESH2),
        Case("mul_PP_4", torch.mul, [Input((4, 3), placements=P), Input((4, 3), placements=P)], MESH4),
        Case("mul_PP_2d", torch.mul, [Input((4, 3), placements=["P", "S(0)"]), Input((4, 3), placements=["P", "R"])], MESH22),
        Case("div_PR", torch.div, [Input((4, 3), placements=P), Input((4, 3), placements=R, init=uniform(1, 2))], MESH2,
             dist_fn=placements_must_be(["Partial(sum)"], torch.div)),
        Case("scale_P", lambda x: x * 3 - x / 2, [Input((4, 3), placements=P)], MESH2),
        Case("neg_Pmax", torch.neg, [Input((4, 3), placements=["P(max)"])], MESH2,
             dist_fn=placements_must_be(["Partial(min)"], torch.neg)),
        Case("exp_Pmax", torch.exp, [Input((4, 3), placements=["P(max)"])], MESH2,
             dist_fn=placements_must_be(["Partial(max)"], torch.exp)),
        Case("relu_Pmin", torch.relu, [Input((4, 3), placements=["P(min)"])], MESH4),
        Case("cast_P", lambda x: x.double(), [Input((4, 3), placements=P)], MESH2,
             dist_fn=placements_must_be(["Partial(sum)"], lambda x: x.double())),
        Case("inplace_add_PR", lambda a, b: a.clone().add_(b), [Input((4, 3), placements=P), Input((4, 3), placements=R)], MESH2),
        Case("inplace_mul_RP", lambda a, b: a.clone().mul_(b), [Input((4, 3), placements=R), Input((4, 3), placements=P)], MESH2),
        # rejected: Partial into non-linear ops, comparisons, integer casts, a Partial denominator
        Case("exp_P_rejected", torch.exp, [Input((4, 3), placements=P)], MESH2,
             expect_error="Partial(sum) input is not supported by this op"),
        Case("relu_P_rejected", torch.relu, [Input((4, 3), placements=P)], MESH2,
             expect_error="aten::relu: argument self (#0)"),
        Case("gt_P_rejected", lambda x: x > 0, [Input((4, 3), placements=P)], MESH2, expect_error="Partial(sum) input"),
        Case("div_RP_rejected", torch.div, [Input((4, 3), placements=R), Input((4, 3), placements=P)], MESH2,
             expect_error="argument other (#1)"),
        Case("cast_int_P_rejected", lambda x: x.long(), [Input((4, 3), placements=P)], MESH2,
             expect_error="Partial(sum) input"),
        Case("where_mask_P_rejected", lambda c, a: torch.where(c, a, a), [Input((4, 3), torch.bool, placements=P, requires_grad=False),
                                                                           Input((4, 3))], MESH2, expect_error="Partial"),
        # a 0-dim sum-Partial (a count or sum tested in model code) is reduced first, in strict mode too:
        # transformers' `mask.sum() == mask.numel()` on a sharded mask
        Case("eq_scalar_of_a_sharded_count", lambda m: m.sum() == m.numel(),
             [Input((5, 3), torch.int64, placements=["S(0)"], init=lambda s, d, g: torch.ones(s, dtype=d))], MESH4),
        Case("gt_P_0dim", lambda x: x.sum() > 0, [Input((5, 3), placements=["S(0)"])], MESH2),
        # integer counts over a sharded dim (eager MoE's `expert_mask.sum(...) > 0`): reduced first too
        Case("gt_integer_counts", lambda m: (m.sum(0) > 0).long() + m.sum(0),
             [Input((5, 3), torch.int64, placements=["S(0)"], init=lambda s, d, g: torch.randint(0, 2, s, generator=g))],
             MESH4, check_grad=False),
        # cat of a Partial and a whole operand (a backward pass does: DeepSeek's q/k rope parts under EP): the
        # whole one is filled, the output Partial; the Partial operand need not come first
        Case("cat_R_P", lambda a, b: torch.cat([a, b], 0), [Input((2, 3), placements=R), Input((4, 3), placements=P)],
             MESH2, dist_fn=placements_must_be(["Partial(sum)"], lambda a, b: torch.cat([a, b], 0))),
        # bitwise ops on sharded integer / bool masks (the target models' mask arithmetic)
        Case("bitwise_and_not_int", lambda a, b: a & ~b,
             [Input((5, 3), torch.int64, placements=["S(0)"], init=lambda s, d, g: torch.randint(0, 8, s, generator=g)),
              Input((5, 3), torch.int64, placements=["R"], init=lambda s, d, g: torch.randint(0, 8, s, generator=g))],
             MESH4, check_grad=False),
        Case("bitwise_and_not_bool", lambda a, b: a & ~b,
             [Input((5, 3), torch.bool, placements=["S(1)"], requires_grad=False),
              Input((5, 3), torch.bool, placements=["S(1)"], requires_grad=False)], MESH2, check_grad=False),
        # a max-Partial the algebra cannot keep is reduced first (exact); the sum-Partial stays
        Case("add_Pmax_Psum", torch.add, [Input((4, 3), placements=["P(max)"]), Input((4, 3), placements=P)], MESH2,
             dist_fn=placements_must_be(["Partial(sum)"], torch.add)),
        Case("mul_Pprod", torch.mul, [Input((4, 3), placements=["P(product)"]), Input((4, 3))], MESH2),
    ]
    return cases


def test_broadcasting_sweeps():
    assert_all_passed(run_cases(broadcasting_cases(), backend="hypershard", timeout=600))


def test_unary_ops():
    assert_all_passed(run_cases(unary_cases(), backend="hypershard", timeout=300))


def test_partial_algebra():
    assert_all_passed(run_cases(partial_cases(), backend="hypershard", timeout=300))
