"""Device time by kernel name over a few steps (torch.profiler): what a step runs, and for how long."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["kernel_times", "replay_gaps"]


def _profiled(step: Callable[[], Any], steps: int, activities: list[Any]) -> Any:
    """The profiler of ``steps`` calls of ``step`` (``activities``), after one untimed call."""
    from torch.profiler import profile

    with torch.no_grad():
        step()
        torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    return prof


def kernel_times(step: Callable[[], Any], steps: int) -> dict[str, tuple[float, float]]:
    """Per kernel name (cut to 100 characters): ``(launches, device microseconds)`` per step, over ``steps``
    steps after one untimed step."""
    from torch.profiler import ProfilerActivity

    prof = _profiled(step, steps, [ProfilerActivity.CUDA])
    times: dict[str, tuple[float, float]] = {}
    for event in prof.key_averages():
        spent = getattr(event, "self_device_time_total", None)
        if spent is None:
            spent = getattr(event, "self_cuda_time_total", 0.0)
        if spent:
            name = event.key[:100]
            launches, us = times.get(name, (0.0, 0.0))
            times[name] = (launches + event.count / steps, us + float(spent) / steps)
    return times


def replay_gaps(step: Callable[[], Any], steps: int) -> dict[str, Any]:
    """:func:`_replay_gaps` profiling the device alone; where the trace then lacks the host's launch calls
    (an older profiler), profiling the host's ops too."""
    from torch.profiler import ProfilerActivity

    result = _replay_gaps(step, steps, [ProfilerActivity.CUDA])
    if result.get("gaps"):
        return {**result, "profiled": "device"}
    return {
        **_replay_gaps(step, steps, [ProfilerActivity.CPU, ProfilerActivity.CUDA]),
        "profiled": "host and device",
    }


def _replay_gaps(step: Callable[[], Any], steps: int, activities: list[Any]) -> dict[str, Any]:
    """What the device runs between one CUDA-graph replay and the next, over ``steps`` calls of ``step``.

    The profiler's trace ties each kernel to the host call that launched it (its correlation id); the
    kernels of a ``cudaGraphLaunch`` are a replay. Between the end of one replay and the start of the next
    the device runs the step's other work (copies, sampling, staging) or waits: per gap, its length, the
    time the device was busy in it, and every op run in it. Medians over the gaps, and per op name its
    median count and duration per gap (microseconds).

    ``lead``: how long before the device started an op (the replay included) the host's call that
    launched it had returned. Near zero or below, the device waited for the host (the host was late);
    large, the op waited in the queue (the host was ahead). Only the device's activity is profiled (no
    per-op host recording), so the host runs close to its own speed.
    """
    import json
    import os
    import statistics
    import tempfile

    prof = _profiled(step, steps, activities)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    graph_launches = {
        e["args"].get("correlation")
        for e in events
        if e.get("ph") == "X" and e.get("name") == "cudaGraphLaunch" and "args" in e
    }
    # when each host call that launched device work returned, by correlation id
    returned = {
        e["args"]["correlation"]: float(e["ts"]) + float(e.get("dur", 0.0))
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in {"cuda_runtime", "cuda_driver"}
        and "correlation" in e.get("args", {})
    }
    device = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in {"kernel", "gpu_memcpy", "gpu_memset"}),
        key=lambda e: float(e["ts"]),
    )
    # (start, end, name, in a replay, lead) in device order; replays merged into one span each
    spans: list[tuple[float, float, str, bool, float | None]] = []
    for e in device:
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        correlation = e.get("args", {}).get("correlation")
        replay = correlation in graph_launches
        if replay and spans and spans[-1][3] and spans[-1][2] == f"replay {correlation}":
            spans[-1] = (spans[-1][0], max(spans[-1][1], end), spans[-1][2], True, spans[-1][4])
        else:
            name = f"replay {correlation}" if replay else e["name"][:80]
            lead = start - returned[correlation] if correlation in returned else None
            spans.append((start, end, name, replay, lead))
    replays = [i for i, s in enumerate(spans) if s[3]]
    gaps = []
    for a, b in zip(replays, replays[1:], strict=False):
        inside = spans[a + 1 : b]
        length = spans[b][0] - spans[a][1]
        busy = sum(s[1] - s[0] for s in inside)
        gaps.append(
            {
                "us": length,
                "busy_us": busy,
                "ops": [(s[2], s[0] - spans[a][1], s[1] - s[0], s[4]) for s in inside],
                "replay_lead": spans[b][4],
            }
        )
    if not gaps:
        return {"replays": len(replays), "gaps": 0, "note": "fewer than two replays found in the trace"}
    names: dict[str, list[float]] = {}
    leads: dict[str, list[float]] = {}
    counts: dict[str, list[int]] = {}
    for gap in gaps:
        seen: dict[str, int] = {}
        for name, _, us, lead in gap["ops"]:
            names.setdefault(name, []).append(us)
            if lead is not None:
                leads.setdefault(name, []).append(lead)
            seen[name] = seen.get(name, 0) + 1
        for name in names:
            counts.setdefault(name, []).append(seen.get(name, 0))
    replay_us = [spans[i][1] - spans[i][0] for i in replays]
    return {
        "replays": len(replays),
        "gaps": len(gaps),
        "replay_us_median": round(statistics.median(replay_us), 1),
        "gap_us_median": round(statistics.median(g["us"] for g in gaps), 1),
        "busy_us_median": round(statistics.median(g["busy_us"] for g in gaps), 1),
        "idle_us_median": round(statistics.median(g["us"] - g["busy_us"] for g in gaps), 1),
        "ops_per_gap_median": statistics.median(len(g["ops"]) for g in gaps),
        "replay_lead_us_median": _median([g["replay_lead"] for g in gaps if g["replay_lead"] is not None]),
        "by_op": {
            name: {
                "per_gap": statistics.median(counts[name]),
                "us_median": round(statistics.median(us), 2),
                "lead_us_median": _median(leads.get(name, [])),
            }
            for name, us in sorted(names.items(), key=lambda kv: -sum(kv[1]))
        },
        # one gap in full: each op's name, its start after the replay's end, its duration, its lead
        "example_gap": [
            (name, round(at, 1), round(us, 2), None if lead is None else round(lead, 1))
            for name, at, us, lead in gaps[len(gaps) // 2]["ops"]
        ],
    }


def _median(values: list[float]) -> float | None:
    import statistics

    return round(statistics.median(values), 1) if values else None
