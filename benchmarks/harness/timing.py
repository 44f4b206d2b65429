"""Timing variants over the same cases: median latency of interleaved variants, and what building one
(capture, compile) cost in seconds and device bytes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.device import Device

__all__ = ["Variant", "graph_of", "measure_build", "steps_in_turns", "time_cases"]


@dataclass
class Variant:
    """One way of running a phase: a step per case, what building it cost, how to release it."""

    name: str
    step: Callable[[str], Any]
    info: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    runner: Any = None


def time_cases(
    variants: Sequence[Variant],
    cases: Sequence[str],
    dev: Device,
    *,
    iters: int,
    rounds: int,
    on_error: Callable[[str, BaseException], None],
    warm_steps: int = 3,
    before_step: Callable[[], None] = lambda: None,
) -> dict[str, dict[str, dict[str, float]]]:
    """``result[variant][case]``: median latency and host ms over ``iters`` steps.

    Per case every variant first runs ``warm_steps`` untimed steps, then the variants take turns for
    ``rounds`` rounds of ``iters / rounds`` steps, so clock and thermal drift hit them alike. A variant
    that fails on a case is reported through ``on_error`` and left out of that case.
    """
    out: dict[str, dict[str, dict[str, float]]] = {v.name: {} for v in variants}
    per_round = max(1, iters // rounds)
    for case in cases:
        alive = []
        for v in variants:
            try:
                for _ in range(warm_steps):
                    before_step()
                    v.step(case)
                dev.sync()
                alive.append(v)
            except Exception as exc:
                on_error(f"{v.name} at {case}", exc)
        latency: dict[str, list[float]] = {v.name: [] for v in alive}
        host: dict[str, list[float]] = {v.name: [] for v in alive}
        for _ in range(rounds):
            for v in list(alive):
                call = _bind(v.step, case)
                try:
                    for _ in range(per_round):
                        before_step()
                        ms, host_ms = dev.time_step(call)
                        latency[v.name].append(ms)
                        host[v.name].append(host_ms)
                except Exception as exc:
                    on_error(f"{v.name} at {case}", exc)
                    alive.remove(v)
        for v in alive:
            out[v.name][case] = {
                "ms": round(statistics.median(latency[v.name]), 4),
                "host_ms": round(statistics.median(host[v.name]), 4),
                "min_ms": round(min(latency[v.name]), 4),
                "steps": len(latency[v.name]),
            }
    return out


def _bind(step: Callable[[str], Any], case: str) -> Callable[[], Any]:
    return lambda: step(case)


def measure_build(dev: Device, build: Callable[[], Any]) -> tuple[Any, float, int]:
    """``(result, seconds, graph bytes)``: wall time of ``build`` (device synchronized at the end) and the
    growth of reserved device memory across it, the allocator's cache emptied before and after."""
    dev.settle()
    before = dev.reserved()
    t0 = time.perf_counter()
    result = build()
    dev.sync()
    seconds = time.perf_counter() - t0
    dev.settle()
    return result, seconds, dev.reserved() - before


def graph_of(call: Callable[[], Any]) -> tuple[Any, Any]:
    """``(graph, outputs)``: a ``torch.cuda.CUDAGraph`` of ``call``, warmed up once on a side stream first
    (the standard recipe, torch's own capture stream), and replayed once."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    graph.replay()
    torch.cuda.synchronize()
    return graph, outputs


def steps_in_turns(calls: dict[str, Callable[[], Any]], rounds: int = 7, steps: int = 20) -> dict[str, float]:
    """Median milliseconds of one call per variant, each timed with CUDA events over ``steps`` calls back to
    back, the variants taking turns for ``rounds`` rounds (so clock and thermal drift hit all alike)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            torch.cuda.synchronize()
            start.record()
            for _ in range(steps):
                call()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / steps)
    return {name: statistics.median(values) for name, values in times.items()}
