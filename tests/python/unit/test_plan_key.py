"""UT: the plan-cache key (csrc/runtime/plan_key.h) never lets two different calls share a plan.

Each test below tries to make two calls that differ in one argument get equal keys -- None
against a dim, a negative against a positive dim, an int against a float or a bool, one dtype
against another, an absent optional tensor in one position against another, lists of other
lengths or values -- and checks that the keys differ; the same call twice must get the same key
(else nothing would ever be cached). Then the cache is exercised through the dispatcher: calls
that once shared a plan (argmax without a dim, then with dim=-7) must each get their own result.
The fast path writes the same key from typed arguments; its check mode compares the two on every
call it takes.
"""

import itertools

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh

aten = torch.ops.aten


def key(op, *args, **kwargs):
    schema = op._schema
    return tuple(hs._C.plan_key(schema.name, schema.overload_name, *args, **kwargs))


def assert_all_distinct(calls):
    keys = {}
    for label, k in calls:
        assert k not in keys, f"calls {keys[k]!r} and {label!r} share one plan key"
        keys[k] = label


@pytest.fixture(scope="module")
def mesh():
    return PlanningMesh({"tp": 2})


SHAPE = [2, 2, 2, 2, 2, 2, 4]


def test_dims_none_negative_positive_and_flags_differ(mesh):
    d = mesh.dtensor(SHAPE, ["S(6)"])
    dims = [None] + list(range(-7, 7))
    calls = [((dim, keepdim), key(aten.argmax.default, d, dim, keepdim))
             for dim, keepdim in itertools.product(dims, [False, True])]
    assert_all_distinct(calls)


def test_same_call_same_key(mesh):
    a = mesh.dtensor(SHAPE, ["S(6)"])
    b = mesh.dtensor(SHAPE, ["S(6)"])  # another tensor, the same layout
    assert key(aten.argmax.default, a, -7) == key(aten.argmax.default, b, -7)
    assert key(aten.sum.dim_IntList, a, [0, 1]) == key(aten.sum.dim_IntList, b, [0, 1])


def test_scalar_kinds_and_values_differ(mesh):
    # new_full's rule reads its scalars (KeyScalars::kAll); mul.Scalar's does not (its plan is the
    # same for every factor), so its keys are equal by design.
    d = mesh.dtensor([4, 6], ["S(0)"])
    calls = [(repr(v), key(aten.new_full.default, d, [4, 6], v)) for v in [2, 2.0, True, 1, 1.0, -0.0, 0.0, 0, False]]
    assert_all_distinct(calls)
    assert key(aten.mul.Scalar, d, 2) == key(aten.mul.Scalar, d, 3.5)


def test_dtypes_differ(mesh):
    calls = []
    for dtype in [torch.float32, torch.bfloat16, torch.float64, torch.int64]:
        d = mesh.dtensor([4, 6], ["S(0)"], dtype=dtype)
        calls.append((f"input {dtype}", key(aten.sum.dim_IntList, d, [1])))
    d = mesh.dtensor([4, 6], ["S(0)"])
    for dtype in [torch.float32, torch.float64, torch.bfloat16]:
        calls.append((f"dtype= {dtype}", key(aten.sum.dim_IntList, d, [1], False, dtype=dtype)))
    assert_all_distinct(calls)
    # dtype=None spelled out is the default: the same call
    assert key(aten.sum.dim_IntList, d, [1], False, dtype=None) == key(aten.sum.dim_IntList, d, [1])


def test_int_lists_differ(mesh):
    d = mesh.dtensor([4, 6, 8], ["S(0)"])
    lists = [[], [0], [1], [0, 1], [1, 0], [-1], [-3], [0, 1, 2], [2]]
    calls = [(f"{dims} keepdim={k}", key(aten.sum.dim_IntList, d, dims, k)) for dims in lists for k in (False, True)]
    calls.append(("None", key(aten.sum.dim_IntList, d, None)))
    assert_all_distinct(calls)


def test_float_lists_and_strings_differ(mesh):
    x = mesh.dtensor([2, 3, 4, 4], ["S(0)"])
    scales = [(2.0, 2.0), (3.0, 3.0), (2.0, 3.0), (None, None), (2.0, None), (None, 2.0), (-0.0, 0.0)]
    calls = [(f"scales {s}", key(aten.upsample_nearest2d.default, x, [8, 8], *s)) for s in scales]
    calls.append(("size [8, 12]", key(aten.upsample_nearest2d.default, x, [8, 12])))
    assert_all_distinct(calls)
    boundaries, values = mesh.dtensor([4, 6], ["R"]), mesh.dtensor([4, 3], ["S(0)"])
    sides = [(repr(side), key(aten.searchsorted.Tensor, boundaries, values, side=side)) for side in (None, "left", "right")]
    assert_all_distinct(sides)


def test_layouts_and_plain_shapes_differ(mesh):
    calls = []
    for spec in (["R"], ["S(0)"], ["S(1)"], ["P"]):
        calls.append((f"layout {spec}", key(aten.mul.Tensor, mesh.dtensor([4, 6], spec), mesh.dtensor([4, 6], ["R"]))))
    d = mesh.dtensor([4, 6], ["S(0)"])
    for shape in ([6], [1, 6], [4, 1], []):
        calls.append((f"plain {shape}", key(aten.mul.Tensor, d, torch.ones(shape))))
    assert_all_distinct(calls)


def test_absent_optional_tensors_keep_their_position(mesh):
    x = mesh.dtensor([4, 6], ["S(0)"])
    w = mesh.dtensor([6], ["R"])
    calls = [
        ("weight only", key(aten.native_layer_norm.default, x, [6], w, None, 1e-5)),
        ("bias only", key(aten.native_layer_norm.default, x, [6], None, w, 1e-5)),
        ("neither", key(aten.native_layer_norm.default, x, [6], None, None, 1e-5)),
        ("both", key(aten.native_layer_norm.default, x, [6], w, w, 1e-5)),
    ]
    assert_all_distinct(calls)


def test_tensor_lists_differ(mesh):
    a, b = mesh.dtensor([4, 6], ["S(0)"]), mesh.dtensor([4, 6], ["S(0)"])
    c = mesh.dtensor([4, 6], ["S(1)"])
    calls = [
        ("[a, b] 0", key(aten.cat.default, [a, b], 0)),
        ("[a, b] 1", key(aten.cat.default, [a, b], 1)),
        ("[a, b] -1", key(aten.cat.default, [a, b], -1)),
        ("[a, b, a] 0", key(aten.cat.default, [a, b, a], 0)),
        ("[a, c] 0", key(aten.cat.default, [a, c], 0)),
        ("[a] 0", key(aten.cat.default, [a], 0)),
    ]
    assert_all_distinct(calls)


def test_calls_that_once_shared_a_plan_get_their_own(mesh):
    # One rank, so that the ops run through the dispatcher and its caches on meta tensors
    # without any collective; the key does not depend on the mesh's size.
    one = PlanningMesh({"tp": 1})
    with hs.strict():
        for first, second in [(None, -7), (-7, None)]:
            d = one.dtensor(SHAPE, ["S(6)"])
            results = [torch.argmax(d) if dim is None else torch.argmax(d, dim=dim) for dim in (first, second)]
            for dim, result in zip((first, second), results):
                expected = torch.argmax(torch.empty(SHAPE, device="meta"), dim=dim)
                assert list(result.shape) == list(expected.shape), f"argmax(dim={dim}) after argmax(dim={first})"


def test_fast_path_writes_the_boxed_key():
    one = PlanningMesh({"tp": 1})
    a = one.dtensor([4, 6], ["S(0)"])
    b = one.dtensor([4, 6], ["S(0)"])
    w = one.dtensor([6, 5], ["R"])
    hs._C.set_key_check(True)
    before = hs._C.dispatch_stats()["fast_calls"]
    try:
        for _ in range(2):  # the first call fills the fast path's slot, the second runs it
            torch.add(a, b, alpha=2)
            a * 2
            a * 2.5
            torch.where(a > 0, a, b)
            a.view(24)
            a.sum(dim=1, keepdim=True)
            a.sum(dim=[0, 1])
            a.to(torch.float64)
            a.mean(dim=[1])
            torch.mm(a, w)
            torch.softmax(a, dim=-1)
            a.transpose(0, 1)
            torch._foreach_add_([a, b], [b, a], alpha=0.5)
            torch._foreach_mul_([a, b], 0.9)
    finally:
        hs._C.set_key_check(False)
    assert hs._C.dispatch_stats()["fast_calls"] > before, "no call took the fast path"
