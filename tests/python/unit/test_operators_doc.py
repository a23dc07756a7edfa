"""UT: docs/operators.md is what `python -m hypershard.tools.operators_doc` writes from the registry.

The generator traces PyTorch's OpInfo samples once (the module fixture, ~15 s on 2 cores), then
probes every rule without processes. The comparison fails with "docs/operators.md is stale: run
python -m hypershard.tools.operators_doc" when a rule, a family comment or the registry changed
without the document; the planted checks show that such a change does change the document, and
that the comparison then fails.
"""

from __future__ import annotations

import pytest

from hypershard.tools import operators_doc as od
from hypershard.tools.operators_doc.registrations import USER_FAMILY


@pytest.fixture(scope="module")
def generated():
    rules = od.registry()
    samples = od.collect_samples(op for op, _ in rules)
    rows = od.probe_rules(rules, samples)
    return rules, samples, rows, od.document(rows)


def test_operators_doc_is_current(generated, tmp_path):
    *_, text = generated
    fresh = tmp_path / "operators.md"
    fresh.write_text(text)
    assert od.DEFAULT_OUT.is_file(), od.STALE
    problem = od.check(fresh.read_text(), od.DEFAULT_OUT)
    assert problem is None, problem


def test_a_changed_registry_changes_the_document(generated, tmp_path):
    rules, samples, _, text = generated
    dropped = ("aten::mm", "matmul")
    assert dropped in rules
    changed = od.render([rule for rule in rules if rule != dropped], samples)
    assert "| `mm` |" in text and "| `mm` |" not in changed
    # ... and the comparison catches it: a checked-in file from the other registry is stale.
    stale = tmp_path / "operators.md"
    stale.write_text(changed)
    problem = od.check(text, stale)
    assert problem is not None and od.STALE in problem and "`mm`" in problem
    assert od.check(text, tmp_path / "missing.md") is not None


def test_a_changed_rule_result_changes_the_document(generated):
    """A row follows what its probe finds: mm probed without its traced calls (and with no
    sibling to borrow from) becomes "no sample", and the document changes with it."""
    _, samples, rows, text = generated
    without = {op: calls for op, calls in samples.items() if op != "aten::mm"}
    [replaced] = od.probe_rules([("aten::mm", "matmul")], without)
    assert replaced.probe is None and replaced.why == "no sample"
    changed = od.document([replaced if row.op == "aten::mm" else row for row in rows])
    assert "| `mm` | S(0) → S(0)" in text and "| `mm` | no sample" in changed


def test_rows_are_probed(generated):
    """The document is generated from probes of the rules, not from a list: spot checks of what
    the rules plan (pointwise keeps a shard, a linear op keeps a Partial, a non-linear one
    refuses it, a sharded contraction dim gives a Partial output)."""
    *_, rows, _ = generated
    by_op = {row.op: row for row in rows}
    add = by_op["aten::add.Tensor"].probe
    assert add.cells["S(0)"] == "S(0) → S(0)" and add.cells["P"] == "P → P"
    assert by_op["aten::exp"].probe.cells["P"].startswith("refused: self: Partial(sum) input is not supported")
    assert by_op["aten::mm"].probe.cells["S(last)"] == "S(-1) → P"
    probed = sum(row.probe is not None for row in rows)
    assert probed >= 0.9 * len(rows), f"only {probed} of {len(rows)} rules probed"


def test_document_without_sources(generated):
    *_, rows, _ = generated
    text = od.document(rows, sources=False)
    assert "(`csrc/ops/matmul.cpp` is not in this checkout: the family's comment is left out.)" in text
    assert "```text" not in text


def test_the_registry_exports_what_the_document_reads():
    """The pointwise split comes from hypershard._C.rule_registrations(), not from pointwise.cpp's
    text: every rule once, with its family, key mode and whether torch's pointwise tag added it."""
    from hypershard import _C

    registrations = od.registrations()
    own = [(op, family) for op, family in _C.rule_families() if family != USER_FAMILY]
    assert [(r.op, r.family) for r in registrations] == sorted(own)  # users' rules are not the document's
    assert {r.key_scalars for r in registrations} == {"all", "none"}
    by_op = {r.op: r for r in registrations}
    assert not by_op["aten::add.Tensor"].from_tag  # in pointwise.cpp's linear table
    assert by_op["aten::acos"].from_tag            # torch tags it pointwise; no table names it
    assert by_op["aten::sum.dim_IntList"].key_scalars == "all"  # its dims change the plan
    tagged = od.tagged_pointwise()
    assert tagged and all(by_op[op].family == "pointwise" for op in tagged)
