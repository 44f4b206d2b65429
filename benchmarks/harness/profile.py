"""Device time by kernel name over a few steps (torch.profiler): what a step runs, and for how long."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["kernel_times"]


def kernel_times(step: Callable[[], Any], steps: int) -> dict[str, tuple[float, float]]:
    """Per kernel name (cut to 100 characters): ``(launches, device microseconds)`` per step, over ``steps``
    steps after one untimed step."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
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
