"""What run_cases returns: one CaseResult per case, one LaunchInfo per launch, and the pytest
helper assert_all_passed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

__all__ = ["CaseResult", "LaunchInfo", "RunResult", "assert_all_passed"]

# passed: every rank agreed with the reference.  failed: a mismatch, or an expected error that
# did not come.  error: an unexpected exception.  hang: the launch timed out in this case.
# crash: a rank process died in this case.  not_run: the launch ended before this case.
STATUSES = ("passed", "failed", "error", "hang", "crash", "not_run")


@dataclass
class CaseResult:
    name: str
    status: str
    message: str = ""
    world_size: int = 0
    mesh: tuple = ()  # (shape, axis names)
    ranks: dict = field(default_factory=dict)  # rank -> {"status", "message"} as reported
    max_abs_diff: Optional[float] = None
    max_rel_diff: Optional[float] = None
    duration: float = 0.0  # slowest rank, seconds

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def describe(self) -> str:
        shape, names = self.mesh if self.mesh else ((), ())
        mesh = ", ".join(f"{n}={s}" for n, s in zip(names, shape))
        head = f"{self.status.upper()} {self.name} [{self.world_size} ranks, mesh {mesh}]"
        body = "\n".join("    " + line for line in self.message.splitlines())
        return f"{head}\n{body}" if body else head


@dataclass
class LaunchInfo:
    """One group of rank processes: which cases it ran and how it ended."""

    world_size: int
    cases: list  # names, in order
    outcome: str  # "ok" | "hang" | "crash" | "fatal"
    message: str = ""
    duration: float = 0.0
    pids: list = field(default_factory=list)
    exitcodes: list = field(default_factory=list)
    directory: Optional[str] = None  # kept only with keep_dir / HYPERSHARD_TESTING_KEEP=1
    case: Optional[str] = None  # the case a hang/crash was attributed to ("<setup>": none ran)


class RunResult:
    """Mapping-like: ``result["case name"]`` -> CaseResult, iteration in case order."""

    def __init__(self, backend: str):
        self.backend = backend
        self.cases: dict[str, CaseResult] = {}
        self.launches: list[LaunchInfo] = []

    def __getitem__(self, name: str) -> CaseResult:
        return self.cases[name]

    def __contains__(self, name: str) -> bool:
        return name in self.cases

    def __iter__(self) -> Iterator[CaseResult]:
        return iter(self.cases.values())

    def __len__(self) -> int:
        return len(self.cases)

    @property
    def failures(self) -> list:
        return [result for result in self if not result.passed]

    @property
    def problems(self) -> list:
        """Launch failures no case accounts for (e.g. a hang after the last case)."""
        return [launch.message for launch in self.launches if launch.outcome != "ok" and launch.case is None]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.problems

    def summary(self, failures_only: bool = True) -> str:
        shown = self.failures if failures_only else list(self)
        head = (
            f"{len(self.failures)} of {len(self)} cases did not pass "
            f"(backend {self.backend}, {len(self.launches)} launches)"
        )
        lines = [head] + [result.describe() for result in shown]
        lines += [
            "LAUNCH PROBLEM\n" + "\n".join("    " + line for line in problem.splitlines()) for problem in self.problems
        ]
        return "\n".join(lines)

    def check(self, name: str) -> None:
        """AssertionError with the case's report unless it passed (one pytest test per case)."""
        result = self.cases[name]
        if not result.passed:
            raise AssertionError(result.describe())

    def __repr__(self) -> str:
        return f"<RunResult {len(self) - len(self.failures)}/{len(self)} passed, backend {self.backend}>"


def assert_all_passed(results: RunResult) -> None:
    """Fail (AssertionError) with a readable report of every case that did not pass."""
    if not results.ok:
        raise AssertionError(results.summary())
