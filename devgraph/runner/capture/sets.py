"""A runner's graph sets: the primary strategy's graphs and, optionally, a fallback strategy's behind them.

With ``{"decode": {"backend": "full", "fallback": "breakable"}}`` the runner captures every key twice, into
one pool (only one of them replays at a time): the ``breakable`` graphs of every key first (the pool's first
capture then comes from the strategy that fails least), then the ``full`` graphs key by key, where a key
whose ``full`` capture fails is left to the fallback (with a warning) instead of failing. Every capture of
the runner goes this way: start-up, the keys ``retune()`` adds, what ``restore()`` captures again and the
memory estimate's probes, so each covers both sets. The dispatcher sends a step to the fallback's graph
when the primary declines it (its ``can_run`` says no, or it holds no graph for the key); the backends only
capture and replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.keys import GraphKey
from devgraph.errors import CaptureError
from devgraph.ranks import rank_of
from devgraph.runner.capture.graph_set import GraphSet
from devgraph.runner.capture.job import CaptureReport, KeyReport
from devgraph.runner.dispatch import Decision, KeySet
from devgraph.runner.options import RunnerPlan

__all__ = ["GraphSets"]

logger = logging.getLogger(__name__)


def _key_set(graphs: GraphSet) -> KeySet:
    """``graphs`` as the dispatcher reads it; the backend's veto only where its class has one."""
    backend = graphs.backend
    vetoes = type(backend).can_run is not DeviceGraphBackend.can_run
    holds = graphs.holds if graphs.plan.capture.lazy else backend.has_shape
    return KeySet(holds, backend.can_run if vetoes else None)


class GraphSets:
    """The primary :class:`GraphSet` and, when the plan names a fallback mode, the fallback's."""

    def __init__(self, primary: GraphSet, fallback: GraphSet | None = None) -> None:
        self.primary = primary
        self.fallback = fallback
        self.plan = primary.plan
        #: The primary's keys whose capture failed, left to the fallback (with the error), until released.
        self.declined: dict[GraphKey, str] = {}
        #: What the dispatcher reads, primary first (built with the plan: the sets never change).
        self.key_sets: tuple[KeySet, ...] = tuple(_key_set(g) for g in self.all)

    @property
    def backends(self) -> list[DeviceGraphBackend]:
        return [g.backend for g in self.all]

    @property
    def all(self) -> list[GraphSet]:
        return [self.primary] if self.fallback is None else [self.primary, self.fallback]

    def for_decision(self, decision: Decision) -> GraphSet:
        """The set whose graph replays ``decision``'s key."""
        if decision.fallback is not None and self.fallback is not None:
            return self.fallback
        return self.primary

    # -- capture ------------------------------------------------------------------------------------
    def start_up(self) -> CaptureReport:
        """Prepare the backends and capture every key of the schedule into each set (a lazily capturing
        runner: none). A failure the fallback does not cover leaves no graph in any set."""
        plan, primary = self.plan, self.primary
        if not primary.backend.uses_graphs:
            return primary.empty_report()
        keys = [] if plan.capture.lazy else plan.schedule.keys()
        for graphs in self.all:
            graphs.backend.prepare(plan.inputs, keys)
        if not keys:
            return primary.empty_report()
        report = self.capture(keys, collect=True, keep=False)
        report.notes = [*primary.notes, *primary.backend.capture_notes()]
        if rank_of(plan.process_group) == 0:  # one report per tensor-parallel group
            logger.info("%s", report.table())
        return report

    def capture(
        self, keys: Sequence[GraphKey], *, collect: bool = False, keep: bool = True, quiet: bool = False
    ) -> CaptureReport:
        """Capture the ``keys`` each set lacks, the fallback's first; the primary's key by key where a
        fallback stands behind it, so a key it cannot capture is left to the fallback (not raised).

        ``keep``: graphs held before this call keep serving when it fails (only ``keys`` are released);
        otherwise a failure releases every set's graphs. ``quiet``: no progress bar or per-key log line."""
        primary, fallback = self.primary, self.fallback
        report = primary.empty_report()
        start = time.perf_counter()
        try:
            if fallback is None:
                report.keys = _capture(primary, _lacking(primary, keys), collect, keep, quiet)
            else:
                report.fallback = _capture(fallback, _lacking(fallback, keys), collect, keep, quiet)
                wanted = [k for k in _lacking(primary, keys) if k not in self.declined]
                report.keys, report.failed = self._capture_primary(wanted, quiet)
        except BaseException:
            if not keep:  # a failed start-up leaves no graphs
                self.cleanup()
            raise
        report.keys.sort(key=lambda r: r.key.sort_key())
        report.seconds = time.perf_counter() - start
        return report

    def _capture_primary(
        self, keys: Sequence[GraphKey], quiet: bool
    ) -> tuple[list[KeyReport], dict[GraphKey, str]]:
        """The primary's keys one by one, so that a key it cannot capture is left to the fallback."""
        reports: list[KeyReport] = []
        failed: dict[GraphKey, str] = {}
        for key in keys:
            try:
                reports += self.primary.capture([key], collect=False, keep_others=True, quiet=quiet)
            except CaptureError as exc:
                failed[key] = self.declined[key] = str(exc)
                logger.warning(
                    "devgraph: %s: %s could not capture %s, so the %s fallback's graph will replay it: %s",
                    self.plan.phase,
                    self.primary.backend.name,
                    key,
                    self.fallback.backend.name if self.fallback else "",
                    exc,
                )
        return reports, failed

    def release(self, key: GraphKey) -> None:
        """Drop ``key``'s graph from every set (a key ``retune()`` no longer schedules)."""
        for graphs in self.all:
            if graphs.backend.has_shape(key):
                graphs.release(key)
            graphs.lazy.keys.remove(key)
        self.declined.pop(key, None)

    def cleanup(self) -> None:
        """Release every graph of every set, and forget what was learnt with them."""
        for graphs in self.all:
            graphs.backend.cleanup()
            graphs.clear()
        self.declined.clear()

    def adopt_captured(self) -> None:
        """Register every graph held now with the lazily captured cache, so a retuned, lazily capturing
        runner replays them instead of capturing them again."""
        for graphs in self.all:
            for key in graphs.backend.captured_keys():
                if key not in graphs.lazy.keys:
                    report = graphs.reports.get(key)
                    graphs.lazy.keys.add(key, report.bytes if report is not None else 0)

    def set_plan(self, plan: RunnerPlan) -> None:
        for graphs in self.all:
            graphs.plan = plan
        self.plan = plan
        self.key_sets = tuple(_key_set(g) for g in self.all)  # retune() may turn lazy capture on

    # -- inspection ---------------------------------------------------------------------------------
    def captured_keys(self) -> list[GraphKey]:
        """The keys the primary holds a graph for, smallest first."""
        return sorted(self.primary.backend.captured_keys(), key=GraphKey.sort_key)

    def describe(self) -> dict[str, Any]:
        fallback = self.fallback
        return {
            "fallback": None
            if fallback is None
            else {
                "backend": fallback.backend.name,
                "keys": {str(k): fallback.backend.describe_key(k) for k in fallback.backend.captured_keys()},
                "declined": {str(k): why for k, why in self.declined.items()},
            },
        }


def _lacking(graphs: GraphSet, keys: Sequence[GraphKey]) -> list[GraphKey]:
    """``keys`` ``graphs`` holds no graph for, in the order given."""
    return [k for k in keys if not graphs.backend.has_shape(k)]


def _capture(
    graphs: GraphSet, keys: list[GraphKey], collect: bool, keep: bool, quiet: bool
) -> list[KeyReport]:
    return graphs.capture(keys, collect=collect, keep_others=keep, quiet=quiet) if keys else []
