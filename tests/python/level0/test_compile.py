"""Level0: torch.compile of functions and of a tiny model whose inputs or parameters are hypershard
DTensors, on a 2-rank mesh (Shard and Replicate), strict mode, against one device.

The floor (docs/compile.md): Dynamo graph-breaks at every DTensor (hypershard/tensor/fake_guard.py
turns the fake-tensor conversion of a DTensor into UnsupportedFakeTensorException), the code around
it compiles, the DTensor ops run eagerly through hypershard's dispatcher. So in the distributed
run each case checks, besides the harness's comparison with one device (forward, and the
gradients of a seeded random cotangent):
- the compiled call's outputs are bit-identical to the same function run eagerly on the same
  DTensors (the same ops on the same values; rtol = atol = 0), and so are the gradients of the
  outputs' sum with respect to every DTensor input;
- Dynamo really ran and met a DTensor (compile_support.counts["refused"] grew), and where a
  function starts with plain-tensor code, it captured that code in a graph
  (counters["stats"]["calls_captured"]).
Backends: "eager" (Dynamo alone), "aot_eager" (AOTAutograd on the plain graphs) and "inductor"
(torch.compile's default, the plain graphs compiled to C++).

The model case returns the parameters' gradients as outputs (its parameters are made inside the
function from a fixed seed, laid out by hs.parallelize with colwise/rowwise styles), so they are
compared with the one-device model's too. One 2-rank launch; about 25 s (most of it Dynamo and
Inductor compiling).
"""

import functools

import torch
import torch.nn.functional as F

import hypershard as hs
from hypershard.tensor import fake_guard as compile_support
from hypershard.testing import Case as _Case
from hypershard.testing import Input, assert_all_passed, in_distributed_run, run_cases
from hypershard.testing.compiled_checks import check_against_eager

# Dynamo compiles these cases' functions: on a device launch they must not run under the
# torch.device context the harness enters for other cases (Dynamo would trace its function mode).
Case = functools.partial(_Case, build_on_device=False)

M2 = ((2,), ("dp",))
TP2 = ((2,), ("tp",))
EXACT = {"rtol": 0.0, "atol": 0.0}


def compiled(fn, backend, captures_plain_code=False):
    """The case's dist_fn: fn through torch.compile(backend=...), checked against eager fn on the
    same DTensors and for the graph break (module docstring)."""
    def run(*inputs):
        import torch._dynamo
        from torch._dynamo.utils import counters
        torch._dynamo.reset()
        counters.clear()
        refused = compile_support.counts["refused"]
        got = torch.compile(fn, backend=backend)(*inputs)
        assert counters["frames"]["total"] > 0, "Dynamo saw no frame"
        assert compile_support.counts["refused"] > refused, "Dynamo never met a DTensor"
        if captures_plain_code:
            assert counters["stats"]["calls_captured"] > 0, "Dynamo captured no plain-tensor code"
        want = fn(*inputs)

        def identical(g, w, what):
            assert torch.equal(g, w), f"{what}: compiled differs from eager"
        check_against_eager(got, want, list(inputs), identical)
        return got
    return run


# ---------------------------------------------------------------------------------- functions

def pointwise_reduce(x, y):
    return (x.sin() * y + 1.0).sum(dim=1)


def plain_prefix_matmul(x, w):
    # the bias is plain-tensor code: Dynamo compiles it into a graph, then breaks at x @ w (reading
    # w.shape first would break there, before the plain code)
    bias = torch.arange(4.0) * 0.25 - 1.0
    return torch.relu(x @ w + bias)


def softmax_with_branch(x):
    # Python control flow on a DTensor's (global) shape: resolved eagerly, as in eager
    if x.shape[-1] > 4:
        x = x * 2.0
    return F.log_softmax(x, dim=-1).mean()


def function_cases():
    cases = []
    functions = [
        ("pointwise_reduce", pointwise_reduce, lambda: [Input((6, 5), placements=["S(0)"]),
                                                        Input((6, 5), placements=["R"])], False),
        ("matmul_rows", plain_prefix_matmul, lambda: [Input((6, 8), placements=["S(0)"]),
                                                      Input((8, 4), placements=["R"])], True),
        ("matmul_cols", plain_prefix_matmul, lambda: [Input((6, 8), placements=["R"]),
                                                      Input((8, 4), placements=["S(1)"])], True),
        ("softmax_branch", softmax_with_branch, lambda: [Input((5, 6), placements=["S(0)"])], False),
    ]
    for backend in ("eager", "aot_eager", "inductor"):
        for name, fn, inputs, plain_code in functions:
            cases.append(Case(f"{name}_{backend}", fn=fn, inputs=inputs(), mesh=M2,
                              dist_fn=compiled(fn, backend, plain_code)))
    return cases


# ---------------------------------------------------------------------------------- a tiny model

class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).log_softmax(dim=-1)


def tiny_model_step(backend):
    """fn(x): the model (seeded) on x, compiled in the distributed run with its parameters
    colwise/rowwise over "tp"; returns the output and every parameter's gradient of a fixed
    loss, so both are compared with one device."""
    def fn(x):
        torch.manual_seed(7)
        model = TinyMLP()
        run = model
        if in_distributed_run():
            hs.parallelize(model, x.device_mesh, {"up": "colwise", "down": "rowwise"})
            assert isinstance(model.up.weight, hs.DTensor) and model.up.weight.placements == (hs.Shard(0),)
            run = compiled(model, backend, captures_plain_code=False)
        out = run(x)
        target = torch.arange(x.shape[0]) % out.shape[-1]
        F.nll_loss(out, target).backward()
        return [out.detach()] + [p.grad for p in model.parameters()]
    return fn


def model_cases():
    return [Case(f"tiny_mlp_{backend}", fn=tiny_model_step(backend), mesh=TP2, check_grad=False,
                 inputs=[Input((6, 8), placements=["R"], requires_grad=False)])
            for backend in ("eager", "aot_eager", "inductor")]


def test_compile_matches_eager_and_one_device():
    assert_all_passed(run_cases(function_cases() + model_cases(), timeout=600))


def _without_the_guard(dist_fn):
    """dist_fn with hypershard's fake-tensor guard removed for the call (the state before it)."""
    def run(*inputs):
        from torch._subclasses import fake_tensor
        guarded = fake_tensor.FakeTensorConverter.from_real_tensor
        fake_tensor.FakeTensorConverter.from_real_tensor = guarded.__wrapped__
        try:
            return dist_fn(*inputs)
        finally:
            fake_tensor.FakeTensorConverter.from_real_tensor = guarded
    return run


def test_planted_faults_would_be_caught():
    """The checks can fail: (1) a compiled call whose result is off by 2**-20 relative to eager's
    (an effect only the first, compiled, call has), (2) torch.compile without hypershard's guard
    (the NotImplementedError this floor fixes)."""
    state = {"calls": 0}

    def off_when_compiled(x, y):
        state["calls"] += 1
        out = pointwise_reduce(x, y)
        return out * (1.0 + 2.0 ** -20) if state["calls"] == 1 else out

    inputs = [Input((6, 5), placements=["S(0)"]), Input((6, 5), placements=["R"])]
    cases = [Case("planted_off_by_2^-20", fn=pointwise_reduce, mesh=M2, inputs=inputs,
                  dist_fn=compiled(off_when_compiled, "eager")),
             Case("planted_no_guard", fn=pointwise_reduce, mesh=M2, inputs=inputs,
                  dist_fn=_without_the_guard(compiled(pointwise_reduce, "eager")))]
    results = run_cases(cases, timeout=300)
    assert not results["planted_off_by_2^-20"].passed, "a compiled result unlike eager's passed"
    message = results["planted_no_guard"].message
    assert not results["planted_no_guard"].passed and "Cannot access storage" in message, message
