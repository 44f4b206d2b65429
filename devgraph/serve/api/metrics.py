"""Prometheus metrics of ``devgraph serve`` (needs the optional ``prometheus_client``).

Latency histograms are observed as tokens leave the engine; everything else is read from the engine's
and the runners' counters when ``/metrics`` is scraped, so there is one source of truth
(``runner.stats()`` for replays per key, eager steps by reason and padding). Names:

* ``devgraph_serve_time_to_first_token_seconds``, ``devgraph_serve_inter_token_latency_seconds``,
  ``devgraph_serve_request_latency_seconds`` (histograms);
* ``devgraph_serve_requests_total{finish_reason}``, ``devgraph_serve_prompt_tokens_total``,
  ``devgraph_serve_generation_tokens_total``;
* ``devgraph_serve_requests_running``, ``..._waiting``, ``..._queued``, ``devgraph_serve_kv_blocks_free``,
  ``devgraph_serve_kv_blocks_total`` (gauges);
* ``devgraph_engine_steps_total{kind}`` (decode, prefill, mixed), ``devgraph_engine_preemptions_total``,
  ``devgraph_engine_padding_tokens_total`` (padding the engine adds in deterministic mode);
* the runners' series from :class:`devgraph.runner.metrics.RunnerCollector` (labels ``phase``, ``backend``):
  ``devgraph_replays_total{key}``, ``devgraph_eager_steps_total{reason}``, ``devgraph_real_rows_total``,
  ``devgraph_padded_rows_total``, ``devgraph_lazy_*_total``; plus the gauge
  ``devgraph_padding_waste_ratio`` (padded rows per real row of replayed steps).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from devgraph.extras import require_extra
from devgraph.runner.metrics import RunnerCollector
from devgraph.serve.engine.request import RequestOutput

__all__ = ["ServeMetrics", "prometheus_available"]

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


def prometheus_available() -> bool:
    try:
        importlib.import_module("prometheus_client")
    except ImportError:
        return False
    return True


class ServeMetrics:
    """Histograms and counters in a registry of their own, plus a collector over ``stats()``."""

    def __init__(self, stats: Callable[[], dict[str, Any]], runners: Sequence[Any] = ()) -> None:
        prom = require_extra("prometheus_client", extra="serve", needed_by="GET /metrics")
        self._prom = prom
        self.registry = prom.CollectorRegistry()
        hist = dict(registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.ttft = prom.Histogram(
            "devgraph_serve_time_to_first_token_seconds", "Arrival to first token", **hist
        )
        self.itl = prom.Histogram("devgraph_serve_inter_token_latency_seconds", "Between two tokens", **hist)
        self.latency = prom.Histogram("devgraph_serve_request_latency_seconds", "Arrival to finish", **hist)
        self.requests = prom.Counter(
            "devgraph_serve_requests", "Finished requests", ["finish_reason"], registry=self.registry
        )
        self.prompt_tokens = prom.Counter(
            "devgraph_serve_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = prom.Counter(
            "devgraph_serve_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.registry.register(_StatsCollector(prom, stats))
        # The runners' own series (replays per key, eager steps by reason, rows) come from
        # devgraph.runner.metrics.
        self.registry.register(RunnerCollector(runners))

    def observe(self, output: RequestOutput, latency: float | None = None) -> None:
        """Record one engine output (called from the engine thread; prometheus_client is thread-safe)."""
        if output.ttft is not None:
            self.ttft.observe(output.ttft)
        if output.itl is not None:
            self.itl.observe(output.itl)
        if output.token_ids:
            self.generation_tokens.inc(len(output.token_ids))
        if output.finished:
            self.requests.labels(str(output.finish_reason)).inc()
            self.prompt_tokens.inc(output.num_prompt_tokens)
            if latency is not None:
                self.latency.observe(latency)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type (reads the engine's stats: call off the event loop)."""
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST


class _StatsCollector:
    def __init__(self, prom: Any, stats: Callable[[], dict[str, Any]]) -> None:
        self._core = importlib.import_module("prometheus_client.core")
        self._stats = stats

    def describe(self) -> list[Any]:
        return []  # collected on demand; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        core, stats = self._core, self._stats()
        gauges = (
            ("devgraph_serve_requests_running", "Requests in the running batch", stats["running"]),
            ("devgraph_serve_requests_waiting", "Requests waiting for admission", stats["waiting"]),
            (
                "devgraph_serve_requests_queued",
                "Requests not yet handed to the engine",
                stats.get("queued", 0),
            ),
            ("devgraph_serve_kv_blocks_free", "Free KV-cache blocks", stats["kv_blocks_free"]),
            ("devgraph_serve_kv_blocks_total", "KV-cache blocks requests can own", stats["kv_blocks_total"]),
        )
        for name, doc, value in gauges:
            yield core.GaugeMetricFamily(name, doc, value=value)
        steps = core.CounterMetricFamily("devgraph_engine_steps", "Engine steps by kind", labels=["kind"])
        for kind in ("decode", "prefill", "mixed"):
            steps.add_metric([kind], stats["steps"].get(kind, 0))
        yield steps
        yield core.CounterMetricFamily(
            "devgraph_engine_preemptions", "Requests preempted for KV blocks", value=stats["preemptions"]
        )
        yield core.CounterMetricFamily(
            "devgraph_engine_padding_tokens",
            "Padding tokens the engine added (deterministic mode)",
            value=stats["engine_padding_tokens"],
        )
        yield _padding_waste(core, stats["runners"])


def _padding_waste(core: Any, runners: dict[str, dict[str, Any]]) -> Any:
    waste = core.GaugeMetricFamily(
        "devgraph_padding_waste_ratio",
        "Padded rows per real row of replayed steps",
        labels=["phase", "backend"],
    )
    for phase, stats in runners.items():
        waste.add_metric([phase, stats["backend"]], stats["padding_waste"])
    return waste
