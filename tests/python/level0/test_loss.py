"""Level 0: the loss family (csrc/ops/loss.cpp) -- softmax, log_softmax, nll_loss(2d) and
cross_entropy, forward and backward -- on real multi-process gloo meshes, through
hypershard.testing.

Every case compares the global forward values and the input gradients (backward of a seeded
random cotangent) with one process. Logits are sharded on the batch dims, on the class
(vocabulary) dim -- vocab-parallel cross entropy, on 1-D and 2-D meshes, the class dim split over
one or both axes -- or both; vocabularies are uneven (7 over 2 and 2x2, 7 and 6 over 4: 6 gives
an empty shard) and so are batches (5 over 4). Targets contain ignored entries (-100, or an
in-range ignore_index); reductions none/sum/mean, label_smoothing 0 and 0.1, class weights
Replicate or sharded like the class dim; 3-D logits flattened as HF models do (view(-1, V)),
3-D and 4-D logits (nll_loss2d). Vocab-parallel cases also check that the forward never moves
the logits (bytes sent far below one gather) and the output layout (none: rows sharded,
Replicate on the class axes; sum: Partial(sum); mean: Replicate).

Cases share one launch per world size (2 ranks for mesh (2,), 4 for (4,) and (2, 2)).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

hs = pytest.importorskip("hypershard")
from hypershard.testing import Case, Input, layout_problems, run_cases, uniform  # noqa: E402

try:
    from transformers.loss.loss_utils import ForCausalLMLoss
except ImportError:  # transformers is optional here
    ForCausalLMLoss = None

LAUNCH_TIMEOUT_S = 240

M2 = ((2,), ("x",))
M4 = ((4,), ("x",))
M22 = ((2, 2), ("x", "y"))
IGNORE = -100
REDUCTIONS = ("none", "sum", "mean")


# ---------------------------------------------------------------------------------- inputs

def targets(n_classes, ignore=IGNORE, every=3):
    """Class ids in [0, n_classes) with every `every`-th entry set to `ignore`."""
    def init(shape, dtype, generator):
        t = torch.randint(0, n_classes, shape, generator=generator, dtype=torch.int64)
        flat = t.view(-1)
        flat[1::every] = ignore
        return t.to(dtype)
    return init


def X(shape, placements=None, grad=True, plain=False):  # logits
    return Input(shape, placements=placements, requires_grad=grad, plain=plain)


def T(shape, n_classes, placements=None, ignore=IGNORE, plain=False):  # targets
    return Input(shape, torch.int64, placements=placements, init=targets(n_classes, ignore), plain=plain)


def W(n_classes, placements=None, plain=False):  # class weights
    return Input((n_classes,), placements=placements, init=uniform(0.5, 2.0), requires_grad=False, plain=plain)


# ---------------------------------------------------------------------------------- checks

def checked(fn, expect=None, max_bytes=None):
    """`fn` for the distributed run, asserting output 0's layout (placements, or (alias,
    partial)) and that the forward sent at most `max_bytes` (vocab-parallel: no logits gather)."""

    def run(*args):
        hs._C.reset_traffic()
        out = fn(*args)
        sent = hs._C.traffic()["bytes_sent"]
        first = out[0] if isinstance(out, (tuple, list)) else out
        problems = layout_problems(first, expect)
        if max_bytes is not None and sent > max_bytes:
            problems.append(f"forward sent {sent} bytes, more than {max_bytes} (a gather of the logits?)")
        if problems:
            raise AssertionError("; ".join(problems))
        return out

    return run


def C(name, fn, inputs, mesh=M2, expect=None, max_bytes=None, **kw):
    dist_fn = checked(fn, expect, max_bytes) if expect is not None or max_bytes is not None else None
    return Case(name, fn=fn, inputs=inputs, mesh=mesh, dist_fn=dist_fn, **kw)


def ce(reduction="mean", ls=0.0, ignore=IGNORE, weighted=False):
    if weighted:
        return lambda x, t, w: F.cross_entropy(x, t, weight=w, reduction=reduction, label_smoothing=ls,
                                               ignore_index=ignore)
    return lambda x, t: F.cross_entropy(x, t, reduction=reduction, label_smoothing=ls, ignore_index=ignore)


def nll(reduction="mean", ignore=IGNORE, weighted=False):
    if weighted:
        return lambda x, t, w: F.nll_loss(F.log_softmax(x, 1), t, weight=w, reduction=reduction, ignore_index=ignore)
    return lambda x, t: F.nll_loss(F.log_softmax(x, 1), t, reduction=reduction, ignore_index=ignore)


def hf_ce(reduction="mean", ls=0.0):
    """What HF causal-LM losses do: flatten (batch, seq, vocab) logits and the labels."""
    def fn(logits, labels):
        vocab = logits.shape[-1]
        return F.cross_entropy(logits.float().view(-1, vocab), labels.view(-1), ignore_index=IGNORE,
                               reduction=reduction, label_smoothing=ls)
    return fn


def nll_forward(reduction, ignore=IGNORE):  # both outputs: the loss and total_weight
    code = {"none": 0, "mean": 1, "sum": 2}[reduction]
    return lambda x, t, w: torch.ops.aten.nll_loss_forward(x.log_softmax(1), t, w, code, ignore)


def softmax(dim):
    return lambda x: F.softmax(x, dim)


def log_softmax(dim):
    return lambda x: F.log_softmax(x, dim)


def mm_after(op):  # the gradient reaching op is a Partial(sum) when w's columns are sharded
    return lambda x, w: torch.mm(op(x, -1), w)


def expected_loss_layout(reduction, mesh, rows):
    """Vocab-parallel loss layout: none: the rows' sharding (alias of the target dims), Replicate
    on the class axes; sum: Partial(sum) on every sharding axis; mean: Replicate."""
    names = mesh[1]
    if reduction == "none":
        return (rows, None)
    if reduction == "sum":
        return ["P"] * len(names)
    return ["R"] * len(names)


# ---------------------------------------------------------------------------------- cases

def _softmax_cases(c):
    for mesh, shapes in ((M2, [((4, 7), ["S(0)"]), ((4, 7), ["S(1)"]), ((5, 3), ["S(0)"])]),
                         (M4, [((5, 6), ["S(1)"]), ((6, 7), ["S(1)"]), ((5, 4), ["S(0)"])]),
                         (M22, [((4, 7), ["S(0)", "S(1)"]), ((4, 7), ["S(1)", "S(1)"]), ((3, 5), ["S(1)", "S(0)"])])):
        tag = "x".join(map(str, mesh[0]))
        for shape, pl in shapes:
            name = f"{tag}|{list(shape)}{pl}"
            for dim in (-1, 0):
                c.append(C(f"softmax{dim}|{name}", softmax(dim), [X(shape, pl)], mesh=mesh, expect=pl))
                c.append(C(f"log_softmax{dim}|{name}", log_softmax(dim), [X(shape, pl)], mesh=mesh, expect=pl))
    # sharded softmax dim on 3-D, a float64 log_softmax (a _to_copy first)
    c.append(C("softmax|2|3d_S2", softmax(-1), [X((2, 3, 7), ["S(2)"])], expect=["S(2)"]))
    c.append(C("log_softmax|2|3d_S1_dim1", log_softmax(1), [X((2, 5, 3), ["S(1)"])], expect=["S(1)"]))
    c.append(C("log_softmax_f64|2|S1", lambda x: F.log_softmax(x, -1, dtype=torch.float64), [X((4, 7), ["S(1)"])],
               rtol=1e-5, atol=1e-6))
    c.append(C("log_softmax|22|classes_yx", log_softmax(-1), [X((3, 7), ("None", ("y", "x")))], mesh=M22,
               expect=(("None", ("y", "x")), None)))
    # vocab-parallel softmax moves no logits: two all-reduces of one value per row
    c.append(C("log_softmax|4|no_gather", log_softmax(-1), [X((4, 64), ["S(1)"])], mesh=M4, max_bytes=4 * 64))
    # a Partial(sum) gradient (mm with w's columns sharded) passes through the backward ops
    for op_name, op in (("softmax", F.softmax), ("log_softmax", F.log_softmax)):
        c.append(C(f"{op_name}_partial_grad|2", mm_after(op), [X((4, 6)), X((6, 8), ["S(1)"])]))
        c.append(C(f"{op_name}_partial_grad|2|vocab", mm_after(op), [X((4, 6), ["S(1)"]), X((6, 8), ["S(1)"])]))
        c.append(C(f"{op_name}_partial_grad|22", mm_after(op), [X((4, 6), ["R", "S(1)"]), X((6, 8), ["S(1)", "R"])],
                   mesh=M22))
    # Partial inputs are errors, on every rank
    for op_name in ("softmax", "log_softmax"):
        fn = softmax(-1) if op_name == "softmax" else log_softmax(-1)
        c.append(Case(f"{op_name}_partial_error|2", fn=fn, inputs=[X((4, 6), ["P"])], mesh=M2,
                      expect_error=f"aten::_{op_name}: argument self (#0)"))
        c.append(Case(f"{op_name}_partial_error|22", fn=fn, inputs=[X((4, 6), ["S(0)", "P"])], mesh=M22,
                      expect_error="Partial(sum) input is not supported"))


# (logits placements, targets placements, weight placements, rows alias of the loss for none)
LAYOUTS = {
    M2: [
        ("batch", (6, 7), ["S(0)"], ["S(0)"], ["R"], ("x",)),
        ("vocab", (6, 7), ["S(1)"], ["R"], ["S(0)"], ("None",)),
        ("vocab_wR", (6, 7), ["S(1)"], ["R"], ["R"], ("None",)),
        ("vocab_tS0", (5, 7), ["S(1)"], ["S(0)"], ["S(0)"], ("None",)),  # targets gathered (small)
        ("logitsR_tS0", (6, 7), ["R"], ["S(0)"], ["R"], ("x",)),          # logits chunked like targets
    ],
    M4: [
        ("batch_uneven", (5, 6), ["S(0)"], ["S(0)"], ["R"], ("x",)),      # 2, 2, 1, 0 rows
        ("vocab7", (5, 7), ["S(1)"], ["R"], ["S(0)"], ("None",)),          # 2, 2, 2, 1 classes
        ("vocab6_empty", (4, 6), ["S(1)"], ["R"], ["S(0)"], ("None",)),    # 2, 2, 2, 0 classes
    ],
    M22: [
        ("dp_tp", (6, 7), ["S(0)", "S(1)"], ["S(0)", "R"], ["R", "S(0)"], ("x",)),
        ("vocab_xy", (5, 7), ["S(1)", "S(1)"], ["R", "R"], ["S(0)", "S(0)"], ("None",)),
        ("tp_dp", (6, 7), ["S(1)", "S(0)"], ["R", "S(0)"], ["R", "R"], ("y",)),
        ("batch_xy", (7, 5), ["S(0)", "S(0)"], ["S(0)", "S(0)"], ["R", "R"], (("x", "y"),)),
    ],
}


def _loss_cases(c):
    for mesh, layouts in LAYOUTS.items():
        tag = "x".join(map(str, mesh[0]))
        for lname, shape, xp, tp, wp, rows in layouts:
            n, v = shape
            vocab = any(p == "S(1)" for p in xp)
            for red in REDUCTIONS:
                expect = expected_loss_layout(red, mesh, rows) if vocab else None
                for ls in (0.0, 0.1):
                    base = f"{tag}|{lname}|{red}|ls{ls}"
                    c.append(C(f"ce|{base}", ce(red, ls), [X(shape, xp), T((n,), v, tp)], mesh=mesh,
                               expect=expect))
                    c.append(C(f"ce_w|{base}", ce(red, ls, weighted=True), [X(shape, xp), T((n,), v, tp), W(v, wp)],
                               mesh=mesh, expect=expect))
                c.append(C(f"nll|{tag}|{lname}|{red}", nll(red), [X(shape, xp), T((n,), v, tp)], mesh=mesh,
                           expect=expect))
                c.append(C(f"nll_forward_total_weight|{tag}|{lname}|{red}", nll_forward(red),
                           [X(shape, xp), T((n,), v, tp), W(v, wp)], mesh=mesh))
            # an ignore_index that is a valid class id, plain targets and weights
            c.append(C(f"ce_ignore2|{tag}|{lname}", ce("mean", 0.1, ignore=2, weighted=True),
                       [X(shape, xp), T((n,), v, tp, ignore=2), W(v, wp)], mesh=mesh))
            c.append(C(f"ce_plain_target_weight|{tag}|{lname}", ce("sum", 0.1, weighted=True),
                       [X(shape, xp), T((n,), v, plain=True), W(v, plain=True)], mesh=mesh))


def _no_gather_cases(c):
    # Vocab-parallel cross entropy never moves the logits: the forward sends a few values per
    # row (max, sum-exp, picked log-prob / smoothing term), far below a quarter of the logits.
    # (mesh, logits, targets, weight sharded like the class dim, rows alias of a none loss)
    layouts = ((M2, ["S(1)"], ["R"], ["S(0)"], ("None",)),
               (M4, ["S(1)"], ["R"], ["S(0)"], ("None",)),
               (M22, ["S(1)", "S(1)"], ["R", "R"], ["S(0)", "S(0)"], ("None",)),
               (M22, ["S(0)", "S(1)"], ["S(0)", "R"], ["R", "S(0)"], ("x",)))
    for mesh, xp, tp, wp, rows in layouts:
        tag = "x".join(map(str, mesh[0]))
        for red in REDUCTIONS:
            for ls in (0.0, 0.1):
                c.append(C(f"ce_no_gather|{tag}|{xp}|{red}|ls{ls}", ce(red, ls, weighted=True),
                           [X((4, 64), xp), T((4,), 64, tp), W(64, wp)],
                           mesh=mesh, expect=expected_loss_layout(red, mesh, rows), max_bytes=4 * 64))


def lm_head_ce(reduction, ls):
    """Logits from an LM head (hidden @ W^T, W's rows = the vocabulary), then cross entropy."""
    return lambda h, w, t: F.cross_entropy(h @ w.t(), t, reduction=reduction, label_smoothing=ls, ignore_index=IGNORE)


def _model_cases(c):
    # an LM head sharded on the vocabulary (x data-parallel on (2, 2)): gradients of the hidden
    # states and of the head through vocab-parallel cross entropy
    for mesh, hp, wp, tp in ((M2, ["R"], ["S(0)"], ["R"]), (M4, ["R"], ["S(0)"], ["R"]),
                             (M22, ["S(0)", "R"], ["R", "S(0)"], ["S(0)", "R"])):
        tag = "x".join(map(str, mesh[0]))
        for red in REDUCTIONS:
            c.append(C(f"lm_head|{tag}|{red}", lm_head_ce(red, 0.1), [X((6, 5), hp), X((7, 5), wp), T((6,), 7, tp)],
                       mesh=mesh))
    # bfloat16 logits (collectives in float32). One device rounds every op of the composite to
    # bfloat16 in its own order; gradients agree to a few bfloat16 ulps of O(1) values, while a
    # wrong pick, mask or total would be off by O(0.1).
    for mesh, xp in ((M2, ["S(1)"]), (M22, ["S(0)", "S(1)"])):
        tag = "x".join(map(str, mesh[0]))
        for red in REDUCTIONS:
            c.append(C(f"ce_bf16|{tag}|{xp}|{red}", ce(red, 0.1),
                       [Input((6, 7), torch.bfloat16, placements=xp), T((6,), 7, ["R"] * len(xp))], mesh=mesh,
                       atol=1e-2))
        c.append(C(f"softmax_bf16|{tag}|{xp}", softmax(-1), [Input((6, 7), torch.bfloat16, placements=xp)], mesh=mesh,
                   atol=1e-2))


def _shape_cases(c):
    # HF causal LM: (batch, seq, vocab) logits, view(-1, V)
    for mesh, lp, tp in ((M2, ["S(0)"], ["S(0)"]), (M2, ["S(2)"], ["R"]), (M4, ["S(2)"], ["R"]),
                         (M22, ["S(0)", "S(2)"], ["S(0)", "R"]), (M22, ["S(2)", "S(2)"], ["R", "R"])):
        tag = "x".join(map(str, mesh[0]))
        for red in REDUCTIONS:
            for ls in (0.0, 0.1):
                c.append(C(f"hf|{tag}|{lp}|{red}|ls{ls}", hf_ce(red, ls), [X((2, 3, 7), lp), T((2, 3), 7, tp)],
                           mesh=mesh))
    # transformers' own causal-LM loss (pad + shift the labels, flatten, cross_entropy; sum /
    # num_items_in_batch when given)
    if ForCausalLMLoss is not None:
        for mesh, lp, tp in ((M2, ["S(0)"], ["S(0)"]), (M2, ["S(2)"], ["R"]), (M4, ["S(2)"], ["R"]),
                             (M22, ["S(0)", "S(2)"], ["S(0)", "R"])):
            tag = "x".join(map(str, mesh[0]))
            for items in (None, 5):
                c.append(C(f"hf_causal_lm_loss|{tag}|{lp}|items{items}",
                           lambda l, t, items=items: ForCausalLMLoss(l, t, vocab_size=7, num_items_in_batch=items),
                           [X((2, 4, 7), lp), T((2, 4), 7, tp)], mesh=mesh))
    # 3-D and 4-D logits with the class dim 1 (nll_loss2d after a view for 3-D)
    for mesh, shape, xp, tp in ((M2, (2, 7, 3), ["S(1)"], ["R"]), (M2, (2, 7, 3), ["S(0)"], ["S(0)"]),
                                (M2, (3, 5, 4), ["S(2)"], ["S(1)"]), (M2, (2, 7, 2, 3), ["S(1)"], ["R"]),
                                (M4, (2, 7, 2, 2), ["S(1)"], ["R"]),
                                (M22, (2, 7, 3, 2), ["S(0)", "S(1)"], ["S(0)", "R"]),
                                (M22, (4, 5, 3), ["S(2)", "S(0)"], ["S(0)", "S(1)"])):
        tag = "x".join(map(str, mesh[0]))
        rows = (shape[0],) + shape[2:]
        for red in REDUCTIONS:
            c.append(C(f"ce_nd|{tag}|{list(shape)}{xp}|{red}", ce(red, 0.1, weighted=True),
                       [X(shape, xp), T(rows, shape[1], tp), W(shape[1])], mesh=mesh))
            c.append(C(f"nll_nd|{tag}|{list(shape)}{xp}|{red}", nll(red), [X(shape, xp), T(rows, shape[1], tp)],
                       mesh=mesh))
    # unbatched: logits (C,), a 0-d target
    for mesh, xp in ((M2, ["S(0)"]), (M4, ["S(0)"]), (M22, ["S(0)", "S(0)"])):
        tag = "x".join(map(str, mesh[0]))
        for red in ("sum", "mean"):
            c.append(C(f"ce_1d|{tag}|{red}", ce(red, 0.1),
                       [X((7,), xp), Input((), torch.int64, init=lambda s, d, g: torch.tensor(5))], mesh=mesh))
    # every target ignored: mean is nan (0 / 0) on one device too
    c.append(C("ce_all_ignored|2|vocab", ce("mean"),
               [X((4, 7), ["S(1)"]), Input((4,), torch.int64, init=lambda s, d, g: torch.full(s, IGNORE))],
               ))


def weighted_tokens(x, t, v):  # per-token losses weighted by v: a Partial v gives a Partial grad
    return torch.dot(F.cross_entropy(x, t, reduction="none"), v)


def _partial_grad_cases(c):
    # the gradient of a none loss is Partial(sum) on y: kept through nll_loss_backward and
    # _log_softmax_backward_data (linear in the gradient) where self is not sharded on y
    c.append(C("nll_backward_partial_grad|22", weighted_tokens,
               [X((6, 7), ["S(0)", "R"]), T((6,), 7, ["S(0)", "R"]), X((6,), ["R", "P"])], mesh=M22))
    c.append(C("nll_backward_partial_grad|2", weighted_tokens, [X((6, 7), ["R"]), T((6,), 7), X((6,), ["P"])]))
    # ... and an error where the classes are sharded on y: every shard needs the whole gradient
    c.append(Case("nll_backward_partial_grad_on_class_axis|22", fn=weighted_tokens,
                  inputs=[X((6, 7), ["S(0)", "S(1)"]), T((6,), 7, ["S(0)", "R"]), X((6,), ["R", "P"])], mesh=M22,
                  expect_error="aten::nll_loss_backward: argument grad_output (#0)"))


def _error_cases(c):
    c.append(Case("ce_partial_logits|2", fn=ce("mean"), inputs=[X((4, 7), ["P"]), T((4,), 7)], mesh=M2,
                  expect_error="aten::_log_softmax: argument self (#0)"))
    c.append(Case("nll_partial_weight|2", fn=nll("mean", weighted=True),
                  inputs=[X((4, 7), ["S(1)"]), T((4,), 7), W(7, ["P"])], mesh=M2,
                  expect_error="aten::nll_loss_forward: argument weight (#2)"))
    c.append(Case("nll_forward_target_shape|2", fn=lambda x, t: torch.ops.aten.nll_loss_forward(x, t, None, 1, -100),
                  inputs=[X((4, 7), ["S(1)"]), T((5,), 7)], mesh=M2,
                  expect_error="aten::nll_loss_forward: argument target (#1)"))
    c.append(Case("nll_forward_weight_size|22", fn=lambda x, t, w: torch.ops.aten.nll_loss_forward(x, t, w, 1, -100),
                  inputs=[X((4, 7), ["S(0)", "S(1)"]), T((4,), 7), W(6)], mesh=M22,
                  expect_error="argument weight (#2)"))
    c.append(Case("ce_target_out_of_range|2|vocab", fn=ce("sum"),
                  inputs=[X((4, 7), ["S(1)"]), Input((4,), torch.int64, init=lambda s, d, g: torch.tensor([1, 9, 2, 3]))],
                  mesh=M2, expect_error="Target 9 is out of bounds"))


def _cases():
    c = []
    _softmax_cases(c)
    _loss_cases(c)
    _no_gather_cases(c)
    _model_cases(c)
    _shape_cases(c)
    _partial_grad_cases(c)
    _error_cases(c)
    return c


CASES = _cases()


@pytest.fixture(scope="module")
def results():
    start = time.perf_counter()
    result = run_cases(CASES, timeout=LAUNCH_TIMEOUT_S)
    print(f"\ntest_loss: {len(CASES)} cases in {time.perf_counter() - start:.1f} s ({len(result.launches)} launches)")
    return result


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_loss(case: Case, results):
    results.check(case.name)
