"""UT: rules users register from Python (hs.register_rule), planned without processes: sharding
that follows the labels, Partial(sum) for a contraction and carried through a linear operand, a
gathered `whole` label, and the refusals (malformed rules, a native op, shapes the labels do not
fit) -- each a clear error naming the op."""

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import PlanningMesh, plan


@torch.library.custom_op("hs_ut::scaled_matmul", mutates_args=())
def scaled_matmul(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (a @ b) * s


@scaled_matmul.register_fake
def _(a, b, s):
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("hs_ut::row_norm", mutates_args=())
def row_norm(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


@row_norm.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("hs_ut::unregistered", mutates_args=())
def unregistered(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@unregistered.register_fake
def _(x):
    return torch.empty_like(x)


hs.register_rule(scaled_matmul, "mk,kn,.->mn", linear=(0, 1))
hs.register_rule(row_norm, "bd->bd", whole="d")

MESH = PlanningMesh({"dp": 2, "tp": 2})
SCALE = MESH.dtensor([1], ["R", "R"])


def test_rows_and_columns_follow_their_labels():
    p = plan(scaled_matmul._opoverload, MESH.dtensor([4, 6], ["S(0)", "R"]), MESH.dtensor([6, 8], ["R", "S(1)"]), SCALE)
    assert p.output_specs == [["S(0)", "S(1)"]]
    assert p.input_specs[:2] == [["S(0)", "R"], ["R", "S(1)"]]


def test_contraction_gives_partial_sum():
    p = plan(scaled_matmul._opoverload, MESH.dtensor([4, 6], ["R", "S(1)"]), MESH.dtensor([6, 8], ["R", "S(0)"]), SCALE)
    assert p.output_specs == [["R", "P"]]


def test_partial_carried_through_a_linear_operand():
    p = plan(scaled_matmul._opoverload, MESH.dtensor([4, 6], ["P", "R"]), MESH.dtensor([6, 8], ["R", "R"]), SCALE)
    assert p.output_specs == [["P", "R"]]
    assert p.input_specs[0] == ["P", "R"]  # carried, not reduced


def test_whole_label_is_gathered():
    p = plan(row_norm._opoverload, MESH.dtensor([4, 6], ["S(0)", "S(1)"]))
    assert p.input_specs == [["S(0)", "R"]]  # d gathered over tp, rows stay sharded over dp
    assert p.output_specs == [["S(0)", "R"]]


def test_partial_into_a_nonlinear_operand_is_reduced():
    p = plan(row_norm._opoverload, MESH.dtensor([4, 6], ["P", "R"]))
    assert p.input_specs == [["R", "R"]]


@pytest.mark.parametrize(
    "factors, kwargs, message",
    [
        ("ab,b", {}, 'has no "->"'),
        ("ab,b->c", {}, "result label 'c'"),
        ("aa->a", {}, "label 'a' twice"),
        ("a1->a", {}, "label '1'"),
        ("ab->ab", {"whole": "z"}, "whole label 'z'"),
        ("ab->ab", {"linear": (3,)}, "out of range"),
    ],
)
def test_malformed_rules_are_refused(factors, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        hs.register_rule(unregistered, factors, **kwargs)
    assert "hs_ut::unregistered" in str(info.value)


def test_native_rule_is_not_replaced():
    with pytest.raises(ValueError, match="aten::mm: has a native rule"):
        hs.register_rule(torch.ops.aten.mm.default, "mk,kn->mn")


def test_shapes_the_labels_do_not_fit():
    with pytest.raises((RuntimeError, ValueError), match="differs from 6 in another operand"):
        plan(scaled_matmul._opoverload, MESH.dtensor([4, 6], ["R", "R"]), MESH.dtensor([5, 8], ["R", "R"]), SCALE)
    with pytest.raises((RuntimeError, ValueError), match="has 3 dims"):
        plan(row_norm._opoverload, MESH.dtensor([4, 6, 2], ["R", "R"]))
