"""A runner's graph sets: the primary strategy's graphs and, optionally, a fallback strategy's behind them.

With ``{"decode": {"backend": "full", "fallback": "breakable"}}`` the runner captures every key twice, into
one pool (only one of them replays at a time): the ``breakable`` graphs of every key first (the pool's first
capture then comes from the strategy that fails least), then the ``full`` graphs key by key, where a key
whose ``full`` capture fails is left to the fallback (with a warning) instead of failing start-up. The
dispatcher sends a step to the fallback's graph when the primary declines it (its ``can_run`` says no, or it
holds no graph for the key); the backends only capture and replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.keys import GraphKey
from devgraph.errors import CaptureError
from devgraph.runner.capture.graphs import RunnerGraphs
from devgraph.runner.capture.loop import CaptureReport, KeyReport
from devgraph.runner.dispatch import Decision

__all__ = ["GraphSets"]

logger = logging.getLogger(__name__)


class GraphSets:
    """The primary :class:`RunnerGraphs` and, when the plan names a fallback mode, the fallback's."""

    def __init__(self, primary: RunnerGraphs, fallback: RunnerGraphs | None = None) -> None:
        self.primary = primary
        self.fallback = fallback
        self.plan = primary.plan

    @property
    def backends(self) -> list[DeviceGraphBackend]:
        return [g.backend for g in self.all]

    @property
    def all(self) -> list[RunnerGraphs]:
        return [self.primary] if self.fallback is None else [self.primary, self.fallback]

    def for_decision(self, decision: Decision) -> RunnerGraphs:
        """The set whose graph replays ``decision``'s key."""
        if decision.fallback is not None and self.fallback is not None:
            return self.fallback
        return self.primary

    # -- capture ------------------------------------------------------------------------------------
    def start_up(self) -> CaptureReport:
        """Capture every key of the schedule into each set (a lazily capturing runner: none)."""
        fallback = self.fallback
        if fallback is None or not self.primary.backend.uses_graphs:
            return self.primary.start_up()
        plan = self.plan
        keys = plan.schedule.keys()
        report = self.primary.empty_report()
        for graphs in self.all:
            graphs.backend.prepare(plan.inputs, keys)
        start = time.perf_counter()
        report.fallback = fallback.capture(keys, collect=True)  # a failure releases them and raises
        try:
            report.keys, report.failed = self._capture_primary(keys)
        except BaseException:  # not a capture failure the fallback covers: a failed start-up leaves no graphs
            for graphs in self.all:
                graphs.backend.cleanup()
            raise
        report.keys.sort(key=lambda r: r.key.sort_key())
        report.seconds = time.perf_counter() - start
        logger.info("%s", report.table())
        return report

    def _capture_primary(self, keys: Sequence[GraphKey]) -> tuple[list[KeyReport], dict[GraphKey, str]]:
        """The primary's keys one by one, so that a key it cannot capture is left to the fallback."""
        reports: list[KeyReport] = []
        failed: dict[GraphKey, str] = {}
        for key in keys:
            try:
                reports += self.primary.capture([key], collect=False, keep_others=True)
            except CaptureError as exc:
                failed[key] = str(exc)
                logger.warning(
                    "devgraph: %s: %s could not capture %s, so the %s fallback's graph will replay it: %s",
                    self.plan.phase,
                    self.primary.backend.name,
                    key,
                    self.fallback.backend.name if self.fallback else "",
                    exc,
                )
        return reports, failed

    def capture_now(self, keys: Sequence[GraphKey]) -> list[KeyReport]:
        """Capture ``keys`` into every set now (retuned sizes); returns the primary's reports."""
        reports = self.primary.capture(keys, collect=False)
        if self.fallback is not None:
            self.fallback.capture(keys, collect=False)
        return reports

    def release(self, key: GraphKey) -> None:
        for graphs in self.all:
            if graphs.backend.has_shape(key):
                graphs.release(key)
            graphs.lazy.keys.remove(key)

    def cleanup(self) -> None:
        """Release every graph of every set (``refresh()``; ``close()`` goes through the teardown)."""
        for graphs in self.all:
            graphs.backend.cleanup()
            graphs.clear()

    def adopt_captured(self) -> None:
        """Register every graph held now with the lazily captured cache, so a retuned, lazily capturing
        runner replays them instead of capturing them again."""
        for graphs in self.all:
            for key in graphs.backend.captured_keys():
                if key not in graphs.lazy.keys:
                    report = graphs.reports.get(key)
                    graphs.lazy.keys.add(key, report.bytes if report is not None else 0)

    def set_plan(self, plan: Any) -> None:
        for graphs in self.all:
            graphs.plan = plan
        self.plan = plan

    def describe(self) -> dict[str, Any]:
        fallback = self.fallback
        return {
            "fallback": None
            if fallback is None
            else {
                "backend": fallback.backend.name,
                "keys": {str(k): fallback.backend.describe_key(k) for k in fallback.backend.captured_keys()},
            },
        }
