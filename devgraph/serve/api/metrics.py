"""Prometheus metrics of ``devgraph serve`` (needs the optional ``prometheus_client``).

Serving metrics use vLLM's names, types and labels (``model_name``, ``engine="0"``) where the meaning is
the same, so a dashboard built for vLLM reads them unchanged; what only devgraph has keeps a
``devgraph_`` name. docs/serving.md has the table.

Latency histograms are observed as outputs leave the engine (times from the request's arrival at the
HTTP handler, as vLLM times them from its front end); everything else is read from the engine's and the
runners' counters when ``/metrics`` is scraped, so there is one source of truth.

The names vLLM's example Grafana dashboard reads are all here, with vLLM's meaning:
``vllm:gpu_cache_usage_perc`` (the fraction of KV blocks in use, 0-1: the older name of
``vllm:kv_cache_usage_perc``, both exported), ``vllm:time_per_output_token_seconds`` (the time between two
tokens of a request: the older name of ``vllm:inter_token_latency_seconds``, both exported),
``vllm:request_prefill_time_seconds`` (first admission to the running batch to the first token),
``vllm:request_decode_time_seconds`` (first token to the last), ``vllm:request_max_num_generation_tokens``
(per request, the most tokens any of its ``n`` copies generated: "max generation tokens in the sequence
group").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from devgraph.extras import require_extra
from devgraph.runner.metrics import RunnerCollector
from devgraph.serve.engine.request import RequestOutput

__all__ = ["ServeMetrics", "prometheus_available"]

# vLLM's buckets, with finer ones in front where a graph-replayed step is far below vLLM's first bucket.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
LABELS = ("model_name", "engine")


def prometheus_available() -> bool:
    try:
        importlib.import_module("prometheus_client")
    except ImportError:
        return False
    return True


def _tokens_buckets(max_seq_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_seq_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ServeMetrics:
    """Histograms in a registry of their own, plus collectors over the engine's and the runners' stats."""

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        runners: Sequence[Any] = (),
        *,
        model_name: str = "",
        max_seq_len: int = 2048,
    ) -> None:
        prom = require_extra("prometheus_client", extra="serve", needed_by="GET /metrics")
        self._prom = prom
        self.registry = prom.CollectorRegistry()
        labels = (model_name, "0")

        def family(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return prom.Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return family(name, doc, buckets).labels(*labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        itl = family("vllm:inter_token_latency_seconds", "Time between two tokens", _ITL_BUCKETS)
        self.itl = itl.labels(*labels)
        # The same observations under vLLM's older name: observed once (every token of every request
        # passes here, on the engine thread), exported twice.
        self.registry.register(
            _Renamed(
                itl,
                "vllm:time_per_output_token_seconds",
                "Time between two tokens (vLLM's older name of inter_token_latency, which dashboards read)",
            )
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "First admission to the running batch to the first token",
            _REQUEST_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds", "First token to the last token", _REQUEST_BUCKETS
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", _REQUEST_BUCKETS)
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Arrival to first admission to the running batch",
            _REQUEST_BUCKETS,
        )
        tokens = _tokens_buckets(max_seq_len)
        self.prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request", tokens
        )
        self.generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request", tokens
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Per request, the most tokens any of its n copies generated",
            tokens,
        )
        self.registry.register(_StatsCollector(stats, labels))
        # The runners' own series (replays per key, eager steps by reason, rows) come from
        # devgraph.runner.metrics.
        self.registry.register(RunnerCollector(runners))

    def observe(self, output: RequestOutput, since_arrival: float) -> None:
        """Record one engine output, ``since_arrival`` seconds after its request reached the server (called
        from the engine thread; prometheus_client is thread-safe)."""
        if output.ttft is not None:
            self.ttft.observe(since_arrival)
        if output.itl is not None:
            self.itl.observe(output.itl)  # vllm:time_per_output_token_seconds too (_Renamed)
        if output.finished:
            self.e2e.observe(since_arrival)
            self.prompt_tokens.observe(output.num_prompt_tokens)
            self.generation_tokens.observe(output.num_output_tokens)
            if output.queue_time is not None:
                self.queue.observe(output.queue_time)
            if output.prefill_time is not None:
                self.prefill.observe(output.prefill_time)
            if output.decode_time is not None:
                self.decode.observe(output.decode_time)

    def observe_group(self, generated: int) -> None:
        """Record a finished request: the most tokens any of its copies generated."""
        self.max_generation_tokens.observe(generated)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type (reads the engine's stats: call off the event loop)."""
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST


class _Renamed:
    """A metric's family (``source``'s, a histogram registered on its own) exported again under ``name``
    with its own help text: one histogram observed once, exposed under two names."""

    def __init__(self, source: Any, name: str, documentation: str) -> None:
        self._core = importlib.import_module("prometheus_client.core")
        self._source = source
        self._name = name
        self._documentation = documentation

    def describe(self) -> list[Any]:
        return [self._core.Metric(self._name, self._documentation, "histogram")]

    def collect(self) -> Iterator[Any]:
        for family in self._source.collect():
            renamed = self._core.Metric(self._name, self._documentation, family.type, family.unit)
            suffix = len(family.name)  # _bucket, _count, _sum, _created
            renamed.samples = [s._replace(name=self._name + s.name[suffix:]) for s in family.samples]
            yield renamed


class _StatsCollector:
    """Gauges and counters read from ``stats()`` at each scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]], labels: tuple[str, str]) -> None:
        self._core = importlib.import_module("prometheus_client.core")
        self._stats = stats
        self._labels = list(labels)

    def describe(self) -> list[Any]:
        return []  # collected on demand; nothing to check at registration

    def _family(
        self, kind: str, name: str, doc: str, value: float, extra: tuple[str, str] | None = None
    ) -> Any:
        cls = self._core.GaugeMetricFamily if kind == "gauge" else self._core.CounterMetricFamily
        names = [*LABELS, *([extra[0]] if extra else [])]
        family = cls(name, doc, labels=names)
        family.add_metric([*self._labels, *([extra[1]] if extra else [])], value)
        return family

    def collect(self) -> Iterator[Any]:
        core, stats = self._core, self._stats()
        total = stats["kv_blocks_total"]
        waiting = stats["waiting"] + stats.get("queued", 0)
        yield self._family(
            "gauge", "vllm:num_requests_running", "Requests in the running batch", stats["running"]
        )
        yield self._family("gauge", "vllm:num_requests_waiting", "Requests waiting to be admitted", waiting)
        usage = 1.0 - stats["kv_blocks_free"] / total if total else 0.0
        yield self._family(
            "gauge", "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)", usage
        )
        yield self._family(
            "gauge",
            "vllm:gpu_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0-1; vLLM's older name, which dashboards read)",
            usage,
        )
        yield self._family("counter", "vllm:prompt_tokens", "Prompt tokens processed", stats["prompt_tokens"])
        yield self._family(
            "counter", "vllm:generation_tokens", "Tokens generated", stats["generation_tokens"]
        )
        yield self._family(
            "counter", "vllm:num_preemptions", "Requests preempted for KV blocks", stats["preemptions"]
        )
        success = core.CounterMetricFamily(
            "vllm:request_success", "Finished requests by finish reason", labels=[*LABELS, "finished_reason"]
        )
        for reason, count in sorted(stats["finished"].items()):
            success.add_metric([*self._labels, reason], count)
        yield success
        gauges: tuple[tuple[str, str, Any], ...] = (
            (
                "devgraph_serve_requests_queued",
                "Requests not yet handed to the engine",
                stats.get("queued", 0),
            ),
            ("devgraph_serve_kv_blocks_free", "Free KV-cache blocks", stats["kv_blocks_free"]),
            ("devgraph_serve_kv_blocks_total", "KV-cache blocks requests can own", total),
        )
        yield core.CounterMetricFamily(
            "devgraph_engine_prefill_tokens",
            "Tokens run through prefill chunks (n copies of a prompt count it once; recomputation counts)",
            value=stats.get("prefill_tokens", 0),
        )
        capture = stats.get("graph_capture")
        if capture is not None:  # --capture-in-background
            gauges += (
                (
                    "devgraph_graphs_captured",
                    "Graph keys captured so far (background capture)",
                    capture["captured"],
                ),
                ("devgraph_graphs_total", "Graph keys to capture (background capture)", capture["total"]),
                (
                    "devgraph_graphs_capture_failed",
                    "1 when the background capture stopped on an error (steps stay eager; /health says why)",
                    int(capture["error"] is not None),
                ),
            )
        for name, doc, value in gauges:
            yield core.GaugeMetricFamily(name, doc, value=value)
        steps = core.CounterMetricFamily("devgraph_engine_steps", "Engine steps by kind", labels=["kind"])
        for kind in ("decode", "prefill", "mixed"):
            steps.add_metric([kind], stats["steps"].get(kind, 0))
        yield steps
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
