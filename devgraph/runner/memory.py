"""A runner's graph memory: exact per key after capture (:func:`graph_memory`), estimated before it
(:func:`estimate`), so an engine can size its KV cache with the graphs accounted for.

The estimate captures a few probe keys the way ``capture()`` will (largest first, into one shared pool, or
one pool per key for a lazily capturing runner), reads the bytes the pool grew by for each, releases them
all (the memory goes back to the device), and fits the rest. Why this model: in a shared pool the largest
key, captured first, reserves the intermediates every later key reuses; each smaller key then adds its
own outputs and the blocks its graph keeps, which grow with its token count (row-major activations), plus
a constant (the allocator's block rounding, per-graph workspaces). So the total is the largest key's bytes,
measured, plus a piecewise-linear fit of the smaller keys' marginal bytes over tokens through the probed
points (extended past the last with its segment's slope). Piecewise rather than one line because the
device allocator rounds to blocks (2 MiB segments for large tensors on CUDA): the bytes rise in steps,
and a fit through measured points follows those steps where one line through the ends would not.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devgraph.contract.keys import GraphKey
from devgraph.errors import ConfigError
from devgraph.runner import lifecycle

__all__ = ["GraphMemory", "GraphMemoryEstimate", "estimate", "fit_bytes", "graph_memory", "probe_keys"]

logger = logging.getLogger(__name__)

#: A :class:`~devgraph.runner.graph_runner.GraphRunner` (not imported: it imports this module).
GraphRunner = Any


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

    ``total_bytes``: the prediction for every key; ``by_key``: each key's predicted (or, for a probed key,
    measured) bytes; ``probed``: the bytes measured per probed key; ``method``: how the rest was fitted;
    ``seconds``: what probing cost (captures and warm-ups included).
    """

    total_bytes: int
    by_key: Mapping[str, int]
    probed: Mapping[str, int]
    method: str
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes,
            "by_key": dict(self.by_key),
            "probed": dict(self.probed),
            "method": self.method,
            "seconds": round(self.seconds, 4),
        }


def graph_memory(runner: GraphRunner) -> GraphMemory:
    """Exact bytes per captured key, from the capture reports (``capture()`` measured each key's growth)."""
    by_key: dict[str, int] = {}
    fallback = 0
    for graphs in runner._sets.all:
        for key, report in sorted(graphs.reports.items(), key=lambda kv: kv[0].sort_key()):
            if graphs is runner._graphs:
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


def estimate(runner: GraphRunner, probes: int | None = None) -> GraphMemoryEstimate:
    """Capture ``probes`` keys into a throw-away pool, measure, release them all, fit every other key.

    The runner must not have captured yet (after capture, :func:`graph_memory` gives the exact bytes).
    ``probes=None`` (the default) or at least the number of keys captures every key: the estimate is then a
    measurement. Why that is the default: a CUDA pool grows in whole segments (2 MiB for small blocks, 20
    MiB and more for large ones), so which key adds a segment is not a smooth function of its size, and a
    fit through 4 of 9 keys missed the measured total by 43-57% on an H200 (benchmarks/results/
    h200-memory.json); a capture without compile costs about 0.1 s per key there.
    """
    plan = runner.plan
    if probes is not None and (not isinstance(probes, int) or isinstance(probes, bool) or probes < 2):
        raise ConfigError(f"estimate_graph_memory(probes=) must be None or an int >= 2, got {probes!r}")
    if runner._captured or runner._background is not None or runner._released is not None:
        raise ConfigError(
            f"the {plan.phase} runner has captured (or is capturing, or was released); estimate graph "
            "memory before capture(), or read the exact bytes with graph_memory()"
        )
    keys = plan.schedule.keys()
    graphs, backend = runner._graphs, runner.backend
    if not backend.uses_graphs or not keys:
        return GraphMemoryEstimate(0, {}, {}, "no graphs (eager mode)", 0.0)
    lazy = plan.capture.lazy
    chosen = probe_keys(keys, len(keys) if probes is None else probes)
    start = time.perf_counter()
    measured: dict[GraphKey, int] = {}
    backend.prepare(plan.inputs, () if lazy else keys)
    try:
        with runner.pool.capturing() if runner.pool is not None else contextlib.nullcontext():
            if lazy:  # each key in a pool of its own, as a lazy runner captures
                for key in chosen:
                    measured.update(
                        (r.key, r.bytes) for r in graphs.capture([key], collect=False, quiet=True)
                    )
            else:  # one session, largest first, as capture() does
                measured.update((r.key, r.bytes) for r in graphs.capture(chosen, collect=False, quiet=True))
    finally:
        lifecycle.release_all(runner)  # the probes' graphs and pool, then the cache back to the device
        plan.platform.empty_cache()
    seconds = time.perf_counter() - start
    largest = chosen[0]
    by_key: dict[str, int] = {}
    if len(measured) == len(keys):  # the default: nothing to fit
        method = f"every key captured once into a throw-away {'pool per key' if lazy else 'shared pool'}"
        by_key = {str(key): measured[key] for key in keys}
    elif lazy:
        points = _per_tokens(measured)
        method = f"piecewise-linear bytes over tokens through {len(points)} probed sizes (a pool per key)"
        for key in keys:
            by_key[str(key)] = measured.get(key, fit_bytes(points, key.tokens))
    else:
        points = _per_tokens({k: b for k, b in measured.items() if k != largest})
        method = (
            f"largest key measured, the others' marginal bytes piecewise-linear over tokens through "
            f"{len(points)} probed sizes (one shared pool, largest first)"
        )
        for key in keys:
            by_key[str(key)] = measured.get(key, fit_bytes(points, key.tokens))
    total = sum(by_key.values())
    logger.info(
        "devgraph: %s: estimated graph memory %.1f MiB over %d keys from %d probes in %.2f s",
        plan.phase,
        total / 2**20,
        len(keys),
        len(measured),
        seconds,
    )
    probed = {str(k): b for k, b in sorted(measured.items(), key=lambda kv: kv[0].sort_key())}
    return GraphMemoryEstimate(total, by_key, probed, method, seconds)


def _per_tokens(measured: Mapping[GraphKey, int]) -> dict[int, int]:
    """Bytes per token count (keys differing on other axes or variants: their mean)."""
    sums: dict[int, list[int]] = {}
    for key, nbytes in measured.items():
        sums.setdefault(key.tokens, []).append(nbytes)
    return {t: round(sum(v) / len(v)) for t, v in sums.items()}
