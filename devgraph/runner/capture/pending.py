"""A runner's keys still to capture in the background, captured one key per call.

:class:`~devgraph.runner.capture.background.BackgroundCapture` starts it; each :func:`capture_next` runs
under the runner's lock (the caller holds it), so a step never sees a key whose capture is under way: a
key's graph reaches the backend's table (``has_shape``) only once its capture is complete, and steps and
captures never overlap. Declared state is saved before each key's warm-ups and restored after its capture
(:meth:`RunnerGraphs.capture`), never across eager steps, so live steps between two keys keep their effects.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from devgraph.contract.keys import GraphKey
from devgraph.ranks import rank_of
from devgraph.runner.capture.loop import KeyReport
from devgraph.runner.dispatch import EagerReason

__all__ = ["PendingKeys", "abandon", "capture_next", "finish_now", "stop"]

logger = logging.getLogger(__name__)

#: A :class:`~devgraph.runner.graph_runner.GraphRunner` (not imported: it imports this module's users).
GraphRunner = Any


@dataclass
class PendingKeys:
    """Keys left to capture (largest first, as ``capture()`` orders them) and what the captured ones cost."""

    keys: list[GraphKey]
    total: int
    reports: list[KeyReport] = field(default_factory=list)
    #: Wall seconds spent capturing, warm-ups included (the steps in between not counted).
    seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def describe(self) -> dict[str, Any]:
        return {
            "captured": len(self.reports),
            "total": self.total,
            "pending": [str(k) for k in self.keys],
            "capture_seconds": round(self.seconds, 4),
        }


def capture_next(runner: GraphRunner) -> bool:
    """Capture the runner's next pending key; returns whether keys remain after it.

    On a failure every graph of the runner is released and it is left as before ``capture()`` (its steps
    run eagerly, ``before_capture``), and the :class:`~devgraph.errors.CaptureError` is raised."""
    pending: PendingKeys | None = runner._background
    if pending is None:
        return False
    key = pending.keys[0]
    graphs, pool = runner._graphs, runner.pool
    start = time.perf_counter()
    try:
        with pool.capturing() if pool is not None else contextlib.nullcontext():
            reports = graphs.capture([key], collect=not pending.reports, quiet=True)
    except BaseException:
        abandon(runner)
        raise
    finally:
        graphs.observe = None  # the address guard observes the first key's warm-up only (as at start-up)
    pending.seconds += time.perf_counter() - start
    pending.keys.pop(0)
    pending.reports += reports
    if _rank0(runner):
        logger.info(
            "captured %s graph %d/%d (%s, %s) in the background in %.2f s",
            runner.phase,
            len(pending.reports),
            pending.total,
            key,
            runner.backend.name,
            time.perf_counter() - start,
        )
    if pending.keys:
        return True
    _complete(runner, pending)
    return False


def finish_now(runner: GraphRunner) -> None:
    """Capture every pending key now (``capture()`` during a background capture)."""
    while capture_next(runner):
        pass


def _complete(runner: GraphRunner, pending: PendingKeys) -> None:
    graphs = runner._graphs
    report = graphs.empty_report()
    report.keys = sorted(pending.reports, key=lambda r: r.key.sort_key())
    report.seconds = pending.seconds
    report.notes = [*graphs.notes, *runner.backend.capture_notes()]
    runner.report = report
    runner._captured = True
    stop(runner)
    if _rank0(runner):
        eager = runner._stats.eager.get(EagerReason.CAPTURING, 0)
        logger.info("%s", report.table())
        logger.info(
            "all %d %s graphs captured in the background: %.2f s capturing, %.2f s since it began; %d "
            "step(s) ran eagerly meanwhile",
            pending.total,
            runner.phase,
            pending.seconds,
            time.perf_counter() - pending.started,
            eager,
        )


def stop(runner: GraphRunner) -> None:
    """No key is pending any more: steps route as the runner's captured state says."""
    runner._background = None
    runner._steps.capturing = False


def abandon(runner: GraphRunner) -> None:
    """Release every graph captured so far and stop (a failed key, ``refresh()``, ``close()``)."""
    if runner._background is None:
        return
    for graphs in runner._sets.all:
        for key in graphs.backend.captured_keys():
            runner._layout.forget(key)
    runner._sets.cleanup()
    if runner._steps.guard is not None:
        runner._steps.guard.disarm()
    stop(runner)


def _rank0(runner: GraphRunner) -> bool:
    return rank_of(runner.plan.process_group) == 0
