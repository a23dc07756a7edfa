"""The staleness check: docs/operators.md against a fresh generation (the unit test and --check)."""

from __future__ import annotations

import difflib
import itertools
from pathlib import Path
from typing import Optional

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "docs" / "operators.md"
STALE = "docs/operators.md is stale: run python -m hypershard.tools.operators_doc"


def check(text: str, path: Path) -> Optional[str]:
    """None when `path` holds `text`; otherwise the STALE message with the first lines of the
    difference."""
    current = path.read_text() if path.is_file() else ""
    if current == text:
        return None
    diff = difflib.unified_diff(
        current.splitlines(),
        text.splitlines(),
        f"{path.name} (checked in)",
        f"{path.name} (generated)",
        lineterm="",
        n=1,
    )
    return "\n".join([*itertools.islice(diff, 40), STALE])
