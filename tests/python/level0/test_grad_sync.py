"""Level0: data-parallel gradient buckets (csrc/runtime/grad_sync.cpp) on real meshes.

A small model on a (dp=2, tp=2) mesh and on 4 dp ranks with an uneven batch: its parameters are
Replicate on dp, so their gradients arrive Partial(sum) on dp -- one of them on dp and tp, one in
float64. Each case checks the gradients (and what the case returns) against one device and, in
the distributed run, that .grad has its parameter's layout and that the gradients took the
expected path:
- backward() with the default cap: every gradient reduced in a bucket, one bucket per
  (Partial axes, dtype); the collectives saved are exactly the per-parameter ones;
- a 1-byte cap: one bucket per gradient; cap 0: every gradient reduced on arrival;
- a second backward() without zero_grad (accumulation): the reduced .grad becomes Partial
  locally and the sum is bucketed again;
- torch.autograd.grad, backward(inputs=...), a post-accumulate-grad hook and a user tensor hook
  that clamps: the gradient is reduced before anything can read it, and the values still equal
  one device;
- a backward pass that raises midway, then a normal one: bucketed and right;
- buckets started during the pass (overlap, the default) against all at the end: the same values;
  also with gradients Partial on both axes of 2x2 (a batch over one axis and a sequence over the
  other, as dp x cp gives, two sequences per rank): every one bucketed (none summed on arrival
  because it came transposed), the first axis's sum starting during the pass, the second at the end.
"""

import pytest
import torch

import hypershard as hs
from hypershard.testing import Case, Input, assert_all_passed, in_distributed_run, replicated, run_cases

MESH22 = ((2, 2), ("dp", "tp"))
MESH4 = ((4,), ("dp",))
DEFAULT_CAP = 25 << 20

# x, w1 (colwise), b1, w2 (rowwise), s (scales the Partial-on-tp product), b2, w3 (float64)
SHAPES = ((6, 5), (8, 5), (8,), (4, 8), (4,), (4,), (3, 5))
LAYOUTS = {
    MESH22: (["S(0)", "R"], ["R", "S(0)"], ["R", "S(0)"], ["R", "S(1)"], ["R", "R"], ["R", "R"], ["R", "R"]),
    MESH4: (["S(0)"], ["R"], ["R"], ["R"], ["R"], ["R"], ["R"]),
}
# Per mesh: (gradients, Partial axes summed one gradient at a time, buckets and their axes with
# the default cap)
EXPECTED = {MESH22: (6, 4 + 2 + 1, 3, 1 + 2 + 1), MESH4: (6, 6, 2, 2)}


def inputs(mesh):
    return [Input(shape, torch.float64 if i == 6 else torch.float32, placements=lay, requires_grad=i > 0)
            for i, (shape, lay) in enumerate(zip(SHAPES, LAYOUTS[mesh]))]


def loss_of(x, w1, b1, w2, s, b2, w3):
    hidden = torch.tanh(x @ w1.t() + b1)
    out = replicated((hidden @ w2.t()) * s + b2)  # Partial on tp before: s's gradient is Partial on dp and tp
    wide = x.double() @ w3.t()
    return replicated(out.pow(2).mean()) + replicated(wide.pow(2).mean()).float()


def grads_of(params):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


class Cap:
    """Sets the bucket cap and clears the statistics and traffic counters; restores the cap."""

    def __init__(self, cap):
        self.cap = cap

    def __enter__(self):
        self.saved = hs._C.grad_bucket_bytes()
        hs._C.set_grad_bucket_bytes(self.cap)
        hs._C.reset_grad_sync_stats()
        hs._C.reset_traffic()
        return self

    def __exit__(self, *exc):
        hs._C.set_grad_bucket_bytes(self.saved)
        return False


def check_layouts(params, stats=None, **expected):
    if not in_distributed_run():
        return
    for i, p in enumerate(params):
        if p.grad is not None:
            assert p.grad.placements == p.placements, (i, p.grad.placements, p.placements)
    got = hs._C.grad_sync_stats()
    assert all(got[k] == v for k, v in expected.items()), f"grad_sync_stats {got}, expected {expected}"


def backward_collectives(cap, x, params):
    """Collectives of one backward pass with `cap` (the forward's are not counted)."""
    for p in params:
        p.grad = None
    loss = loss_of(x, *params)
    with Cap(cap):
        loss.backward()
        return hs._C.traffic()["collectives"]


def bucketed(mesh, x, *params):
    grads, one_by_one, buckets, bucket_axes = EXPECTED[mesh]
    per_param = backward_collectives(0, x, params)
    check_layouts(params, reduced_on_arrival=grads, bucketed=0, buckets=0)
    tiny = backward_collectives(1, x, params)
    check_layouts(params, reduced_on_arrival=0, bucketed=grads, buckets=grads)
    default = backward_collectives(DEFAULT_CAP, x, params)
    check_layouts(params, reduced_on_arrival=0, bucketed=grads, buckets=buckets)
    if in_distributed_run():
        assert per_param - default == one_by_one - bucket_axes, (per_param, default, one_by_one, bucket_axes)
        assert tiny == per_param, (tiny, per_param)  # one bucket per gradient: the same collectives
    return grads_of(params)


def accumulated(mesh, x, *params):
    grads = EXPECTED[mesh][0]
    with Cap(DEFAULT_CAP):
        loss_of(x, *params).backward()
        check_layouts(params, reduced_on_arrival=0, bucketed=grads)
        hs._C.reset_grad_sync_stats()
        loss_of(x * 0.5, *params).backward()  # .grad is set: made Partial locally, then bucketed again
        check_layouts(params, reduced_on_arrival=0, bucketed=grads)
    return grads_of(params)


def autograd_grad(mesh, x, *params):
    with Cap(DEFAULT_CAP):
        got = torch.autograd.grad(loss_of(x, *params), params)
        check_layouts(params, reduced_on_arrival=EXPECTED[mesh][0], bucketed=0)
        if in_distributed_run():
            assert all(g.placements == p.placements for g, p in zip(got, params)), [g.placements for g in got]
            assert all(p.grad is None for p in params)
    return list(got)


def some_inputs(mesh, x, *params):
    chosen = [params[0], params[4], params[5]]  # w1, b2, w3
    with Cap(DEFAULT_CAP):
        loss_of(x, *params).backward(inputs=chosen)
        check_layouts(params, reduced_on_arrival=0, bucketed=3)
        if in_distributed_run():
            assert [p.grad is not None for p in params] == [any(p is c for c in chosen) for p in params]
    return grads_of(params)


def post_accumulate_hook(mesh, x, *params):
    seen = []
    handle = params[2].register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.placements if in_distributed_run() else None))
    try:
        with Cap(DEFAULT_CAP):
            loss_of(x, *params).backward()
            check_layouts(params, reduced_on_arrival=1, bucketed=EXPECTED[mesh][0] - 1)
    finally:
        handle.remove()
    if in_distributed_run():
        assert seen == [params[2].placements], seen
    return grads_of(params)


def clamping_hook(mesh, x, *params):
    loss = loss_of(x, *params)  # the forward installs hypershard's hook first; the user's runs after it
    handle = params[2].register_hook(lambda g: g.clamp(-0.01, 0.01))
    try:
        with Cap(DEFAULT_CAP):
            loss.backward()
            check_layouts(params)
    finally:
        handle.remove()
    return grads_of(params)


class RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("raised in backward on purpose")


def after_raising_backward(mesh, x, *params):
    """A backward pass that raises after some gradients were left Partial drops its bucket; the
    next one (after zero_grad) is bucketed and right."""
    with Cap(DEFAULT_CAP):
        w1 = RaiseInBackward.apply(params[0])  # reached late in backward: the others arrive first
        try:
            loss_of(x, w1, *params[1:]).backward()
        except RuntimeError as exc:
            assert "raised in backward on purpose" in str(exc), exc
        else:
            raise AssertionError("backward did not raise")
        for p in params:
            p.grad = None
        hs._C.reset_grad_sync_stats()
        loss_of(x, *params).backward()
        check_layouts(params, reduced_on_arrival=0, bucketed=EXPECTED[mesh][0])
    return grads_of(params)


class Overlap:
    """Cap(1) with set_grad_overlap(`overlap`), every .grad cleared first; restores the setting."""

    def __init__(self, overlap, params):
        self.overlap, self.params, self.cap = overlap, params, Cap(1)

    def __enter__(self):
        self.saved = hs._C.grad_overlap()
        hs._C.set_grad_overlap(self.overlap)
        for p in self.params:
            p.grad = None
        return self.cap.__enter__()

    def __exit__(self, *exc):
        hs._C.set_grad_overlap(self.saved)
        return self.cap.__exit__(*exc)


def overlapped(mesh, x, *params):
    """Buckets started during the backward pass (a 1-byte cap: every settled single-axis gradient
    fills one and starts it when the next gradient of its group settles) against no overlap
    (set_grad_overlap(False): every bucket at the end): the same buckets, the same values. Then a
    pass that raises after some buckets started: their sums still finish and those .grad take
    their parameter's layout (the others stay Partial); every .grad reads the same value as
    without overlap."""
    grads = EXPECTED[mesh][0]
    results, raised = [], []
    for overlap in (True, False):
        with Overlap(overlap, params):
            loss_of(x, *params).backward()
            check_layouts(params, reduced_on_arrival=0, bucketed=grads, buckets=grads)
            started = hs._C.grad_sync_stats()["overlapped"]
        if in_distributed_run():
            assert (started > 0) == overlap and started < grads, (overlap, started)
        results.append(grads_of(params))
        with Overlap(overlap, params):
            try:
                loss_of(x, RaiseInBackward.apply(params[0]), *params[1:]).backward()
            except RuntimeError as exc:
                assert "raised in backward on purpose" in str(exc), exc
            started = hs._C.grad_sync_stats()["overlapped"]
        if in_distributed_run():
            assert (started > 0) == overlap, (overlap, started)
            raised.append([p.grad.full_tensor() if p.grad is not None else None for p in params])
    if in_distributed_run():
        assert all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(*results))
        for a, b in zip(*raised):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (a, b)
    for p in params:
        p.grad = None
    return results[0]


# A [batch, sequence, hidden] input over both axes of the 2x2 mesh (as dp x cp shards it, two
# sequences per rank): the weights' gradients are Partial on both axes. F.linear runs as bmm on
# it (csrc/ops/composites.cpp), whose weight gradient arrives transposed: the grad hook makes it
# contiguous, else AccumulateGrad's copy into the leaf's strides would sum it on arrival.
TWO_AXES_SHAPES = ((4, 6, 5), (8, 5), (7, 8), (3, 7))


def two_axes_loss(x, w1, w2, w3):
    linear = torch.nn.functional.linear
    return replicated(linear(torch.tanh(linear(torch.tanh(linear(x, w1)), w2)), w3).pow(2).mean())


def overlapped_two_axes(x, w1, w2, w3):
    """Three gradients Partial on both axes, arriving w3, w2, w1 (cap 1): w3's bucket starts its
    first axis's sum when w2's gradient settles (w1 arrives), its second at the end; the others
    are reduced at the end. The values equal the no-overlap run's."""
    params = (w1, w2, w3)
    results, started = [], []
    for overlap in (True, False):
        with Overlap(overlap, params):
            two_axes_loss(x, *params).backward()
            stats = hs._C.grad_sync_stats()
            started.append(stats["overlapped"])
            assert stats["bucketed"] == (3 if in_distributed_run() else 0), stats
        if in_distributed_run():
            assert all(hs.layout_of(p.grad) == hs.layout_of(p) for p in params)
        results.append(grads_of(params))
    if in_distributed_run():
        assert started == [1, 0], started
        assert all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(*results))
    for p in params:
        p.grad = None
    return results[0]


CASES = {"bucketed": bucketed, "overlapped": overlapped, "accumulated": accumulated, "autograd_grad": autograd_grad,
         "some_inputs": some_inputs, "post_accumulate_hook": post_accumulate_hook, "clamping_hook": clamping_hook,
         "after_raising_backward": after_raising_backward}


def cases():
    two_axes = [Input(shape, placements=["S(0)", "S(1)"] if i == 0 else ["R", "R"], requires_grad=i > 0)
                for i, shape in enumerate(TWO_AXES_SHAPES)]
    return [Case(f"{name}{mesh[0]}", lambda *a, fn=fn, mesh=mesh: fn(mesh, *a), inputs(mesh), mesh, check_grad=False)
            for mesh in (MESH22, MESH4) for name, fn in CASES.items()] + [
        Case("overlapped_two_axes", overlapped_two_axes, two_axes, MESH22, check_grad=False)]


def test_gradient_buckets():
    assert_all_passed(run_cases(cases(), backend="hypershard", timeout=300))


def test_bucket_cap_is_checked():
    with pytest.raises(ValueError, match=r"hypershard: set_grad_bucket_bytes: bytes must be >= 0"):
        hs._C.set_grad_bucket_bytes(-1)
    assert hs._C.grad_bucket_bytes() == DEFAULT_CAP


def _user_hooks_and_grad_sync(rank, world):
    import hypershard as hs

    mesh = hs.init_device_mesh("cpu", (world,), ("dp",))
    x = hs.distribute_tensor(torch.ones(2 * world, 3), mesh, [hs.Shard(0)])
    before = hs.distribute_tensor(torch.ones(3, 2), mesh, [hs.Replicate()]).requires_grad_()
    seen = []
    before.register_hook(lambda g: seen.append(str(g.placements)))  # before hypershard's own hook
    (x @ before).sum().backward()
    after = hs.distribute_tensor(torch.ones(3, 2), mesh, [hs.Replicate()]).requires_grad_()
    (x @ after).sum().backward()
    after.grad = None
    after.register_hook(lambda g: seen.append("after"))  # torch clears the leaf's hooks here
    (x @ after).sum().backward()
    return {"seen": seen, "before": [str(before.grad.placements), before.grad.full_tensor().tolist()],
            "after": [str(after.grad.placements), after.grad.full_tensor().tolist()]}


def test_user_hooks_and_gradient_sync_coexist():
    """torch allows one tensor pre-hook per leaf and each registration kind clears the other's:
    a user's Python hook must neither be dropped by hypershard's gradient hook nor drop it."""
    from hypershard.launch import spawn_local_ranks

    for result in spawn_local_ranks(_user_hooks_and_grad_sync, 2, timeout=120):
        assert result["seen"] == ["(Partial(sum),)", "after"], result
        expected = [[4.0, 4.0]] * 3  # 2 * world rows of ones summed over the batch
        assert result["before"] == ["(Replicate(),)", expected], result
        assert result["after"] == ["(Replicate(),)", expected], result
