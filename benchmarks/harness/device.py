"""The few device calls the benchmarks make (CUDA events on a GPU, ``perf_counter`` on the CPU, where
``--smoke`` runs the same code on the simulated graphs), host-time sampling, and the time budget."""

from __future__ import annotations

import gc
import logging
import platform as host_platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Batch", "Budget", "Device", "MiB", "host_us", "start"]

Batch = dict[str, torch.Tensor]
MiB = 1 << 20


class Device:
    """The few device calls the benchmarks make: real on CUDA, trivial on the CPU (``--smoke``)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if self.cuda
            else None
        )

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved()) if self.cuda else 0

    def settle(self, full_gc: bool = False) -> None:
        """Finish queued work and return the allocator's unused cache, so reserved bytes mean live bytes.

        Only the young ``gc`` generations are collected unless ``full_gc`` (a full collection of a heap
        holding torch.compile's state takes a good part of a second, and nothing measured needs it).
        """
        self.sync()
        gc.collect() if full_gc else gc.collect(1)
        if self.cuda:
            torch.cuda.empty_cache()

    def name(self) -> str:
        if self.cuda:
            return torch.cuda.get_device_name()
        return f"cpu ({host_platform.processor() or host_platform.machine()})"

    def time_step(self, step: Callable[[], Any]) -> tuple[float, float]:
        """``(latency ms, host ms)`` of one step on an idle device.

        Latency: CUDA events recorded before and after the step's launches, so it runs from the moment the
        host starts the step to the end of its last kernel (the host's own cost shows where the device
        waits for it). Host: ``perf_counter`` until the step returns, nothing synchronized.
        """
        self.sync()
        if self._events is None:
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            return (t1 - t0) * 1e3, (t1 - t0) * 1e3
        start, end = self._events
        t0 = time.perf_counter()
        start.record()
        step()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)), (t1 - t0) * 1e3


def host_us(dev: Device, call: Callable[[], Any], iters: int) -> float:
    """Median host microseconds of ``call`` on an idle device (synchronized before each call, not inside)."""
    samples = []
    for _ in range(iters):
        dev.sync()
        t0 = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    dev.sync()
    return statistics.median(samples)


@dataclass
class Budget:
    """Seconds this run may take; optional sections ask before they start."""

    seconds: float
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, estimate: float) -> bool:
        return self.left() >= estimate


def start(smoke: bool) -> bool:
    """Log at INFO with times; ``False`` (after saying why on stderr) when a GPU run finds no CUDA GPU."""
    if not smoke and not torch.cuda.is_available():
        print("no CUDA GPU here; use --smoke to check the script on the CPU", file=sys.stderr)
        return False
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return True
