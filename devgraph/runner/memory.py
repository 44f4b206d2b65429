"""A runner's graph memory: exact per key after capture (:func:`graph_memory`), estimated before it
(:func:`estimate`), so an engine can size its KV cache with the graphs accounted for.

The estimate captures the keys (or a few probe keys) the way ``capture()`` will, into every graph set
(the fallback's too, first, as at start-up; largest first, into one shared pool, or one pool per key for a
lazily capturing runner), reads the bytes the pool grew by for each, and fits the rest; the caller (the
graph life) releases them all (the memory goes back to the device). Why this model: in a shared pool the
largest key, captured first, reserves the intermediates every later key reuses; each smaller key then adds its
own outputs and the blocks its graph keeps, which grow with its token count (row-major activations), plus
a constant (the allocator's block rounding, per-graph workspaces). So the total is the largest key's bytes,
measured, plus a piecewise-linear fit of the smaller keys' marginal bytes over tokens through the probed
points (extended past the last with its segment's slope). Piecewise rather than one line because the
device allocator rounds to blocks (2 MiB segments for large tensors on CUDA): the bytes rise in steps,
and a fit through measured points follows those steps where one line through the ends would not.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devgraph.contract.keys import GraphKey
from devgraph.errors import ConfigError
from devgraph.runner.capture.job import KeyReport
from devgraph.runner.capture.sets import GraphSets

__all__ = ["GraphMemory", "GraphMemoryEstimate", "estimate", "fit_bytes", "graph_memory", "probe_keys"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphMemory:
    """Bytes the captured graphs hold, per key (the pool's growth while capturing it), and their total."""

    total_bytes: int
    by_key: Mapping[str, int]
    fallback_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes,
            "by_key": dict(self.by_key),
            "fallback_bytes": self.fallback_bytes,
        }


@dataclass(frozen=True)
class GraphMemoryEstimate:
    """The graph memory a runner's configured keys will hold, predicted before ``capture()``.

    ``total_bytes``: the prediction for every key of every graph set; ``by_key``: each key's predicted (or,
    for a probed key, measured) bytes in the primary set; ``fallback_bytes``: the fallback set's, all keys
    (0 without one); ``probed``: the bytes measured per probed key (primary); ``method``: how the rest was
    fitted; ``seconds``: what probing cost (captures and warm-ups included). The primary's keys whose
    capture failed (left to the fallback, as ``capture()`` leaves them) are counted under the fallback only.
    """

    total_bytes: int
    by_key: Mapping[str, int]
    probed: Mapping[str, int]
    method: str
    seconds: float
    fallback_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes,
            "by_key": dict(self.by_key),
            "fallback_bytes": self.fallback_bytes,
            "probed": dict(self.probed),
            "method": self.method,
            "seconds": round(self.seconds, 4),
        }


def graph_memory(sets: GraphSets) -> GraphMemory:
    """Exact bytes per captured key, from the capture reports (``capture()`` measured each key's growth)."""
    by_key: dict[str, int] = {}
    fallback = 0
    for graphs in sets.all:
        for key, report in sorted(graphs.reports.items(), key=lambda kv: kv[0].sort_key()):
            if graphs is sets.primary:
                by_key[str(key)] = report.bytes
            else:
                fallback += report.bytes
    return GraphMemory(sum(by_key.values()) + fallback, by_key, fallback)


def probe_keys(keys: Sequence[GraphKey], probes: int) -> list[GraphKey]:
    """The keys to capture for an estimate, largest first: the largest and ``probes - 1`` more spread
    evenly over the rest by position, from the next largest to the smallest, so the fit interpolates
    between measured points and never extrapolates past them."""
    ordered = sorted(keys, key=GraphKey.sort_key, reverse=True)
    if len(ordered) <= probes:
        return ordered
    rest = ordered[1:]
    picks = {round(i * (len(rest) - 1) / max(1, probes - 2)) for i in range(probes - 1)}
    return [ordered[0], *(rest[i] for i in sorted(picks))]


def fit_bytes(points: Mapping[int, int], tokens: int) -> int:
    """Bytes at ``tokens`` by piecewise-linear interpolation through ``points`` (tokens -> bytes), extended
    past either end with the nearest segment's slope (a single point: its bytes), never below 0."""
    xs = sorted(points)
    if not xs:
        return 0
    if len(xs) == 1:
        return points[xs[0]]
    i = min(max(bisect.bisect_left(xs, tokens), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return max(0, round(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)))


def estimate(sets: GraphSets, probes: int | None = None) -> GraphMemoryEstimate:
    """Capture ``probes`` keys into every graph set, measure, fit every other key; the caller releases
    the probes' graphs (and must not have captured yet: after capture, :func:`graph_memory` is exact).

    ``probes=None`` (the default) or at least the number of keys captures every key: the estimate is then a
    measurement. Why that is the default: a CUDA pool grows in whole segments (2 MiB for small blocks, 20
    MiB and more for large ones), so which key adds a segment is not a smooth function of its size, and a
    fit through 4 of 9 keys missed the measured total by 43-57% on an H200 (benchmarks/results/
    h200-memory.json); a capture without compile costs about 0.1 s per key there.
    """
    plan = sets.plan
    if probes is not None and (not isinstance(probes, int) or isinstance(probes, bool) or probes < 2):
        raise ConfigError(f"estimate_graph_memory(probes=) must be None or an int >= 2, got {probes!r}")
    keys = plan.schedule.keys()
    if not sets.primary.backend.uses_graphs or not keys:
        return GraphMemoryEstimate(0, {}, {}, "no graphs (eager mode)", 0.0)
    lazy = plan.capture.lazy
    chosen = probe_keys(keys, len(keys) if probes is None else probes)
    start = time.perf_counter()
    for graphs in sets.all:
        graphs.backend.prepare(plan.inputs, () if lazy else keys)
    # One session, largest first, into every set as capture() does (a lazy runner: a pool per key).
    report = sets.capture(chosen, collect=False, keep=False, quiet=True)
    seconds = time.perf_counter() - start
    measured = _bytes(report.keys)
    by_key = _predict(keys, measured, chosen[0], lazy, skip=set(report.failed))
    fallback = _predict(keys, _bytes(report.fallback), chosen[0], lazy)
    if len(chosen) == len(keys):  # the default: nothing to fit
        method = f"every key captured once into a throw-away {'pool per key' if lazy else 'shared pool'}"
    elif lazy:
        method = f"piecewise-linear bytes over tokens through {len(chosen)} probed sizes (a pool per key)"
    else:
        method = (
            f"largest key measured, the others' marginal bytes piecewise-linear over tokens through "
            f"{len(chosen) - 1} probed sizes (one shared pool, largest first)"
        )
    if sets.fallback is not None:
        method += f"; the {sets.fallback.backend.name} fallback set's the same way"
    fallback_bytes = sum(fallback.values())
    total = sum(by_key.values()) + fallback_bytes
    logger.info(
        "devgraph: %s: estimated graph memory %.1f MiB over %d keys from %d probes in %.2f s",
        plan.phase,
        total / 2**20,
        len(keys),
        len(chosen),
        seconds,
    )
    probed = {str(k): b for k, b in sorted(measured.items(), key=lambda kv: kv[0].sort_key())}
    return GraphMemoryEstimate(
        total, {str(k): b for k, b in by_key.items()}, probed, method, seconds, fallback_bytes
    )


def _bytes(reports: Sequence[KeyReport]) -> dict[GraphKey, int]:
    return {r.key: r.bytes for r in reports}


def _predict(
    keys: Sequence[GraphKey], measured: Mapping[GraphKey, int], largest: GraphKey, lazy: bool, skip: Any = ()
) -> dict[GraphKey, int]:
    """Every key's bytes in one set: measured where probed, else fitted (a lazy runner: over the probes'
    bytes per token count; a shared pool: over the marginal bytes of the probes other than the largest).
    ``skip``: keys the set will not hold (the primary's, left to the fallback). No probe: no bytes."""
    if not measured:
        return {}
    points = _per_tokens(measured if lazy else {k: b for k, b in measured.items() if k != largest})
    return {key: measured.get(key, fit_bytes(points, key.tokens)) for key in keys if key not in skip}


def _per_tokens(measured: Mapping[GraphKey, int]) -> dict[int, int]:
    """Bytes per token count (keys differing on other axes or variants: their mean)."""
    sums: dict[int, list[int]] = {}
    for key, nbytes in measured.items():
        sums.setdefault(key.tokens, []).append(nbytes)
    return {t: round(sum(v) / len(v)) for t, v in sums.items()}
