"""The CPU platform: simulated device graphs, so every graph strategy runs in CPU-only CI."""

from __future__ import annotations

import contextlib
import os
import platform as _host
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from devgraph.contract.platform import Availability, DeviceGraph, GraphPlatform
from devgraph.errors import CaptureError
from devgraph.messages import CAUSE_ATTRIBUTE, capture_oom
from devgraph.platforms.sim import graph as _sim
from devgraph.platforms.sim.device_memory import SIM_MEMORY

__all__ = ["CpuSimPlatform", "SimStream"]


class SimStream:
    """A stand-in for a device stream: the CPU runs work in issue order, so there is nothing to wait on."""

    def __init__(self, name: str = "side") -> None:
        self.name = name

    def synchronize(self) -> None:
        """Wait for the stream's work (already done on the CPU)."""

    def wait_stream(self, stream: SimStream) -> None:
        """Order this stream after ``stream`` (a no-op on the CPU)."""

    def query(self) -> bool:
        """Whether all work on the stream has finished (always, on the CPU)."""
        return True

    def __repr__(self) -> str:
        return f"SimStream({self.name})"


_DEFAULT_STREAM = SimStream("default")


class _CurrentStream(threading.local):
    stream: SimStream = _DEFAULT_STREAM
    ooms: int = 0  # the simulated allocator's failures when this thread's capture began


_current = _CurrentStream()


def _to_graph(graph: DeviceGraph) -> _sim.SimGraph:
    if not isinstance(graph, _sim.SimGraph):
        raise CaptureError(f"the CPU simulator captures into a SimGraph (from new_graph()), got {graph!r}")
    return graph


def _meminfo() -> tuple[int, int] | None:
    """``(available, total)`` bytes from /proc/meminfo, or ``None`` where it is missing (not Linux)."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[key] = int(parts[0]) * 1024  # the file counts kB
    except OSError:
        return None
    if "MemAvailable" in fields and "MemTotal" in fields:
        return fields["MemAvailable"], fields["MemTotal"]
    return None


def _sysconf_memory() -> tuple[int, int]:
    """``(available, total)`` bytes from sysconf; available falls back to total where it is unknown."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return 0, 0
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        free = total
    return free, total


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return _host.processor() or _host.machine() or "unknown CPU"


class CpuSimPlatform(GraphPlatform):
    """Simulated device graphs on the CPU (see :mod:`devgraph.platforms.sim.graph`); always available.

    Capture records the aten ops the capturing thread dispatches and enforces the device rules (no host
    sync, no data-dependent shape, no nested capture); replay re-runs them on the same tensors.
    """

    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 0
    detects_host_sync: ClassVar[bool] = True
    #: A replay re-runs the recorded ops from Python: its time says nothing of a device's.
    times_replays: ClassVar[bool] = False

    def availability(self) -> Availability:
        """Always usable: the simulator needs nothing beyond torch."""
        return Availability(True, "simulated device graphs on the CPU")

    # -- graphs ------------------------------------------------------------------------------------
    def new_graph(self) -> _sim.SimGraph:
        """A new, empty :class:`SimGraph`."""
        return _sim.SimGraph()

    def graph_pool_handle(self) -> _sim.SimPool:
        """A new :class:`SimPool` that several captures can share."""
        return _sim.SimPool()

    def capture_begin(self, graph: DeviceGraph, pool: Any = None) -> None:
        """Start recording this thread's ops into ``graph``; ``pool=None`` gives it a pool of its own."""
        _current.ooms = SIM_MEMORY.ooms
        _sim.begin_capture(_to_graph(graph), pool)

    def translate_capture_error(self, error: BaseException, size: int | None) -> CaptureError | None:
        """An allocation that failed during the capture is named as such (see ``SimDeviceMemory``)."""
        failures = SIM_MEMORY.ooms - _current.ooms
        if failures <= 0:
            return None
        setattr(error, CAUSE_ATTRIBUTE, "out_of_memory")
        return CaptureError(capture_oom(error, failures), size=size)

    def capture_end(self, graph: DeviceGraph) -> None:
        """Stop recording into ``graph`` and finalize it for replay."""
        _sim.end_capture(_to_graph(graph))

    def abort_capture(self, graph: DeviceGraph) -> None:
        """Abandon a capture into ``graph`` that failed half-way and reset the graph."""
        if isinstance(graph, _sim.SimGraph):
            _sim.abort_capture(graph)
        else:
            super().abort_capture(graph)

    def note_outputs(self, pool: Any, outputs: Any) -> None:
        """A capture's outputs live as long as its graph: the pool's reuse model keeps their storages."""
        if isinstance(pool, _sim.SimPool):
            pool.keep([outputs])

    def record_opaque(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn``; while capturing, record the call itself as one step that replay calls again."""
        return _sim.record_opaque(fn, *args, **kwargs)

    def is_capturing(self) -> bool:
        """Whether the current thread is capturing into a sim graph."""
        return _sim.is_capturing()

    # -- streams -----------------------------------------------------------------------------------
    def new_stream(self) -> SimStream:
        """A new (trivial) side stream."""
        return SimStream()

    def current_stream(self) -> SimStream:
        """This thread's current stream (the default stream unless :meth:`stream` chose another)."""
        return _current.stream

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        """Make ``stream`` current on this thread for the enclosed code."""
        previous = _current.stream
        _current.stream = stream
        try:
            yield stream
        finally:
            _current.stream = previous

    def synchronize(self) -> None:
        """Nothing to wait for: CPU ops have finished when they return."""

    # -- memory ------------------------------------------------------------------------------------
    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of host memory (MemAvailable / MemTotal)."""
        return _meminfo() or _sysconf_memory()

    def reserved_bytes(self) -> int:
        """Bytes held by live sim graphs (storages their ops allocated during capture)."""
        return _sim.reserved_bytes()

    def describe(self) -> str:
        """A one-line description for ``devgraph info``."""
        return (
            f"cpu: simulated device graphs on {_cpu_name()} "
            f"({torch.get_num_threads()} threads, torch {torch.__version__})"
        )
