"""Prometheus metrics for runners (optional: ``pip install 'devgraph[metrics]'``).

A collector reads each runner's :meth:`~devgraph.runner.graph_runner.GraphRunner.stats` when Prometheus
scrapes, so steps pay nothing extra. Every series carries the runner's ``phase`` and ``backend`` labels::

    from devgraph.runner.metrics import register_runners
    register_runners(decode_runner, prefill_runner)   # into prometheus_client's default registry
    prometheus_client.start_http_server(9400)

Series (counters; ``reset_stats()`` resets them, which Prometheus reads as a counter reset):

* ``devgraph_replays_total{key}``: replayed steps per graph key;
* ``devgraph_eager_steps_total{reason}``: eager steps per :class:`~devgraph.runner.dispatch.EagerReason`;
* ``devgraph_real_rows_total``, ``devgraph_padded_rows_total``: real and padding tokens of replayed steps;
* ``devgraph_lazy_hits_total``, ``devgraph_lazy_misses_total``, ``devgraph_lazy_evictions_total``: the
  lazily capturing graph cache.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from devgraph.extras import require_extra

__all__ = ["Reporting", "RunnerCollector", "register_runners"]


class Reporting(Protocol):
    """What the collector reads: a runner's ``stats()`` (a ``GraphRunner``, or anything reporting alike)."""

    def stats(self) -> dict[str, Any]: ...


def _prometheus() -> Any:
    return require_extra("prometheus_client", extra="metrics", needed_by="devgraph.runner.metrics")


class RunnerCollector:
    """A Prometheus collector over one or more runners (anything with ``stats()``)."""

    def __init__(self, runners: Iterable[Reporting] = (), *, namespace: str = "devgraph") -> None:
        _prometheus()  # fail here, with the install hint, rather than at the first scrape
        self._metrics = importlib.import_module("prometheus_client.core")
        self.namespace = namespace
        self._lock = threading.Lock()
        self._runners: list[Reporting] = []
        for runner in runners:
            self.add(runner)

    def add(self, runner: Reporting) -> None:
        """Start reporting ``runner`` (once, however often it is added)."""
        with self._lock:
            if not any(r is runner for r in self._runners):
                self._runners.append(runner)

    def remove(self, runner: Reporting) -> None:
        """Stop reporting ``runner`` (e.g. after ``close()``)."""
        with self._lock:
            self._runners = [r for r in self._runners if r is not runner]

    def describe(self) -> list[Any]:
        return []  # no fixed series set: the registry calls collect() to learn the names when needed

    def collect(self) -> Iterator[Any]:
        core = self._metrics
        name = self.namespace
        labels = ["phase", "backend"]
        families = {
            "replays": core.CounterMetricFamily(
                f"{name}_replays",
                "Steps replayed from a captured graph, per graph key",
                labels=[*labels, "key"],
            ),
            "eager": core.CounterMetricFamily(
                f"{name}_eager_steps", "Steps run eagerly, per reason", labels=[*labels, "reason"]
            ),
            "real_rows": core.CounterMetricFamily(
                f"{name}_real_rows", "Real tokens of replayed steps", labels=labels
            ),
            "padded_rows": core.CounterMetricFamily(
                f"{name}_padded_rows", "Padding tokens of replayed steps", labels=labels
            ),
            "hits": core.CounterMetricFamily(
                f"{name}_lazy_hits", "Steps whose lazily captured graph was cached", labels=labels
            ),
            "misses": core.CounterMetricFamily(
                f"{name}_lazy_misses", "Steps that captured a graph lazily", labels=labels
            ),
            "evictions": core.CounterMetricFamily(
                f"{name}_lazy_evictions", "Lazily captured graphs evicted", labels=labels
            ),
            "fallback": core.CounterMetricFamily(
                f"{name}_fallback_replays",
                "Steps the primary graph set declined, replayed by the fallback set, per reason",
                labels=[*labels, "reason"],
            ),
        }
        with self._lock:
            runners = list(self._runners)
        for runner in runners:
            stats = runner.stats()
            base = [str(stats["phase"]), str(stats["backend"])]
            for key, count in stats["replays_by_key"].items():
                families["replays"].add_metric([*base, key], count)
            for reason, count in stats["eager_by_reason"].items():
                families["eager"].add_metric([*base, reason], count)
            families["real_rows"].add_metric(base, stats["real_rows"])
            families["padded_rows"].add_metric(base, stats["padded_rows"])
            for field in ("hits", "misses", "evictions"):
                families[field].add_metric(base, stats["lazy"][field])
            for reason, count in stats["fallback"]["by_reason"].items():
                families["fallback"].add_metric([*base, reason], count)
        yield from families.values()


def register_runners(
    *runners: Reporting, registry: Any = None, namespace: str = "devgraph"
) -> RunnerCollector:
    """A :class:`RunnerCollector` over ``runners``, registered with ``registry`` (default: the global
    ``prometheus_client.REGISTRY``); add more runners later with ``collector.add(runner)``."""
    prometheus = _prometheus()
    collector = RunnerCollector(runners, namespace=namespace)
    (registry if registry is not None else prometheus.REGISTRY).register(collector)
    return collector
