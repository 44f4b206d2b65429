"""Summaries of a load run (TTFT, inter-token latency, throughput percentiles) and a plot of modes."""

from __future__ import annotations

import importlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from devgraph import BackendUnavailableError

__all__ = ["PERCENTILES", "percentile", "plot_modes", "summarize", "summary_table"]

PERCENTILES = (50, 90, 99)
#: Failed requests whose error messages the summary keeps (all are counted by kind).
FIRST_ERRORS = 3


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between ranks (NaN for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _spread(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    out = {f"p{q}": percentile(values, q) * scale for q in PERCENTILES}
    out["mean"] = (sum(values) / len(values) * scale) if values else math.nan
    return out


def summarize(results: Sequence[Mapping[str, Any]], wall_seconds: float) -> dict[str, Any]:
    """Aggregate per-request results (see :mod:`devgraph.serve.bench.loadgen`) into the report's numbers.

    Latencies in milliseconds. ``itl_ms`` pools every gap between consecutive tokens of every request;
    ``tpot_ms`` is per request ``(last token - first token) / (tokens - 1)``. ``output_tokens_per_s`` is
    all output tokens over the run's wall time (first send to last token). ``errors`` counts failed
    requests per kind (``"HTTP 400"``, ``"stream error"``, ...); ``first_errors`` keeps the first messages.
    """
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    gaps = [g for r in ok for g in r["itl"]]
    tpot = [
        (r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
        for r in ok
        if len(r["token_times"]) > 1
    ]
    output_tokens = sum(len(r["token_ids"]) for r in ok)
    failed = [r for r in results if not r["ok"]]
    kinds = Counter(r.get("error_kind") or "unknown" for r in failed)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(kinds.most_common()),
        "first_errors": [r.get("error") or "unknown" for r in failed[:FIRST_ERRORS]],
        "wall_seconds": wall_seconds,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall_seconds if wall_seconds > 0 else math.nan,
        "requests_per_s": len(ok) / wall_seconds if wall_seconds > 0 else math.nan,
        "ttft_ms": _spread(ttft, 1e3),
        "itl_ms": _spread(gaps, 1e3),
        "tpot_ms": _spread(tpot, 1e3),
    }


def summary_table(summary: Mapping[str, Any]) -> str:
    lines = [
        f"requests {summary['completed']}/{summary['requests']} ok in {summary['wall_seconds']:.2f} s; "
        f"{summary['output_tokens']} output tokens, {summary['output_tokens_per_s']:.1f} tok/s, "
        f"{summary['requests_per_s']:.2f} req/s",
        f"  {'':>10} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}",
    ]
    for name in ("ttft_ms", "itl_ms", "tpot_ms"):
        row = summary[name]
        lines.append(f"  {name:>10} " + " ".join(f"{row[k]:>9.2f}" for k in ("p50", "p90", "p99", "mean")))
    if summary["failed"]:
        kinds = ", ".join(f"{kind}: {count}" for kind, count in summary.get("errors", {}).items())
        lines.append(f"failed {summary['failed']} ({kinds}); first errors:")
        lines += [f"  {error}" for error in summary.get("first_errors", [])]
    return "\n".join(lines)


def plot_modes(runs: Mapping[str, Mapping[str, Mapping[str, Any]]], path: str, title: str) -> None:
    """A PNG: per scenario (e.g. ``c=1``, ``c=32``), TTFT p50, ITL p50/p99 and output tokens/s per mode.

    ``runs[mode][scenario]`` is a :func:`summarize` result. Needs matplotlib.
    """
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise BackendUnavailableError("the plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    modes = list(runs)
    scenarios = sorted({s for per_mode in runs.values() for s in per_mode}, key=_scenario_order)
    panels = (
        ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"]),
        ("inter-token latency p50 (ms)", lambda s: s["itl_ms"]["p50"]),
        ("inter-token latency p99 (ms)", lambda s: s["itl_ms"]["p99"]),
        ("output tokens/s", lambda s: s["output_tokens_per_s"]),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    width = 0.8 / max(len(modes), 1)
    for ax, (label, value) in zip(axes, panels, strict=True):
        for m, mode in enumerate(modes):
            xs = [i + (m - (len(modes) - 1) / 2) * width for i in range(len(scenarios))]
            ys = [value(runs[mode][s]) if s in runs[mode] else math.nan for s in scenarios]
            bars = ax.bar(xs, ys, width, label=mode)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(scenarios)), scenarios)
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _scenario_order(name: str) -> tuple[int, str]:
    digits = "".join(c for c in name if c.isdigit())
    return (int(digits) if digits else 0, name)
