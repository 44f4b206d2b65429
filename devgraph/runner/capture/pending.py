"""A runner's keys still to capture in the background (:class:`PendingKeys`) and what the captured ones
cost: the record the graph life keeps while it is ``capturing``.

:meth:`~devgraph.runner.life.GraphLife.capture_next` captures one key per call under the runner's lock,
so a step never sees a key whose capture is under way: a key's graph reaches the backend's table
(``has_shape``) only once its capture is complete, and steps and captures never overlap. Declared state is
saved before each key's warm-ups and restored after its capture (:meth:`GraphSet.capture`), never across
eager steps, so live steps between two keys keep their effects.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from devgraph.contract.keys import GraphKey
from devgraph.runner.capture.job import KeyReport

__all__ = ["PendingKeys"]


@dataclass
class PendingKeys:
    """Keys left to capture (largest first, as ``capture()`` orders them) and what the captured ones cost."""

    keys: list[GraphKey]
    total: int
    reports: list[KeyReport] = field(default_factory=list)
    #: Wall seconds spent capturing, warm-ups included (the steps in between not counted).
    seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    #: The capture stopped before every key (a failed key, ``refresh()``, ``close()``): its graphs were
    #: released with the runner's others.
    abandoned: bool = False

    @property
    def held(self) -> int:
        """Keys this capture captured whose graphs are held now."""
        return 0 if self.abandoned else len(self.reports)

    @property
    def open(self) -> bool:
        """Keys remain and the capture goes on."""
        return bool(self.keys) and not self.abandoned

    def describe(self) -> dict[str, Any]:
        return {
            "captured": self.held,
            "total": self.total,
            "pending": [str(k) for k in self.keys],
            "capture_seconds": round(self.seconds, 4),
        }
