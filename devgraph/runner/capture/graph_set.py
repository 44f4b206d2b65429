"""One graph set of a runner: one strategy's graphs of the runner's keys, captured at start-up or each on
first sight within the lazy cache's bounds; one key's graph released; and what each capture cost.

A runner has one :class:`GraphSet` per strategy (:class:`~devgraph.runner.capture.sets.GraphSets`: the
primary and, optionally, the fallback). A set builds the capture job from the runner's plan (ranks of a
process group capture in step and fail together), leaves declared state as it found it, learns the output
layout after the first capture, and on a failure releases what it captured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.keys import GraphKey
from devgraph.ranks import CaptureSync, rank_of
from devgraph.runner.capture.job import (
    CaptureJob,
    CaptureReport,
    KeyReport,
    capture_keys,
    frozen_gc,
    show_progress,
)
from devgraph.runner.capture.lazy import LazyGraphs
from devgraph.runner.capture.probe import probe_layout
from devgraph.runner.capture.undeclared import StateProbe
from devgraph.runner.options import RunnerPlan
from devgraph.runner.outputs.layout import OutputLayout
from devgraph.runner.staging import StaticBuffers
from devgraph.runner.stats import RunnerStats

__all__ = ["GraphSet"]

logger = logging.getLogger(__name__)


class GraphSet:
    """Captures a runner's keys into one backend and keeps a report per captured key.

    ``forward`` is the runner's forward; :attr:`forward` is what the backend made of it (compiled, for a
    compiling strategy): warm-ups, capture and the layout probe run that on the runner's static ``buffers``.
    The first key's warm-ups also look for state the forward advances undeclared (:class:`StateProbe`).
    """

    def __init__(
        self,
        plan: RunnerPlan,
        backend: DeviceGraphBackend,
        forward: Callable[..., Any],
        buffers: StaticBuffers,
        layout: OutputLayout,
        stats: RunnerStats,
    ) -> None:
        self.plan = plan
        self.backend = backend
        self.forward = backend.wrap_forward(forward)
        self.state_probe = StateProbe(forward, plan.state, plan.phase)
        self._buffers = buffers
        self._layout = layout
        self.reports: dict[GraphKey, KeyReport] = {}
        self.notes: list[str] = []
        #: Runs the next capture's first warm-up under the address guard's observation (then unset).
        self.observe: Callable[[GraphKey, Mapping[str, Any]], bool] | None = None
        #: Wraps the plan's capture context so that each capture notes the host values it reads (the
        #: address guard's value check, devgraph.runner.guard.host_values).
        self.wrap_context: Callable[[Any], Any] | None = None
        self.lazy = LazyGraphs(
            plan.capture.lazy_policy,
            stats,
            has_graph=backend.has_shape,
            capture=lambda key: self.capture([key], collect=False)[0].bytes,
            release=self.release,
        )

    def empty_report(self) -> CaptureReport:
        return CaptureReport(self.plan.phase, self.backend.name, self.plan.platform.name)

    def holds(self, key: GraphKey) -> bool:
        """Whether a step of ``key`` can replay this set's graph now: it holds one, or (a lazily capturing
        runner) will capture it on first sight, unless that capture failed once."""
        if self.plan.capture.lazy:
            return key not in self.lazy.failed
        return self.backend.has_shape(key)

    def capture(
        self, keys: Sequence[GraphKey], *, collect: bool, keep_others: bool = False, quiet: bool = False
    ) -> list[KeyReport]:
        """Capture ``keys`` (largest first) in one session; on a failure release them and raise.

        A failure releases every graph of the backend, unless the runner is lazy or ``keep_others`` (a
        second graph set stands behind this one): then only ``keys`` are released. ``quiet``: no progress
        bar or per-key log line (the caller logs: a background capture goes key by key)."""
        plan, backend = self.plan, self.backend
        lazy = plan.capture.lazy
        # Ranks of a process group (or of a data-parallel group) capture the same keys with the same graph set
        # and buffers, in step, and fail together (devgraph.ranks).
        group = plan.process_group if plan.process_group is not None else plan.dp_group
        sync = CaptureSync(plan.platform, group, plan.phase, keys, backend, buffers=self._buffers.buffers)
        job = CaptureJob(
            phase=plan.phase,
            backend=backend,
            platform=plan.platform,
            forward=self.forward,
            inputs_for=lambda key: {**self._buffers.views(key), **key.variant_dict},
            warmup_iters=plan.capture.warmup_iters,
            max_size=plan.schedule.max_tokens,
            capture_context=(
                self.wrap_context(plan.capture.context) if self.wrap_context else plan.capture.context
            ),
            barrier=sync.barrier,
            ready=sync.ready,
            on_captured=self._layout.observe,
            finish=self._learn_layout,
            hook=plan.capture.hook,
            agree=sync.agree,
            progress="off"
            if lazy or quiet
            else show_progress(plan.capture.progress, rank_of(plan.process_group)),
            shared_pool=not lazy,
            probe=self.state_probe,
            static=lambda: self._buffers.buffers.values(),
            notes=self.notes,
            observe=self.observe,
        )
        with plan.state.preserved(), frozen_gc(collect):
            self._buffers.reset()
            try:
                reports = capture_keys(job, keys)
            except BaseException:
                if lazy or keep_others:
                    for key in keys:  # these keys only: graphs captured earlier keep serving
                        self._layout.forget(key)
                        if backend.has_shape(key):
                            backend.release(key)
                        if lazy:
                            self.lazy.failed.add(key)
                else:
                    backend.cleanup()
                raise
            finally:
                self.state_probe.restore_adopted()
        reports.sort(key=lambda r: r.key.sort_key())
        self.reports.update((r.key, r) for r in reports)
        return reports

    def _learn_layout(self, key: GraphKey) -> None:
        if self._layout.axes is None:
            probe_layout(self.plan, self.forward, self._layout, key)
            self._layout.finish()

    def release(self, key: GraphKey) -> None:
        """Drop ``key``'s graph (the lazy cache evicts it) and what was learnt with it."""
        self.backend.release(key)
        self.reports.pop(key, None)
        self._layout.forget(key)

    def clear(self) -> None:
        self.lazy.clear()
        self.reports.clear()
