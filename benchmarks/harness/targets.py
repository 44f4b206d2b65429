"""Targets: a measured value against its limit, met or missed by how much, as JSON and as a table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Target", "targets_table"]


@dataclass
class Target:
    """One target: ``measured`` against ``limit`` (lower is better unless ``higher``)."""

    name: str
    measured: float | None
    limit: float
    unit: str = ""
    higher: bool = False
    detail: str = ""

    @property
    def met(self) -> bool | None:
        if self.measured is None or self.measured != self.measured:  # missing or NaN
            return None
        return self.measured >= self.limit if self.higher else self.measured <= self.limit

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "target": self.name,
            "measured": None if self.measured is None else round(self.measured, 4),
            "limit": f"{'>=' if self.higher else '<='} {self.limit}{self.unit}",
            "met": self.met,
        }
        if self.met is False and self.measured is not None and self.limit:
            out["missed_by_percent"] = round(abs(self.measured / self.limit - 1) * 100, 1)
        if self.detail:
            out["detail"] = self.detail
        return out


def targets_table(targets: Sequence[Target]) -> str:
    lines = ["targets:"]
    for t in targets:
        measured = "n/a" if t.measured is None else f"{t.measured:.4g}{t.unit}"
        state = {True: "met", False: "MISSED", None: "not measured"}[t.met]
        if t.met is False and t.measured is not None and t.limit:
            state += f" by {abs(t.measured / t.limit - 1) * 100:.1f}%"
        limit = f"{'>=' if t.higher else '<='} {t.limit:g}{t.unit}"
        lines.append(f"  {t.name:<58} {measured:>12}  {limit:<12} {state}")
    return "\n".join(lines)
