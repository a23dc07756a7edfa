"""Level0: torch.amp.GradScaler's ops (csrc/ops/foreach.cpp) on real multi-process meshes, compared
with one device.

- _amp_foreach_non_finite_check_and_unscale_ on gradients of mixed layouts (Replicate, Shard(0),
  Shard(1), uneven and, on 4 ranks, empty shards), found_inf a plain tensor as GradScaler makes
  it: the gradients unscaled in place, and found_inf 0 with finite gradients and 1 -- on every
  rank, by the rule's all-reduce -- when one element of one rank's shard (never rank 0's) is inf
  or NaN.
- _amp_update_scale_ with a DTensor found_inf and GradScaler's plain scale and growth tracker.
- GradScaler end to end: SGD on a tensor-parallel MLP (w1 Shard(0), w2 Shard(1)), an inf planted
  in one element of w1's gradient at the second step: that step is skipped on every rank, the
  scale backs off, and the parameters and the scale after three steps equal one device's.
- A Partial gradient is not covered (strict mode raises, naming why).
"""

import torch

from hypershard.testing import Case, Input, assert_all_passed, replicated, run_cases

MESH2 = ((2,), ("tp",))
MESH4 = ((4,), ("tp",))
MESH22 = ((2, 2), ("dp", "tp"))

SHAPES = ((5, 3), (4,), (3, 5), (6, 4))
LAYOUTS = {
    MESH2: (["S(0)"], ["R"], ["S(1)"], ["S(0)"]),
    MESH4: (["S(0)"], ["R"], ["S(1)"], ["S(1)"]),
    MESH22: (["S(0)", "S(1)"], ["R", "S(0)"], ["S(1)", "R"], ["S(0)", "S(0)"]),
}


def grads_with(bad):
    """Initial values of SHAPES; `bad` (inf or NaN) in the last column of the third gradient,
    which lies on the last rank of the axes sharding it (not rank 0)."""
    values = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(SHAPES)]
    if bad is not None:
        values[2][2, -1] = bad
    return values


def unscale(*grads):
    grads = [g.detach().clone() for g in grads]
    found_inf = torch.zeros(())  # plain, as GradScaler makes it
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((), 0.25))
    return grads + [found_inf]


def update_scale(found_inf):
    scale = torch.full((), 1024.0)
    growth_tracker = torch.zeros((), dtype=torch.int32)
    torch._amp_update_scale_(scale, growth_tracker, found_inf.detach(), 2.0, 0.5, 1)
    return scale, growth_tracker.to(torch.float32)


def scaler_training(w1, w2, x, bomb):
    """Three SGD steps of relu(x w1^T) w2^T under GradScaler; `bomb` (ones and one inf) multiplies
    w1's gradient at the second step."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    optimizer = torch.optim.SGD([w1, w2], lr=0.05)
    for step in range(3):
        optimizer.zero_grad()
        loss = replicated(torch.relu(x @ w1.t()) @ w2.t()).pow(2).mean()  # the row-parallel sum, made whole
        handle = w1.register_hook(lambda g: g * bomb) if step == 1 else None
        scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        scaler.step(optimizer)
        scaler.update()
    return [w1.detach().clone(), w2.detach().clone(), torch.tensor(scaler.get_scale())]


def cases():
    out = []
    for mesh, layouts in LAYOUTS.items():
        tag = "x".join(map(str, mesh[0]))
        for name, bad in (("finite", None), ("inf", float("inf")), ("nan", float("nan"))):
            values = grads_with(bad)
            inputs = [Input(shape, placements=layout, init=value, requires_grad=False)
                      for shape, layout, value in zip(SHAPES, layouts, values)]
            # NaN != NaN: compare the NaN case's flag only (its gradients hold the NaN)
            fn = unscale if bad is None or bad == float("inf") else (lambda *g: unscale(*g)[-1])
            out.append(Case(f"unscale_{name}_{tag}", fn, inputs, mesh, check_grad=False))
        out.append(Case(f"update_scale_{tag}", update_scale,
                        [Input((), init=torch.tensor(1.0), requires_grad=False)], mesh, check_grad=False))
    bomb = torch.ones(8, 6)
    bomb[7, 5] = float("inf")  # row 7 of w1 (Shard(0)): the last tp rank's
    for mesh, w1_place, w2_place in ((MESH2, ["S(0)"], ["S(1)"]), (MESH4, ["S(0)"], ["S(1)"]),
                                     (MESH22, ["R", "S(0)"], ["R", "S(1)"])):
        tag = "x".join(map(str, mesh[0]))
        out.append(Case(f"gradscaler_training_{tag}", scaler_training,
                        [Input((8, 6), placements=w1_place), Input((3, 8), placements=w2_place),
                         Input((5, 6), placements=None, requires_grad=False),
                         Input((8, 6), placements=w1_place, init=bomb, requires_grad=False)],
                        mesh, check_grad=False))
    out.append(Case("unscale_partial_gradient_not_covered", unscale,
                    [Input((4, 3), placements=["P"], requires_grad=False)], MESH2, check_grad=False,
                    expect_error="Missing operator aten::_amp_foreach_non_finite_check_and_unscale_ for these "
                                 "arguments (a Partial gradient: its parts can be finite while their sum overflows)"))
    return out


def test_amp_scaler_ops():
    assert_all_passed(run_cases(cases(), backend="hypershard", timeout=300))
