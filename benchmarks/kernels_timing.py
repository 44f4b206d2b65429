"""How ``bench_kernels.py`` times a kernel: GPU time by CUDA events with L2 evicted before each run and the
host kept ahead (its docstring says why), host time per call, the copy bandwidth the floor is taken at, and
the relative L2 error. On the CPU (``--smoke``) the wall clock stands in."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Timer", "copy_bandwidth", "host_time", "rel_l2"]


class Timer:
    """Median GPU time of a callable, L2 evicted before each run (see the module docstring)."""

    def __init__(self, iters: int, device: str) -> None:
        self.iters = iters
        self.device = device
        self.flush = torch.ones(256 * 2**20 if device == "cuda" else 1, dtype=torch.uint8, device=device)

    def __call__(self, fn: Callable[[], Any], iters: int | None = None, *, cold: bool = True) -> float:
        """``cold``: evict L2 before each run (reading, not writing, so no dirty lines are left)."""
        iters = iters or self.iters
        for _ in range(3):
            fn()
        if self.device != "cuda":  # --smoke: wall clock
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times) * 1e6
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for start, end in zip(starts, ends, strict=True):
            if cold:
                self.flush.max()
            torch.cuda._sleep(500_000)  # ~0.3 ms of GPU cycles: the host enqueues the rest meanwhile
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return (
            statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) * 1e3
        )  # microseconds


def host_time(fn: Callable[[], Any], device: str, calls: int = 50) -> float:
    """Median host wall time of one call in microseconds (the GPU runs behind; no synchronisation)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write counted)."""
    if device != "cuda":
        return 1e10  # --smoke: any number
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-6))
