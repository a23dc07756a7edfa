"""Level0: the typed fast path (csrc/runtime/fast_path.cpp) against the boxed fallback.

Every case runs its function three times on the distributed side: once with the fast path off
(every op boxed), once to warm the fast path's per-thread plan slots, and once more, which must
run at least one op on the fast path. The last result must equal the boxed one bit for bit --
values, placements, global strides and storage offset (the wrappers' view geometry), autograd
history -- and, as in every Level0 case, equal one device's result, gradients included.
A last case checks that the dispatch statistics count fast calls exactly once.
"""

import torch
import torch.nn.functional as F

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, in_distributed_run, replicated, run_cases

MESH4 = ((4,), ("a",))
MESH22 = ((2, 2), ("a", "b"))


def _fast_calls() -> int:
    return hs._C.dispatch_stats()["fast_calls"]


def _same(fast, boxed, what: str) -> None:
    if isinstance(fast, (tuple, list)):
        for i, (f, b) in enumerate(zip(fast, boxed)):
            _same(f, b, f"{what}[{i}]")
        return
    assert isinstance(fast, hs.DTensor) and isinstance(boxed, hs.DTensor), what
    assert fast.placements == boxed.placements, (what, fast.placements, boxed.placements)
    assert fast.shape == boxed.shape and fast.dtype == boxed.dtype, (what, fast.shape, boxed.shape)
    assert fast.stride() == boxed.stride(), (what, "global strides", fast.stride(), boxed.stride())
    assert fast.storage_offset() == boxed.storage_offset(), (what, fast.storage_offset(), boxed.storage_offset())
    assert fast.requires_grad == boxed.requires_grad, what
    assert type(fast.grad_fn) is type(boxed.grad_fn), (what, fast.grad_fn, boxed.grad_fn)
    assert torch.equal(fast.to_local(), boxed.to_local()), (what, "local values differ")


def both_paths(fn):
    """The case function: fn on one device; distributed, fn boxed and fast, compared."""

    def run(*inputs):
        if not in_distributed_run():
            return fn(*inputs)
        hs._C.set_fast_path(False)
        try:
            boxed = fn(*inputs)
        finally:
            hs._C.set_fast_path(True)
        fn(*inputs)  # fills the fast path's plan slots (a slot's first call is boxed)
        before = _fast_calls()
        fast = fn(*inputs)
        assert _fast_calls() > before, "no op of this case ran on the fast path"
        _same(fast, boxed, fn.__name__)
        return fast

    run.__name__ = fn.__name__
    return run


# ------------------------------------------------------------------ the functions


def pointwise(a, b):
    return (a + b, a - b, a * b, a / (b.abs() + 1), a * 2.5, -a, a.exp(), (a.abs() + 1).rsqrt(),
            a.sigmoid(), F.silu(a), a.tanh(), a.relu(), a ** 2, (a.abs() + 1).reciprocal(),
            torch.where(a > b, a, b), a.clone(), a.double())


def inplace(a, b):
    c = a * 1
    c.add_(b).mul_(b).sub_(a, alpha=0.5).div_(b.abs() + 1).mul_(1.5)
    d = a * 1
    d.addcmul_(a, b, value=0.3).addcdiv_(a, b.abs() + 1, value=0.2).lerp_(b, 0.25)
    e = a * 1
    e.copy_(b)
    f = a * 1
    f.zero_()
    f.fill_(2.0)
    return c, d, e + f


def views(a):
    return (a.t() * 1, a.transpose(0, 1).contiguous(), a.unsqueeze(1).squeeze(1) * 1, a.unsqueeze(0).permute(2, 0, 1) * 1,
            a[:, :1].expand(-1, 8) * 1, a[3] * 1, a[:, 3] * 1, a[:, 2:6] * 1, torch.ops.aten.alias(a) * 1)


def row_views(a):
    """Views that merge or split dim 1: for layouts that do not shard it."""
    return a.view(-1) * 1, a.view(4, 4, 8) * 1, a.view(16, 2, 4).permute(2, 0, 1) * 1


def geometry(a):
    # The views themselves (not copies): their global strides and offsets are compared.
    return a.t(), a.unsqueeze(0).permute(2, 0, 1), a.transpose(0, 1)[1:3], a[:, 1:5]


def row_geometry(a):
    return a.view(4, 4, 8), a.view(16, 2, 4).permute(2, 0, 1), a.view(-1)[8:40]


def matmuls(a, w, bias):
    h = F.linear(a, w, bias)                 # t + addmm
    return h, a @ w.t(), torch.bmm(a.view(4, 4, 8), w.t().reshape(1, 8, 8).expand(4, 8, 8).contiguous())


def reductions(a):
    return (a.sum(dim=1), a.mean(dim=0), a.amax(dim=1), a.softmax(-1), F.log_softmax(a, -1),
            a.sum(dim=0, keepdim=True))




@torch.no_grad()  # as optimizers and clip_grad_norm_ run them
def foreach_ops(a, b):
    xs, ys = [a * 1, a * 2, a - 1], [b * 1, b + 1, b * b]
    divisors = [y.abs() + 1 for y in ys]
    torch._foreach_add_(xs, ys)
    torch._foreach_add_(xs, 0.5)
    torch._foreach_mul_(xs, 1.5)
    torch._foreach_mul_(xs, ys)
    torch._foreach_div_(xs, 2.0)
    torch._foreach_div_(xs, [1.0, 2.0, 3.0])
    torch._foreach_lerp_(xs, ys, 0.3)
    torch._foreach_addcmul_(xs, ys, ys, value=0.1)
    torch._foreach_addcdiv_(xs, ys, divisors, value=0.2)
    torch._foreach_addcdiv_(xs, ys, divisors, [0.1, 0.2, 0.3])
    torch._foreach_sub_(xs, ys)
    torch._foreach_mul_(xs, replicated(a.abs().amax()) + 1)  # clip_grad_norm_'s coefficient
    sums = torch._foreach_add(xs, ys)
    roots = torch._foreach_sqrt(divisors)
    negs = torch._foreach_neg(xs)
    copies = [x * 0 for x in xs]
    torch._foreach_copy_(copies, xs)
    zeros = [x * 1 for x in xs]
    torch._foreach_zero_(zeros)
    norms = [replicated(n) for n in torch._foreach_norm(xs)]
    return tuple(xs + list(sums) + list(roots) + list(negs) + copies + zeros + norms)


def cases():
    out = []
    for mesh, layouts in ((MESH4, (["R"], ["S(0)"], ["S(1)"])), (MESH22, (["S(0)", "S(1)"], ["R", "S(0)"]))):
        for p in layouts:
            tag = f"{mesh[0]}{p}"
            out += [
                Case(f"pointwise{tag}", both_paths(pointwise), [Input((16, 8), placements=p), Input((16, 8), placements=p)], mesh),
                Case(f"inplace{tag}", both_paths(inplace), [Input((16, 8), placements=p), Input((16, 8), placements=p)], mesh),
                Case(f"views{tag}", both_paths(views), [Input((16, 8), placements=p)], mesh),
                Case(f"geometry{tag}", both_paths(geometry), [Input((16, 8), placements=p, requires_grad=False)], mesh,
                     check_grad=False),
                Case(f"reductions{tag}", both_paths(reductions), [Input((16, 8), placements=p)], mesh),
                Case(f"foreach{tag}", both_paths(foreach_ops), [Input((16, 8), placements=p, requires_grad=False),
                                                                Input((16, 8), placements=p, requires_grad=False)],
                     mesh, check_grad=False),
            ]
            if "S(1)" not in p:
                out += [
                    Case(f"row_views{tag}", both_paths(row_views), [Input((16, 8), placements=p)], mesh),
                    Case(f"row_geometry{tag}", both_paths(row_geometry),
                         [Input((16, 8), placements=p, requires_grad=False)], mesh, check_grad=False),
                ]
        rep = ["R"] * len(mesh[0])
        row = ["S(0)"] + ["R"] * (len(mesh[0]) - 1)
        out += [
            Case(f"matmul_rows{mesh[0]}", both_paths(matmuls),
                 [Input((16, 8), placements=row), Input((8, 8), placements=rep), Input((8,), placements=rep)], mesh),
            Case(f"matmul_colwise{mesh[0]}", both_paths(matmuls),
                 [Input((16, 8), placements=rep), Input((8, 8), placements=row), Input((8,), placements=row)], mesh,
                 check_grad=False),
        ]
    return out


def test_fast_path_equals_boxed_fallback():
    assert_all_passed(run_cases(cases(), backend="hypershard", timeout=300))


def counted(a, b):
    """Exact statistics: a warm straight-line sequence of fast ops (list ops included) counts each op once, as a
    call, a plan-cache hit and a fast call; a boxed call (a plain operand) adds a call only."""
    if not in_distributed_run():
        return a + b
    def sequence():  # 8 ops
        c = ((a + b) * b).t().relu().t()
        torch._foreach_add_([c, a * 1], [b, b])
        torch._foreach_mul_([c], 0.5)
        return c

    sequence()
    sequence()
    hs._C.reset_dispatch_stats()
    sequence()
    stats = hs._C.dispatch_stats()
    assert (stats["calls"], stats["cache_hits"], stats["fast_calls"]) == (8, 8, 8), stats
    hs._C.reset_dispatch_stats()
    a + torch.ones(8)  # a plain operand (not a Python number): the boxed fallback
    a + torch.ones(8)
    stats = hs._C.dispatch_stats()
    assert (stats["calls"], stats["fast_calls"]) == (2, 0), stats
    return a + b


def test_fast_path_statistics():
    case = Case("counted", counted, [Input((8, 8), placements=["S(0)"], requires_grad=False),
                                     Input((8, 8), placements=["S(0)"], requires_grad=False)], MESH4, check_grad=False)
    assert_all_passed(run_cases([case], backend="hypershard", timeout=120))
