"""Level0: hypershard.compile -- the local program traced into ONE graph per pass, with its
collectives as functional collectives (docs/compile.md, "The local program compiled").

Every case compiles with fullgraph=True (a graph break fails it) on a 2-rank mesh in strict mode,
and checks, besides the harness's comparison with one device (forward, and the gradients of a
seeded random cotangent):
- the compiled call against the same function run eagerly by hypershard on the same DTensors:
  outputs and the gradients of the outputs' sum. Backends "eager" (Dynamo's graph run op by op on
  the traced DTensors, for real) and "aot_eager" run the very local ops eager runs, in the same
  order, so they must be bit-identical (rtol = atol = 0; the model case's gradients under
  aot_eager are the exception argued there). Inductor fuses and reorders float32 arithmetic; its
  allowance is torch.testing's float32 default, FLOAT32: rtol 1.3e-6 (about 11 float32 ulps,
  eps = 1.19e-7: a few reassociated roundings) and atol 1e-5 for values that cancel (reordering a
  sum of n terms moves it by up to about n * eps * the sum of their magnitudes; the inductor
  cases' sums have n <= 8 terms of randn-sized values, i.e. about 8 * 1.19e-7 * 8 * 1.5 = 1.1e-5
  only in the worst case, a few 1e-7 in practice), far below any layout error (a wrong shard or a missed reduction changes
  values by O(1));
- with aot_eager, the forward and backward graphs hold exactly the functional collectives
  expected (`_c10d_functional.*` nodes), so communication is in the graph, not hidden in eager
  code; a call with an empty shard on some rank must make no graph at all (it runs eagerly).

The tiny Qwen3 case compiles HF's whole training forward (tp2: colwise/rowwise projections, the
rowwise outputs all-reduced by parallelize's hooks: 4 all-reduces and lm_head's all-gather in the
forward graph, the colwise inputs' gradients all-reduced in the backward graph) and compares
the loss and every parameter's gradient; so does the tiny DeepSeek-V3.2 on tp2 (its math-path
attention flattens sharded heads: the traced view redistributes first, as eager's reshape does).
The tiny Qwen3.5-MoE on tp2 (inductor) does the same
with the experts' grouped products in the graph; transformers' grouped_mm_fallback is checked
alone with experts replicated, colwise, rowwise and expert-sharded; a program reloaded from the
compile cache by a fresh Dynamo must hit AOTAutograd's cache; with inductor's compute/communication
reordering, a gather's wait must move below independent compute and results stay eager's;
hypershard's DTensor API inside a compiled function (placements read; to_local, full_tensor and
redistribute ops of the graph, their collectives counted). One 2-rank launch.
"""

import functools
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers.integrations.moe  # noqa: F401 -- defines transformers::grouped_mm_fallback

import hypershard as hs
from hypershard.testing import Case as _Case
from hypershard.testing import Input, assert_all_passed, run_cases
from hypershard.testing.compiled_checks import check_against_eager, full
from hypershard.testing.spec import randint

# Dynamo compiles these cases' functions: on a device launch they must not run under the
# torch.device context the harness enters for other cases (Dynamo would trace its function mode).
Case = functools.partial(_Case, build_on_device=False)

TP2 = ((2,), ("tp",))
CP2 = ((2,), ("cp",))
EXACT = {"rtol": 0.0, "atol": 0.0}
FLOAT32 = {"rtol": 1.3e-6, "atol": 1e-5}


class GraphCounter:
    """An aot_eager backend that counts the functional collectives (not their waits) of each graph
    it is given (forward first, then backward)."""

    def __init__(self):
        self.collectives = []

    def backend(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def count(gm, example_inputs):
            self.collectives.append(
                sum(
                    1
                    for n in gm.graph.nodes
                    if n.op == "call_function"
                    and str(n.target).startswith("_c10d_functional.")
                    and "wait_tensor" not in str(n.target)
                )
            )
            return make_boxed_func(gm.forward)

        return aot_autograd(fw_compiler=count, bw_compiler=count)


def _assert_close(got, want, tolerance, what):
    got, want = full(got), full(want)
    assert got.dtype == want.dtype, f"{what}: compiled gives {got.dtype}, eager {want.dtype}"
    if tolerance is EXACT:
        assert torch.equal(got, want), f"{what}: compiled differs from eager by {(got - want).abs().max()}"
    else:
        torch.testing.assert_close(got, want, **tolerance, msg=lambda m: f"{what}: {m}")


def traced(fn, backend, collectives=None, local_as=None):
    """The case's dist_fn: hs.compile(fn, fullgraph=True), checked against eager fn on the same
    DTensors (module docstring). `collectives`: (forward, backward) functional collectives the
    aot_eager graphs must hold. `local_as`: fn returns a rank's local; the harness compares it
    as a DTensor with these placements (a differentiable from_local)."""
    tolerance = FLOAT32 if backend == "inductor" else EXACT

    def run(*inputs):
        import torch._dynamo

        torch._dynamo.reset()
        counter = GraphCounter()
        compiled = hs.compile(fn, backend=counter.backend() if backend == "aot_eager" else backend, fullgraph=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = compiled(*inputs)
        # torch asks traceable subclasses for an AOTAutograd cache key (TracedDTensor's
        # _stable_hash_for_caching) and warns, once per process, where there is none
        unhashed = [str(w.message) for w in caught if "_stable_hash_for_caching" in str(w.message)]
        assert not unhashed, unhashed
        want = fn(*inputs)
        check_against_eager(got, want, list(inputs), lambda g, w, what: _assert_close(g, w, tolerance, what))
        if collectives is not None:
            assert counter.collectives == list(collectives), (counter.collectives, collectives)
        return got if local_as is None else hs.DTensor.from_local(got, inputs[0].device_mesh, local_as)

    return run


# ---------------------------------------------------------------------------------- functions


def pointwise_reduce(x, y):
    return (x.sin() * y + 1.0).sum(dim=1)


def matmul_relu(x, w):
    return torch.relu(x @ w * 0.5)


def softmax_sharded(x):
    return F.softmax(x, dim=-1)


def layer_norm_sharded(x):
    return F.layer_norm(x, (x.shape[-1],))


def cross_entropy(logits, target):
    return F.cross_entropy(logits, target)


def embedding(ids, weight):
    return F.embedding(ids, weight) * 2.0


def padding_mask_expanded(mask):
    """transformers' sdpa mask of a padding mask (masking_utils): the [batch, kv] bool mask read at
    broadcast arange indices, [batch, 1, 1, kv]."""
    rows = torch.arange(mask.shape[0])[:, None, None, None]
    columns = torch.arange(mask.shape[1])[None, None, None, :]
    return mask[rows, columns]


# 11 tokens in 4 experts (expert 2 empty): the GLOBAL cumulative row ends
GROUP_ENDS = torch.tensor([3, 7, 7, 11], dtype=torch.int32)


def heads_product(q, k):
    return (q @ k.transpose(-1, -2)).softmax(-1)


def grouped_mm_fallback(x, w, offs):
    """transformers' MoE product without aten's _grouped_mm (float32 when compiled): its custom op,
    whose own backward reads offs' values (hypershard's traced backward does not)."""
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


def _grouped_inputs(x_placement, w_placement):
    offs = Input((4,), torch.int32, init=GROUP_ENDS, requires_grad=False)
    return [Input((11, 8), placements=[x_placement]), Input((4, 8, 12), placements=[w_placement]), offs]


def function_cases():
    functions = [
        # S(0) x R: nothing moves, forward or backward (y's gradient stays Partial, as in eager)
        (
            "pointwise_reduce",
            pointwise_reduce,
            [Input((6, 5), placements=["S(0)"]), Input((6, 5), placements=["R"])],
            (0, 0),
        ),
        ("matmul_rows", matmul_relu, [Input((6, 8), placements=["S(0)"]), Input((8, 4), placements=["R"])], (0, 0)),
        ("matmul_cols", matmul_relu, [Input((6, 8), placements=["R"]), Input((8, 4), placements=["S(1)"])], (0, 0)),
        # over the sharded dim: softmax's expand implementation all-reduces the row max and the
        # row sum (forward), and the row sum of grad * output (backward); layer_norm's rule gathers
        # the sharded dim (forward) and the gradient's (backward)
        ("softmax_sharded", softmax_sharded, [Input((5, 8), placements=["S(1)"])], (2, 1)),
        ("layer_norm_sharded", layer_norm_sharded, [Input((5, 8), placements=["S(1)"])], (1, 1)),
        # vocab-parallel: the classes (the vocab rows) sharded, targets and ids bounds-checked by a
        # device-side assert while tracing, not by reading values. cross_entropy all-reduces the
        # row max, the sum of exponentials and the target's logit (forward) and the gradient's
        # row sum (backward); the embedding's output is Partial, reduced by whoever needs it
        (
            "cross_entropy_vocab",
            cross_entropy,
            [Input((6, 8), placements=["S(1)"]), Input((6,), torch.int64, placements=["R"], init=randint(0, 8))],
            (3, 1),
        ),
        (
            "embedding_vocab",
            embedding,
            [Input((3, 4), torch.int64, placements=["R"], init=randint(0, 8)), Input((8, 5), placements=["S(0)"])],
            (0, 0),
        ),
        # a bool tensor gathered (indexing the sharded batch dim): inductor (torch 2.13) lowers a
        # functional all-gather of bool into an int64 buffer, which came back as an int64 mask
        (
            "padding_mask_gathered",
            padding_mask_expanded,
            [Input((4, 16), torch.bool, placements=["S(0)"])],
            (1,),  # no backward graph: nothing is differentiable
        ),
        # a 4-D product with the heads sharded: matmul flattens (batch, heads), a view that cuts the
        # heads' shards; eagerly hypershard's reshape gathers them first, and so does the traced
        # view (torch's composite reshape picks the view before a traced DTensor sees it)
        (
            "matmul_heads_flattened",
            heads_product,
            [Input((2, 4, 6, 8), placements=["S(1)"]), Input((2, 4, 6, 8), placements=["S(1)"])],
            (2, 0),
        ),
        # one row over 2 ranks: rank 1's shard is empty, so the call runs eagerly on both ranks
        # (no graph: a compiler drops the empty rank's zero-size work and the collectives feeding it)
        (
            "matmul_empty_shard",
            matmul_relu,
            [Input((1, 8), placements=["S(0)"]), Input((8, 4), placements=["R"])],
            (),
        ),
        # the MoE experts' grouped products (tp MoE: experts colwise / rowwise; ep: expert-sharded):
        # group sizes are values, so the local program is one op (hypershard::grouped_mm_local)
        # that the graph holds and that reads offs when the compiled program runs. No collective:
        # the rowwise and expert outputs, and the tokens' gradients there, stay Partial, as eager
        ("grouped_replicate", grouped_mm_fallback, _grouped_inputs("R", "R"), (0, 0)),
        ("grouped_colwise", grouped_mm_fallback, _grouped_inputs("R", "S(2)"), (0, 0)),
        ("grouped_rowwise", grouped_mm_fallback, _grouped_inputs("S(1)", "S(1)"), (0, 0)),
        ("grouped_expert", grouped_mm_fallback, _grouped_inputs("R", "S(0)"), (0, 0)),
    ]
    cases = []
    for backend in ("eager", "aot_eager", "inductor"):
        for name, fn, inputs, collectives in functions:
            expected = collectives if backend == "aot_eager" else None
            cases.append(
                Case(f"{name}_{backend}", fn=fn, inputs=inputs, mesh=TP2, dist_fn=traced(fn, backend, expected))
            )
    return cases


# to_local(), full_tensor() and redistribute() inside the compiled function: ops of the graph
# (this rank's local; the whole and the redistribution through functional collectives),
# differentiable as eagerly. The one-device reference is the same maths on plain tensors.
def local_of_product(x, w):
    return (x @ w).relu().to_local() * 2.0


def whole_of_product(x, w):
    return (x @ w).full_tensor().sin()


def product_replicated(x, w):
    return (x @ w).redistribute(x.device_mesh, [hs.Replicate()]).sin()


def product_rows(x, w):
    return (x @ w).redistribute(placements=[hs.Shard(0)]).sin()


def dtensor_method_cases():
    product = (lambda x, w: (x @ w).relu() * 2.0, lambda x, w: (x @ w).sin())
    methods = [
        # colwise: y S(1); its local, no collective either way
        ("to_local_colwise", local_of_product, product[0], "R", "S(1)", (0, 0), [hs.Shard(1)]),
        # colwise: the whole of y S(1) all-gathered; its gradient cut back (no collective)
        ("full_tensor_colwise", whole_of_product, product[1], "R", "S(1)", (1, 0), None),
        # rowwise: y Partial(sum), all-reduced; the gradient of the whole is every rank's
        ("full_tensor_rowwise", whole_of_product, product[1], "S(1)", "S(0)", (1, 0), None),
        # redistribute: colwise y S(1) to Replicate (all-gather; the gradient cut back), and
        # rowwise y Partial to S(0) (reduce-scatter; the gradient all-gathered to Replicate)
        ("redistribute_colwise", product_replicated, product[1], "R", "S(1)", (1, 0), None),
        ("redistribute_rowwise", product_rows, product[1], "S(1)", "S(0)", (1, 1), None),
    ]
    cases = []
    for backend in ("eager", "aot_eager", "inductor"):
        for name, fn, reference, x_placement, w_placement, collectives, local_as in methods:
            inputs = [Input((4, 6), placements=[x_placement]), Input((6, 8), placements=[w_placement])]
            expected = collectives if backend == "aot_eager" else None
            dist_fn = traced(fn, backend, expected, local_as)
            cases.append(Case(f"{name}_{backend}", fn=reference, inputs=inputs, mesh=TP2, dist_fn=dist_fn))
    # an avg Partial made whole (all-reduce): its gradient is the whole one on every rank, as eagerly
    average = [Input((4, 6), placements=["P(avg)"])]
    for name, fn in (("full_tensor_avg", whole_times_3), ("redistribute_avg", replicated_times_3)):
        cases.append(Case(f"{name}_aot_eager", lambda x: x * 3.0, average, TP2, dist_fn=traced(fn, "aot_eager", (1, 0))))
    return cases


def whole_times_3(x):
    return x.full_tensor() * 3.0


def replicated_times_3(x):
    return x.redistribute(placements=[hs.Replicate()]) * 3.0


# ---------------------------------------------------------------------------------- tiny Qwen3


def _tiny(name):
    from hypershard.testing.models import tiny_config, tiny_model

    torch.manual_seed(3)
    return tiny_model(tiny_config(name))


def _qwen3():
    return _tiny("qwen3")


def _qwen3_vl_moe():
    return _tiny("qwen3_vl_moe")


def _qwen3_5_moe():
    return _tiny("qwen3_5_moe_text")


def _train_once(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def _deepseek_v32():
    return _tiny("deepseek_v32")


def deepseek_v32_step(ids):
    return _train_once(_deepseek_v32(), ids)


def qwen3_step(ids):
    return _train_once(_qwen3(), ids)


def qwen3_vl_moe_step(ids):
    return _train_once(_qwen3_vl_moe(), ids)


def qwen3_5_moe_step(ids):
    return _train_once(_qwen3_5_moe(), ids)


def _blocks_fully_sharded(model, mesh):
    """fully_shard per decoder layer, then the root (the usual FSDP wrapping)."""
    for layer in model.model.layers:
        hs.fully_shard(layer, mesh)
    return hs.fully_shard(model, mesh)


def qwen3_traced(
    backend, collectives=None, build=_qwen3, fullgraph=True, shard=None, compiled_again=False, **parallelize_kwargs
):
    """dist_fn: the model `build` makes, parallelized on the mesh (then `shard(model, mesh)`, if
    given), trained once eagerly and once through hs.compile (fullgraph=True unless said; with
    `compiled_again`, then torch.compile'd as accelerate does for HF's torch_compile=True); the two
    losses and all gradients compared (module docstring). With aot_eager, `collectives` are the
    forward and backward graphs' counts, and the only graphs."""

    def run(ids):
        import torch._dynamo

        torch._dynamo.reset()
        mesh, ids = ids.device_mesh, ids.full_tensor()  # plain: parallelize's input hook lays it out

        def parallelized():
            model = hs.parallelize(build(), mesh, **parallelize_kwargs)
            return shard(model, mesh) if shard is not None else model

        want = _train_once(parallelized(), ids)
        counter = GraphCounter()
        model = parallelized()
        hs.compile(model, backend=counter.backend() if backend == "aot_eager" else backend, fullgraph=fullgraph)
        got = _train_once(torch.compile(model) if compiled_again else model, ids)
        names = ["loss"] + [name for name, _ in model.named_parameters()]
        for index, (name, g, w) in enumerate(zip(names, got, want)):
            if w is None:  # a parameter this batch does not reach (a VLM's vision tower on text)
                # ... or reaches through no differentiable path (DeepSeek-V3.2's indexer feeds a
                # top-k's indices): no gradient compiled either (AOTAutograd's zeros are dropped:
                # AdamW would decay a parameter given a zero gradient)
                assert g is None, f"{name}: a gradient when compiled only"
                continue
            if isinstance(w, hs.DTensor):
                assert g.placements == w.placements, (name, g.placements, w.placements)
            # The loss: the same local ops in the same order (exact with aot_eager). A gradient:
            # a tensor used several times (the residual stream) gets its contributions summed by
            # autograd's engine in eager, in the joint graph's order when compiled -- float32
            # reassociation (measured: 2.2e-8 absolute on the embedding's gradient).
            exact = backend != "inductor" and (index == 0 or backend == "eager")
            _assert_close(g, w, EXACT if exact else FLOAT32, name)
        if collectives is not None:
            assert counter.collectives == list(collectives), (counter.collectives, collectives)
        if backend == "aot_eager":
            assert counter.collectives, "nothing was compiled"
        return got

    return run


def _fully_shard_after_compile(ids):
    mesh = ids.device_mesh
    model = hs.compile(hs.parallelize(_qwen3(), mesh), backend="aot_eager")
    _blocks_fully_sharded(model, mesh)
    return _train_once(model, ids.full_tensor())


def _linear_with_empty_weight_shard(x, w):
    """A module whose weight (one row over 2 ranks) has an empty shard on rank 1: its compiled
    forward runs eagerly on every rank, with one warning, and makes no graph."""
    import warnings

    torch._dynamo.reset()
    module = torch.nn.Linear(8, 1, bias=False)
    module.weight = torch.nn.Parameter(w.detach())
    counter = GraphCounter()
    hs.compile(module, backend=counter.backend(), fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = module(x)
    messages = [str(warning.message) for warning in caught]
    assert any("empty shard" in message for message in messages), messages
    assert counter.collectives == [], counter.collectives
    _assert_close(got, F.linear(x, w), EXACT, "output")
    return got


def _compile_head_tail(ids):
    return hs.compile(hs.parallelize(_qwen3(), ids.device_mesh), backend="aot_eager")


def model_cases():
    ids = [Input((2, 16), torch.int64, placements=["R"], init=randint(0, 128))]
    one_sequence = [Input((1, 16), torch.int64, placements=["R"], init=randint(0, 128))]
    return [
        # context parallelism in natural order (the sequence sharded by parallelize's input hook,
        # all-gather-KV attention); head-tail order is refused: transformers builds the causal
        # mask from natural positions while Dynamo traces
        Case(
            "qwen3_cp2_natural_aot_eager",
            fn=qwen3_step,
            inputs=one_sequence,
            mesh=CP2,
            check_grad=False,
            dist_fn=qwen3_traced("aot_eager", cp_load_balance=False),
        ),
        # two sequences per rank: each projection's 3-D linear keeps the sequence shard (the
        # batched product eager takes) instead of flattening (batch, sequence), which gathered the
        # sequence (16 collectives forward, 23 backward before)
        Case(
            "qwen3_cp2_two_sequences_aot_eager",
            fn=qwen3_step,
            inputs=ids,
            mesh=CP2,
            check_grad=False,
            dist_fn=qwen3_traced("aot_eager", (5, 8), cp_load_balance=False),
        ),
        Case(
            "qwen3_cp2_head_tail_refused",
            fn=qwen3_step,
            inputs=one_sequence,
            mesh=CP2,
            dist_fn=_compile_head_tail,
            expect_error="allowed: parallelize(..., cp_load_balance=False)",
        ),
        # expert parallelism: the experts' local program reads its routing, so parallelize's ep
        # hooks and the experts run eagerly between compiled graphs (no fullgraph)
        Case(
            "qwen3_vl_moe_ep2_aot_eager",
            fn=qwen3_vl_moe_step,
            inputs=ids,
            mesh=((2,), ("ep",)),
            check_grad=False,
            dist_fn=qwen3_traced("aot_eager", build=_qwen3_vl_moe, fullgraph=False),
        ),
        # tensor-parallel MoE: Qwen3.5-MoE's experts colwise / rowwise, their grouped products
        # (transformers' grouped_mm_fallback in float32) inside the graph, with the gated delta
        # net's linear attention. Inductor: torch 2.13's aot_eager fails this model's backward on
        # ONE device too (a view of the gated delta net's gradient whose real strides differ from
        # the traced ones); inductor lays out its buffers itself
        Case(
            "qwen3_5_moe_tp2_inductor",
            fn=qwen3_5_moe_step,
            inputs=ids,
            mesh=TP2,
            check_grad=False,
            dist_fn=qwen3_traced("inductor", build=_qwen3_5_moe),
        ),
        # fully_shard per block: each block's forward compiled (one program the blocks share:
        # one forward and one backward graph), its gather and reduce-scatter eager hooks around it
        Case(
            "qwen3_fully_shard_dp2_aot_eager",
            fn=qwen3_step,
            inputs=ids,
            mesh=((2,), ("dp",)),
            check_grad=False,
            dist_fn=qwen3_traced("aot_eager", (0, 0), shard=_blocks_fully_sharded),
        ),
        # DeepSeek-V3.2 fully sharded: its indexer's parameters get no gradient (they feed a
        # top-k's indices), which the groups' reduce-scatter must see as none, as eagerly
        Case(
            "deepseek_v32_fully_shard_dp2_aot_eager",
            fn=deepseek_v32_step,
            inputs=ids,
            mesh=((2,), ("dp",)),
            check_grad=False,
            dist_fn=qwen3_traced("aot_eager", build=_deepseek_v32, shard=_blocks_fully_sharded),
        ),
        # torch.compile of a model hs.compile made (a plain HF Trainer(torch_compile=True) does it):
        # the outer Dynamo runs hs.compile's forward as it is, so its program runs (its graphs,
        # counted), not the floor's, and no crash
        Case(
            "parameter_empty_shard_runs_eagerly",
            fn=F.linear,
            inputs=[Input((3, 8), placements=["R"]), Input((1, 8), placements=["S(0)"])],
            mesh=TP2,
            check_grad=False,
            dist_fn=_linear_with_empty_weight_shard,
        ),
        Case(
            "qwen3_fully_shard_after_compile_refused",
            fn=qwen3_step,
            inputs=ids,
            mesh=((2,), ("dp",)),
            dist_fn=_fully_shard_after_compile,
            expect_error="allowed: fully_shard first, then hypershard.compile",
        ),
        Case(
            "qwen3_tp2_compiled_again",
            fn=qwen3_step,
            inputs=ids,
            mesh=TP2,
            check_grad=False,
            dist_fn=qwen3_traced("aot_eager", (5, 4), compiled_again=True),
        ),
        Case(
            "qwen3_tp2_aot_eager",
            fn=qwen3_step,
            inputs=ids,
            mesh=TP2,
            check_grad=False,
            dist_fn=qwen3_traced("aot_eager", (5, 4)),
        ),
        # DeepSeek-V3.2 on tp2 in strict mode: its attention (a mask, value and query head dims
        # differing) takes the math path, whose matmul flattens the sharded heads (the traced view
        # gathers them, as eager's reshape does); the indexer feeds a top-k's indices only
        Case(
            "deepseek_v32_tp2_aot_eager",
            fn=deepseek_v32_step,
            inputs=ids,
            mesh=TP2,
            check_grad=False,
            dist_fn=qwen3_traced("aot_eager", build=_deepseek_v32),
        ),
    ]


def norm_beside_compute(x, y, w):
    """layer_norm over x's sharded dim (its rule all-gathers it) beside compute that does not need
    the gathered values: the wait of the gather can move below that compute."""
    return F.layer_norm(x, (x.shape[-1],)) * 2.0 + torch.tanh(y @ w) @ w


def waits_moved(x, y, w):
    """norm_beside_compute compiled by inductor with its compute/communication reordering
    (benchmarks/hsbench/compiled.py WAITS_MOVED): the forward program issues the all-gather, runs
    the independent products, and only then waits -- checked in inductor's generated code -- and
    the results (outputs and gradients) equal eager's within FLOAT32."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from hsbench.compiled import WAITS_MOVED

    torch._dynamo.reset()
    compiled = hs.compile(norm_beside_compute, backend="inductor", fullgraph=True, options=WAITS_MOVED)
    got, codes = run_and_get_code(compiled, x, y, w)
    forward = next(code for code in codes if "all_gather" in code)
    body = forward[forward.index("def call(") :]
    gather, wait, product = (body.index(s) for s in ("all_gather_into_tensor", "wait_tensor", "extern_kernels.mm"))
    assert gather < product < wait, "the gather's wait was not moved below the independent product"
    want = norm_beside_compute(x, y, w)
    check_against_eager(got, want, [x, y, w], lambda g, w, what: _assert_close(g, w, FLOAT32, what))
    return got


def reloaded_from_compile_cache(x, w):
    """matmul_relu compiled twice by inductor, the second time as a new process would: Dynamo reset
    and no traced spec alive. The backward's Partial gradient layout then exists only in the
    cached program; it is made again from its pickled recipe, so AOTAutograd's cache must hit
    (it missed, with a KeyError warning, when a spec could only be looked up)."""
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config
    from torch._dynamo.utils import counters

    from hypershard.tensor import traced as traced_module

    with torch._inductor.config.patch(force_disable_caches=False), torch._functorch.config.patch(
        enable_autograd_cache=True
    ):
        for attempt in range(2):
            torch._dynamo.reset()
            traced_module._LIVE_SPECS.clear()
            hits = counters["aot_autograd"]["autograd_cache_hit"]
            compiled = hs.compile(matmul_relu, backend="inductor", fullgraph=True)
            torch.autograd.grad(compiled(x, w).sum(), (x, w))  # compiles the backward too
        assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1, dict(counters["aot_autograd"])
        return compiled(x, w)  # the reloaded program, against one device


def placements_then_redistribute(x):
    """hypershard's DTensor API inside a compiled function: the placements read as data, then a
    redistribute (in the graph; on torch 2.11 / 2.12 the graph breaks there and it runs eagerly)."""
    scale = 2.0 if x.placements[0].is_shard() else 3.0
    return (x * scale).redistribute(x.device_mesh, [hs.Replicate()]).sin()


def alias_redistribute(x):
    return (x * 2.0).redistribute(x.device_mesh, ("None", "None")).sin()


def dtensor_api(x):
    import torch._dynamo

    torch._dynamo.reset()
    got = hs.compile(placements_then_redistribute, backend="aot_eager")(x)
    want = placements_then_redistribute(x)
    check_against_eager(got, want, [x], lambda g, w, what: _assert_close(g, w, EXACT, what))
    # a form the graph does not hold (alias notation): the graph breaks there, it runs eagerly
    try:
        hs.compile(alias_redistribute, backend="aot_eager", fullgraph=True)(x)
    except Exception as error:  # noqa: BLE001 -- Dynamo's Unsupported
        assert "hypershard DTensor redistribute" in str(error), error
    else:
        raise AssertionError("an alias-notation redistribute was traced into the graph")
    torch._dynamo.reset()
    got_alias = hs.compile(alias_redistribute, backend="aot_eager")(x)
    check_against_eager(got_alias, alias_redistribute(x), [x], lambda g, w, what: _assert_close(g, w, EXACT, what))
    return got


def inductor_option_cases():
    reload_inputs = [Input((6, 8), placements=["R"]), Input((8, 4), placements=["S(1)"])]
    waits_inputs = [Input((8, 16), placements=["S(1)"]), Input((8, 16), placements=["R"]), Input((16, 16), placements=["R"])]
    return [
        Case("reloaded_from_compile_cache", matmul_relu, reload_inputs, TP2, dist_fn=reloaded_from_compile_cache),
        Case("waits_moved_inductor", norm_beside_compute, waits_inputs, TP2, dist_fn=waits_moved),
        Case("dtensor_api_aot_eager", lambda x: (x * 2.0).sin(), [Input((6, 4), placements=["S(0)"])], TP2,
             dist_fn=dtensor_api),
    ]


def test_traced_matches_eager_and_one_device():
    cases = function_cases() + dtensor_method_cases() + model_cases() + inductor_option_cases()
    assert_all_passed(run_cases(cases, timeout=600))


def _dropping_hook_collectives(dist_fn):
    """dist_fn with the traced replicate_on skipping its all-reduce while compiling: each rank takes
    its own partial sum of a rowwise output for the whole (the layout says Replicate, the values
    are wrong)."""

    def run(*inputs):
        from hypershard import _C
        from hypershard.tensor import traced as traced_module

        op = torch.ops.hypershard.replicate_on.default
        kept = traced_module._SPECIAL[op]

        def unreduced(dt, axis):
            layout = _C.layout_of(dt)
            if not layout.is_partial(axis):  # lm_head's gather stays
                return kept(dt, axis)
            replicate = traced_module._without_partial(layout)
            return _C.wrap_local(_C.local_of(dt).clone(), _C.device_mesh_of(dt), replicate, list(dt.stride()), 0)

        traced_module._SPECIAL[op] = unreduced
        try:
            return dist_fn(*inputs)
        finally:
            traced_module._SPECIAL[op] = kept

    return run


def test_planted_fault_would_be_caught():
    """The checks can fail: the hooks' all-reduces left out of the traced graph."""
    ids = [Input((2, 16), torch.int64, placements=["R"], init=randint(0, 128))]
    cases = [
        Case(
            "planted_no_hook_all_reduce",
            fn=qwen3_step,
            inputs=ids,
            mesh=TP2,
            check_grad=False,
            dist_fn=_dropping_hook_collectives(qwen3_traced("aot_eager")),
        )
    ]
    results = run_cases(cases, timeout=300)
    result = results["planted_no_hook_all_reduce"]
    assert not result.passed and "loss: compiled differs from eager" in result.message, result.message
