"""Level0: the list-op family (csrc/ops/foreach.cpp) and what torch.optim, clip_grad_norm_ and
state_dict loading reach, on real multi-process meshes, compared with one device.

- _foreach_* ops: lists whose elements have different layouts (Replicate, Shard(0), Shard(1),
  uneven and empty shards), zipped with partners in other layouts, in place and functional,
  forward and gradients; the Partial algebra per element; error paths.
- _fused_adamw_ with grads and states in other layouts than their parameter (written back).
- AdamW / Adam (foreach False/True, fused) and SGD (momentum, weight decay, nesterov) for 5
  steps on a small model with parameters of mixed layouts on (2,), (4,) and (2, 2) meshes:
  the parameters after every step equal one device (rtol 1e-5).
- clip_grad_norm_ (foreach True/False, norms 2, 1, inf): the GLOBAL total norm and the same
  scaled gradients as one device.
- The plan cache stays bounded over 20 steps with a changing learning rate.
- state_dict: gathered values equal one device; load_state_dict from plain full tensors
  restores the shards (and keeps the layouts).
"""

import io

import torch

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, in_distributed_run, replicated, run_cases, uniform

MESH2 = ((2,), ("dp",))
MESH4 = ((4,), ("dp",))
MESH22 = ((2, 2), ("dp", "tp"))
MESHES = (MESH2, MESH4, MESH22)

# ------------------------------------------------------------------------------ list operands

# Per mesh, three list elements (shapes with uneven and, on 4 ranks, empty shards), each with
# three layouts: for list a, its partner b, and c.
SHAPES = ((5, 3), (4,), (3, 5))
LAYOUTS = {
    MESH2: ((["S(0)"], ["R"], ["S(1)"]), (["R"], ["S(0)"], ["S(0)"]), (["S(1)"], ["S(1)"], ["R"])),
    MESH4: ((["S(0)"], ["R"], ["S(1)"]), (["R"], ["S(0)"], ["S(0)"]), (["S(1)"], ["S(0)"], ["R"])),
    MESH22: ((["S(0)", "S(1)"], ["R", "S(0)"], ["S(1)", "R"]), (["R", "R"], ["S(0)", "R"], ["R", "S(0)"]),
             (["S(1)", "S(0)"], ["S(1)", "S(1)"], ["R", "R"])),
}


def list_inputs(mesh, lists=3, init=None):
    """Inputs a0 a1 a2 b0 b1 b2 c0 c1 c2 (list-major)."""
    return [Input(SHAPES[i], placements=LAYOUTS[mesh][i][j], init=init) for j in range(lists) for i in range(3)]


def split(flat, lists):
    n = len(flat) // lists
    return [list(flat[j * n:(j + 1) * n]) for j in range(lists)]


def pos(xs):
    return [x.abs() + 1 for x in xs]


def clones(xs):
    return [x.clone() for x in xs]


def functional(fn, lists):
    return lambda *flat: fn(*split(flat, lists))


def inplace(fn, lists):
    """Applies fn in place to clones of the first list (so gradients still flow to the inputs)."""
    def run(*flat):
        a, *rest = split(flat, lists)
        xs = clones(a)
        fn(xs, *rest)
        return xs
    return run


F = torch
FUNCTIONAL = {  # name: (fn over lists, number of lists)
    "add_list": (lambda a, b: F._foreach_add(a, b, alpha=0.5), 2),
    "add_scalar": (lambda a: F._foreach_add(a, 1.5), 1),
    "add_scalarlist": (lambda a: F._foreach_add(a, [1.0, -2.0, 0.5]), 1),
    "sub_list": (lambda a, b: F._foreach_sub(a, b), 2),
    "mul_list": (lambda a, b: F._foreach_mul(a, b), 2),
    "mul_scalarlist": (lambda a: F._foreach_mul(a, [0.5, 2.0, -1.0]), 1),
    "div_list": (lambda a, b: F._foreach_div(a, pos(b)), 2),
    "div_scalar": (lambda a: F._foreach_div(a, 3.0), 1),
    "lerp_scalar": (lambda a, b: F._foreach_lerp(a, b, 0.3), 2),
    "lerp_list": (lambda a, b, c: F._foreach_lerp(a, b, [x.sigmoid() for x in c]), 3),
    "addcmul_scalarlist": (lambda a, b, c: F._foreach_addcmul(a, b, c, [0.1, 0.2, 0.3]), 3),
    "addcdiv_scalar": (lambda a, b, c: F._foreach_addcdiv(a, b, pos(c), 0.5), 3),
    "addcdiv_tensor": (lambda a, b, c: F._foreach_addcdiv(a, b, pos(c), torch.tensor([0.1, -0.2, 0.3])), 3),
    "maximum_list": (lambda a, b: F._foreach_maximum(a, b), 2),
    "minimum_scalar": (lambda a: F._foreach_minimum(a, 0.2), 1),
    "clamp_min_scalarlist": (lambda a: F._foreach_clamp_min(a, [0.0, -0.5, 0.1]), 1),
    "sqrt": (lambda a: F._foreach_sqrt(pos(a)), 1),
    "rsqrt": (lambda a: F._foreach_rsqrt(pos(a)), 1),
    "reciprocal": (lambda a: F._foreach_reciprocal(pos(a)), 1),
    "neg": (lambda a: F._foreach_neg(a), 1),
    "exp": (lambda a: F._foreach_exp(a), 1),
    "abs": (lambda a: F._foreach_abs(a), 1),
    "pow_scalar": (lambda a: F._foreach_pow(a, 2.0), 1),
    "pow_list": (lambda a, b: F._foreach_pow(pos(a), b), 2),
    "pow_scalar_and_tensor": (lambda a: F._foreach_pow(2.0, a), 1),
    "copy": (lambda a, b: torch.ops.aten._foreach_copy(a, b), 2),
}
INPLACE = {
    "add_": (lambda xs, b: F._foreach_add_(xs, b, alpha=2), 2),
    "add_scalar_": (lambda xs: F._foreach_add_(xs, 0.25), 1),
    "sub_": (lambda xs, b: F._foreach_sub_(xs, b), 2),
    "mul_": (lambda xs, b: F._foreach_mul_(xs, b), 2),
    "mul_scalar_": (lambda xs: F._foreach_mul_(xs, 0.9), 1),
    "div_scalarlist_": (lambda xs: F._foreach_div_(xs, [2.0, 3.0, 4.0]), 1),
    "div_list_": (lambda xs, b: F._foreach_div_(xs, pos(b)), 2),
    "lerp_": (lambda xs, b: F._foreach_lerp_(xs, b, 0.1), 2),
    "addcmul_": (lambda xs, b, c: F._foreach_addcmul_(xs, b, c, 0.05), 3),
    "addcdiv_scalarlist_": (lambda xs, b, c: F._foreach_addcdiv_(xs, b, pos(c), [-0.1, 0.2, -0.3]), 3),
    "addcdiv_tensor_": (lambda xs, b, c: F._foreach_addcdiv_(xs, b, pos(c), torch.tensor([0.1, 0.2, 0.3])), 3),
    "maximum_": (lambda xs, b: F._foreach_maximum_(xs, b), 2),
    "clamp_max_": (lambda xs: F._foreach_clamp_max_(xs, 0.3), 1),
    "copy_": (lambda xs, b: F._foreach_copy_(xs, b), 2),
    "zero_": (lambda xs: F._foreach_zero_(xs), 1),
    "neg_": (lambda xs: F._foreach_neg_(xs), 1),
    "sign_": (lambda xs: F._foreach_sign_(xs), 1),
    "pow_": (lambda xs: F._foreach_pow_(xs, 3.0), 1),
    "reciprocal_": (lambda xs: F._foreach_reciprocal_([x.abs_().add_(1) for x in xs]), 1),
}


# torch has no derivative for these (the reference could not compare gradients)
NO_GRAD = {"addcdiv_tensor", "addcdiv_tensor_", "copy", "copy_"}


def scale_by(xs, s):
    """_foreach_mul_ with a 0-dim tensor (clip_grad_norm_'s coefficient)."""
    torch._foreach_mul_(xs, s)
    return xs


def foreach_cases():
    cases = []
    for mesh in MESHES:
        tag = f"{mesh[0]}"
        for name, (fn, lists) in FUNCTIONAL.items():
            cases.append(Case(f"{name}{tag}", functional(fn, lists), list_inputs(mesh, lists), mesh,
                              check_grad=name not in NO_GRAD))
        for name, (fn, lists) in INPLACE.items():
            cases.append(Case(f"{name}{tag}", inplace(fn, lists), list_inputs(mesh, lists), mesh,
                              check_grad=name not in NO_GRAD))
        # a 0-dim DTensor (Replicate) and a plain 0-dim tensor shared by every element
        cases.append(Case(f"mul_tensor_{tag}", lambda *f: scale_by(clones(f[:3]), f[3]),
                          list_inputs(mesh, 1) + [Input((), placements=["R"] * len(mesh[0]))], mesh))
        cases.append(Case(f"mul_plain_tensor_{tag}", lambda *f: scale_by(clones(f), torch.tensor(0.7)),
                          list_inputs(mesh, 1), mesh))
        cases.append(Case(f"div_tensor_{tag}", lambda *f: F._foreach_div(list(f[:3]), f[3]),
                          list_inputs(mesh, 1) + [Input((), placements=["R"] * len(mesh[0]), init=uniform(1, 2),
                                                        requires_grad=False)],
                          mesh))
    # an empty list element shape and a single-element list
    cases.append(Case("add_empty", lambda a, b: F._foreach_add([a], [b]),
                      [Input((0, 3), placements=["S(0)"]), Input((0, 3), placements=["R"])], MESH2))
    return cases


def inference(fn, *args):
    with torch.inference_mode():
        return fn(*args)


def partial_cases():
    P, R, S0 = ["P"], ["R"], ["S(0)"]
    def two(p0, p1, grad=None):
        return [Input((4, 3), placements=p0, requires_grad=grad), Input((5,), placements=p1, requires_grad=grad)]

    cases = [
        # linear: P + P stays P, P + R fills R (no traffic), R += P reduces P into self's layout
        Case("P_add_list", lambda a0, a1, b0, b1: F._foreach_add([a0, a1], [b0, b1]),
             two(P, R) + two(P, P), MESH2),
        Case("P_add_inplace_R_self", lambda a0, a1, b0, b1: inplace(lambda xs, b: F._foreach_add_(xs, b), 2)(a0, a1, b0, b1),
             two(R, S0) + two(P, P), MESH2),
        Case("P_lerp_inplace", lambda a0, a1, b0, b1: inplace(lambda xs, b: F._foreach_lerp_(xs, b, 0.2), 2)(a0, a1, b0, b1),
             two(P, P) + two(R, S0), MESH4),
        # bilinear: one Partial factor stays Partial; two are never multiplied as Partials
        Case("P_mul_list", lambda a0, a1, b0, b1: F._foreach_mul([a0, a1], [b0, b1]),
             two(P, P) + two(R, P), MESH2),
        Case("P_mul_scalar_", inplace(lambda xs: F._foreach_mul_(xs, 0.5), 1), two(["P", "R"], ["P", "S(0)"]), MESH22),
        Case("P_div_tensor", lambda a0, a1, s: F._foreach_div([a0, a1], s),
             two(P, R) + [Input((), placements=R, init=uniform(1, 2), requires_grad=False)], MESH2),
        Case("P_zero_", inplace(lambda xs: F._foreach_zero_(xs), 1), two(P, R), MESH2),
        Case("P_neg_max", lambda a0, a1: F._foreach_neg([a0, a1]), two(["P(max)"], R), MESH2, check_grad=False),
    ]
    # errors: every rank raises the same house error before any collective
    err = [
        ("E_addcmul_partial", lambda a0, a1, b0, b1: F._foreach_addcmul_(clones([a0, a1]), [b0, b1], [b0, b1]),
         two(R, R) + two(R, P), "aten::_foreach_addcmul_.Scalar: argument tensor1[1] (#1)"),
        ("E_sqrt_partial", lambda a0, a1: F._foreach_sqrt([a0, a1]), two(R, P),
         "aten::_foreach_sqrt: argument self[1] (#0)"),
        ("E_inplace_max_partial", lambda a0, a1, b0, b1: F._foreach_add_([a0, a1], [b0, b1]),
         two(["P(max)"], R, grad=False) + two(R, R), "an in-place list op keeps every element's layout"),
        # (torch's autograd kernel checks the lengths first; inference mode skips it)
        ("E_length", lambda a0, a1, b0, b1: inference(F._foreach_add, [a0, a1], [b0]), two(S0, R) + two(R, R),
         "the lists self (2 tensors) and other (1 tensors) must have the same length"),
        ("E_shared_conflict", lambda a0, a1, s: F._foreach_mul([a0, a1], s),
         two(R, P) + [Input((), placements=P)], "the list elements need it in different layouts"),
    ]
    for name, fn, inputs, message in err:
        cases.append(Case(name, fn, inputs, MESH2, expect_error=message))
    # a plain element written with DTensor data
    cases.append(Case("E_plain_self", lambda a, b: F._foreach_add_([torch.zeros(4, 3)], [b]),
                      [Input((4, 3), placements=R), Input((4, 3), placements=S0)], MESH2,
                      expect_error="a plain tensor cannot take DTensor data in place"))
    return cases


# ------------------------------------------------------------------------------ fused kernels

def fused_adamw_direct(p, g, m, v, grad_scale):
    """One _fused_adamw_ call whose grads and states are in other layouts than the params;
    returns every list after the call (grads are unscaled in place when grad_scale is given)."""
    ps, gs, ms, vs = [p.detach().clone()], [g.detach().clone()], [m.detach().clone()], [v.detach().clone()]
    steps = [torch.tensor(3.0)]
    scale = torch.tensor(2.0) if grad_scale else None
    found = torch.tensor(0.0) if grad_scale else None
    torch._fused_adamw_(ps, gs, ms, vs, [], steps, lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8,
                        amsgrad=False, maximize=False, grad_scale=scale, found_inf=found)
    return ps + gs + ms + vs


def fused_cases():
    cases = []
    for mesh, p, g, m, v in ((MESH2, ["S(0)"], ["P"], ["R"], ["S(1)"]),
                             (MESH4, ["S(1)"], ["S(0)"], ["P"], ["S(1)"]),
                             (MESH22, ["S(0)", "S(1)"], ["P", "R"], ["R", "S(0)"], ["S(1)", "P"])):
        for grad_scale in (False, True):
            cases.append(Case(f"fused_adamw{mesh[0]}{p}{g}{'_scaled' if grad_scale else ''}",
                              lambda *a, gs=grad_scale: fused_adamw_direct(*a, gs),
                              [Input((5, 3), placements=x, init=uniform(0.1, 1) if x is v else None)
                               for x in (p, g, m, v)], mesh, check_grad=False))
    cases.append(Case("E_fused_partial_param", lambda p, g, m, v: fused_adamw_direct(p, g, m, v, False),
                      [Input((5, 3), placements=x) for x in (["P"], ["R"], ["R"], ["R"])], MESH2,
                      expect_error="aten::_fused_adamw_: argument self[0] (#0) "))
    return cases


# ------------------------------------------------------------------------------ optimizers



def model_loss(x, w1, b1, w2, b2, e):
    hidden = torch.tanh(x @ w1.t() + b1)
    out = replicated(hidden @ w2.t() + b2)
    return out.pow(2).mean() + replicated((e * e).sum()) * 0.1


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_foreach_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, foreach=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.05, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, weight_decay=0.1, foreach=False),
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, weight_decay=0.1, foreach=True),
    "sgd_foreach_nesterov": lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, nesterov=True, foreach=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, weight_decay=0.1, fused=True),
}

# (x, w1, b1, w2, b2, e) layouts per mesh: Replicate, Shard(0), Shard(1), uneven (w1 has 7 rows,
# e has 5 rows: an empty shard on 4 ranks)
MODEL_LAYOUTS = {
    MESH2: (["R"], ["S(0)"], ["S(0)"], ["S(1)"], ["R"], ["S(0)"]),
    MESH4: (["S(0)"], ["R"], ["S(0)"], ["R"], ["R"], ["S(0)"]),
    MESH22: (["S(0)", "R"], ["R", "S(0)"], ["R", "S(0)"], ["R", "S(1)"], ["R", "R"], ["S(1)", "S(0)"]),
}
MODEL_SHAPES = ((6, 4), (7, 4), (7,), (3, 7), (3,), (5, 3))


def model_inputs(mesh):
    return [Input(shape, placements=lay, requires_grad=i > 0)
            for i, (shape, lay) in enumerate(zip(MODEL_SHAPES, MODEL_LAYOUTS[mesh]))]


def train(make_optimizer, steps, x, *params, zero_grad_kwargs=None):
    for p in params:
        p.grad = None
    opt = make_optimizer(list(params))
    snapshots, losses = [], []
    for _ in range(steps):
        opt.zero_grad(**(zero_grad_kwargs or {}))
        loss = model_loss(x, *params)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        snapshots += [p.detach().clone() for p in params]
        if in_distributed_run():
            for p in params:
                assert p.grad.placements == p.placements, (p.grad.placements, p.placements)
    return [torch.stack(losses)] + snapshots


def optimizer_cases():
    cases = []
    for mesh in MESHES:
        for name, make in OPTIMIZERS.items():
            cases.append(Case(f"{name}{mesh[0]}", lambda *a, make=make: train(make, 5, *a), model_inputs(mesh), mesh,
                              check_grad=False, rtol=1e-5, atol=1e-6))
    # zero_grad(set_to_none=False): _foreach_zero_ (foreach) and detach_/zero_ (single tensor)
    for foreach in (False, True):
        make = OPTIMIZERS["adamw_foreach" if foreach else "adamw"]
        cases.append(Case(f"zero_grad_keep{foreach}", lambda *a, make=make: train(make, 3, *a, zero_grad_kwargs={"set_to_none": False}),
                          model_inputs(MESH22), MESH22, check_grad=False))
    return cases


# ------------------------------------------------------------------------------ clip_grad_norm_

def clip(norm_type, foreach, x, *params):
    model_loss(x, *params).backward()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm=0.05, norm_type=norm_type, foreach=foreach)
    if in_distributed_run():
        assert isinstance(total, hs.DTensor) and all(p == hs.Replicate() for p in total.placements), total.placements
    return [total] + [p.grad.clone() for p in params]


def clip_cases():
    cases = []
    for mesh in (MESH2, MESH22):
        for foreach in (False, True):
            for norm_type in (2.0, 1.0, float("inf")):
                cases.append(Case(f"clip{mesh[0]}_{foreach}_{norm_type}",
                                  lambda *a, n=norm_type, f=foreach: clip(n, f, *a), model_inputs(mesh), mesh,
                                  check_grad=False))
    return cases


# ------------------------------------------------------------------------------ plan cache

def bounded_cache(make_optimizer, x, *params):
    """20 steps with a learning rate that changes every step: no new plans after step 2."""
    opt = make_optimizer(list(params))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))
    entries = []
    for _ in range(20):
        opt.zero_grad()
        model_loss(x, *params).backward()
        opt.step()
        schedule.step()
        if in_distributed_run():
            entries.append(hs._C.dispatch_stats()["cache_entries"])
    if in_distributed_run():
        assert entries[1] > 0 and entries[-1] == entries[1], f"cached plans per step: {entries}"
    return [p.detach() for p in params]


def cache_cases():
    return [Case(f"cache_bounded_{name}", lambda *a, make=OPTIMIZERS[name]: bounded_cache(make, *a),
                 model_inputs(MESH22), MESH22, check_grad=False)
            for name in ("adamw", "adamw_foreach", "adamw_fused", "sgd_foreach")]


# ------------------------------------------------------------------------------ state_dict

class TwoParams(torch.nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.w = torch.nn.Parameter(w.detach())
        self.b = torch.nn.Parameter(b.detach())


def state_dict_round_trip(w, b):
    module = TwoParams(w, b)
    before = module.state_dict()
    saved = io.BytesIO()
    torch.save(before, saved)       # global values, as plain tensors
    values = [v.clone() for v in before.values()]
    placements = [p.placements for p in module.parameters()] if in_distributed_run() else None
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(-3).add_(1)
    saved.seek(0)
    plain = torch.load(saved)
    assert not any(isinstance(v, hs.DTensor) for v in plain.values())
    module.load_state_dict(plain)  # param.copy_(plain full tensor): each rank takes its shard
    restored = [p.detach().clone() for p in module.parameters()]
    # load other plain values (built identically on every rank)
    gen = torch.Generator().manual_seed(7)
    other = {"w": torch.randn(w.shape, generator=gen), "b": torch.randn(b.shape, generator=gen)}
    module.load_state_dict(other)
    if in_distributed_run():
        assert [p.placements for p in module.parameters()] == placements
        assert all(isinstance(p, hs.DTensor) for p in module.parameters())
    return values + restored + [p.detach().clone() for p in module.parameters()]


def state_dict_cases():
    cases = []
    for mesh, wp, bp in ((MESH2, ["S(0)"], ["R"]), (MESH4, ["S(1)"], ["S(0)"]), (MESH22, ["S(0)", "S(1)"], ["R", "S(0)"])):
        cases.append(Case(f"state_dict{mesh[0]}", state_dict_round_trip,
                          [Input((5, 3), placements=wp), Input((5,), placements=bp)], mesh, check_grad=False))
    return cases


# ------------------------------------------------------------------------------ conversions

def conversions(x, y):
    out = [torch.zeros_like(x), torch.ones_like(x), torch.full_like(x, 2.5), torch.empty_like(x).zero_(),
           x.new_zeros((2, 3)), x.new_ones((7,)), x.new_full((3, 2), 4.0),
           x.double(), x.to(torch.float64).float(), y.type_as(x), (x > 0).float(), x.bool().to(torch.int64),
           x.cpu() * 1, x.to("cpu") * 1]
    z = torch.empty_like(x)
    z.fill_(3.0)
    z.copy_(torch.arange(x.numel(), dtype=x.dtype).reshape(x.shape))  # from a plain full tensor
    out.append(z)
    d = x * 2
    d.detach_()
    out.append(d)
    out.append(torch.tensor(x.sum().item()))
    out.append(torch.tensor(x.tolist()))
    if in_distributed_run():
        assert all(isinstance(t, hs.DTensor) for t in out[:-2])
        assert out[0].placements == x.placements and out[7].placements == x.placements
        # new_*: sizes are global; a dim of x's rank and extent keeps its shards (new_zeros((2, 3)):
        # dim 1), every other dim is whole
        assert out[4].placements == tuple(p if p == hs.Shard(1) else hs.Replicate() for p in x.placements)
        assert out[5].placements == out[6].placements == tuple(hs.Replicate() for _ in x.placements)
        assert z.placements == x.placements and not d.requires_grad
    return out


def conversion_cases():
    return [Case(f"conversions{mesh[0]}", conversions,
                 [Input((5, 3), placements=xp), Input((5, 3), dtype=torch.float64, placements=xp)], mesh,
                 check_grad=False)
            for mesh, xp in ((MESH2, ["S(0)"]), (MESH4, ["S(1)"]), (MESH22, ["S(1)", "S(0)"]))]


# ------------------------------------------------------------------------------ tests

def test_foreach_ops():
    assert_all_passed(run_cases(foreach_cases() + partial_cases() + fused_cases(), backend="hypershard", timeout=600))


def test_optimizers():
    assert_all_passed(run_cases(optimizer_cases(), backend="hypershard", timeout=600))


def test_clip_cache_state_dict_conversions():
    cases = clip_cases() + cache_cases() + state_dict_cases() + conversion_cases()
    assert_all_passed(run_cases(cases, backend="hypershard", timeout=600))


def test_rules_registered():
    names = set(hs._C.rule_names())
    traced = {  # what torch.optim (foreach/fused), clip_grad_norm_ and zero_grad reach
        "aten::_foreach_add_.Scalar", "aten::_foreach_add_.List", "aten::_foreach_add.List", "aten::_foreach_mul_.Scalar",
        "aten::_foreach_mul_.Tensor", "aten::_foreach_lerp_.Scalar", "aten::_foreach_addcmul_.Scalar",
        "aten::_foreach_sqrt", "aten::_foreach_div_.ScalarList", "aten::_foreach_addcdiv_.ScalarList",
        "aten::_foreach_maximum_.List", "aten::_foreach_zero_", "aten::_foreach_norm.Scalar", "aten::_fused_adamw_",
        "aten::_fused_adam_", "aten::_fused_sgd_", "aten::detach_", "aten::_to_copy", "aten::_local_scalar_dense",
    }
    assert traced <= names, sorted(traced - names)
