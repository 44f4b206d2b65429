"""Conformance kit results: a :class:`CheckResult` per check, a :class:`ConformanceReport` per target."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CheckResult", "ConformanceFailure", "ConformanceReport", "Status"]

Status = Literal["passed", "failed", "skipped", "error"]


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``passed``, ``failed`` (contract broken), ``skipped`` (does not apply
    here) or ``error`` (the check itself could not run: an unexpected exception)."""

    check: str
    status: Status
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Passed or skipped."""
        return self.status in ("passed", "skipped")


class ConformanceFailure(AssertionError):
    """Raised by :meth:`ConformanceReport.raise_for_failures` when a check failed or errored."""


@dataclass
class ConformanceReport:
    """Every check's result for one target."""

    target: str
    platform: str
    backend: str
    phase: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no check failed or errored (skipped checks do not count against it)."""
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]

    def result(self, check: str) -> CheckResult:
        for r in self.results:
            if r.check == check:
                return r
        raise KeyError(f"no result for check {check!r} (ran: {', '.join(r.check for r in self.results)})")

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "platform": self.platform,
            "backend": self.backend,
            "phase": self.phase,
            "passed": self.passed,
            "results": [
                {"check": r.check, "status": r.status, "detail": r.detail, "seconds": round(r.seconds, 3)}
                for r in self.results
            ],
        }

    def table(self) -> str:
        counts = {
            s: sum(r.status == s for r in self.results) for s in ("passed", "failed", "skipped", "error")
        }
        head = (
            f"devgraph conformance: {self.target} ({self.backend} on {self.platform}, phase {self.phase}): "
            + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        )
        lines = [head]
        for r in self.results:
            detail = r.detail.splitlines()[0] if r.detail else ""
            lines.append(f"  {r.status:<7} {r.check:<18} {r.seconds:6.2f}s  {detail}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def raise_for_failures(self) -> None:
        """Raise :class:`ConformanceFailure` listing every failed or errored check."""
        bad = self.failures
        if bad:
            body = "\n".join(f"- {r.check} ({r.status}): {r.detail}" for r in bad)
            raise ConformanceFailure(f"{self.target}: {len(bad)} conformance check(s) did not pass:\n{body}")
