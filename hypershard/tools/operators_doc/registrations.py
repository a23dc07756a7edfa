"""What the operator registry tells the document (hypershard._C.rule_registrations()): per
registered op, the family whose csrc/ops/<family>.cpp registers it, which non-tensor arguments
join its plan-cache key, and whether torch's `pointwise` tag registered it rather than a table of
its family (register_tagged_pointwise)."""

from __future__ import annotations

import functools
from typing import NamedTuple

# Rules users register at run time (hypershard.register_rule) are theirs, not hypershard's: the
# document leaves them out, so it does not depend on what a process registered before.
USER_FAMILY = "user"


class Registration(NamedTuple):
    op: str  # "aten::add.Tensor"
    family: str  # "pointwise"
    key_scalars: str  # "all" | "none": the non-tensor arguments in the plan-cache key
    from_tag: bool  # registered for torch's `pointwise` tag, not named in a table


@functools.lru_cache(maxsize=None)
def registrations() -> tuple:
    from ... import _C

    return tuple(
        sorted(
            Registration(str(op), str(family), str(key), bool(tag))
            for op, family, key, tag in _C.rule_registrations()
            if family != USER_FAMILY
        )
    )


def registry() -> list:
    """[(op, family)] for every rule, sorted."""
    return [(r.op, r.family) for r in registrations()]


def tagged_pointwise() -> frozenset:
    """The ops register_tagged_pointwise added (the rest of the pointwise family is tabled)."""
    return frozenset(r.op for r in registrations() if r.from_tag)
