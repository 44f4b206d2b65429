"""The platform graph API: the few primitives a device must offer for devgraph to capture graphs.

A vendor plug-in implements :class:`GraphPlatform` once (CUDA, HIP, Ascend, the CPU simulator) and
every strategy in :mod:`devgraph.strategies` runs on it unchanged.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from devgraph.errors import CaptureError
from devgraph.messages import describe_error, shorten

__all__ = ["Availability", "DeviceEvent", "DeviceGraph", "DoneEvent", "GraphPlatform", "ask_availability"]


@dataclass(frozen=True)
class Availability:
    """Whether a platform (or backend) can be used on this machine, and if not, why."""

    usable: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.usable


def ask_availability(ask: Callable[[], object]) -> Availability:
    """Call a plug-in's ``availability()`` defensively: only a real :class:`Availability` counts.

    A method that raises, or answers with a bool or anything else, makes its platform or backend unusable
    with a reason that says so, instead of passing for usable (``bool(True)``) or breaking the caller.
    """
    try:
        answer = ask()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit from a vendor probe included: one platform, not the process
        return Availability(False, f"availability() raised {describe_error(exc)}")
    if isinstance(answer, Availability):
        return answer
    kind = "a bool" if isinstance(answer, bool) else f"a {type(answer).__name__}"
    return Availability(
        False, f"availability() returned {shorten(answer)} ({kind}), not devgraph.Availability"
    )


@runtime_checkable
class DeviceGraph(Protocol):
    """One captured graph: replayable, resettable (``torch.cuda.CUDAGraph`` satisfies this)."""

    def replay(self) -> None: ...

    def reset(self) -> None: ...


@runtime_checkable
class DeviceEvent(Protocol):
    """A point in a stream's work (``torch.cuda.Event`` satisfies this): whether the work issued before it
    has finished, and a wait for it."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DoneEvent:
    """The event of a device whose work has finished when the call that issued it returns (the CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


class GraphPlatform(ABC):
    """A device that can capture and replay graphs.

    Subclasses set ``name`` (``cuda``, ``rocm``, ``npu``, ``cpu`` or a vendor's own), ``device_type``
    (the ``torch.device`` type its tensors live on) and ``priority`` (higher wins when devgraph picks
    the best device present). Capture is split into :meth:`capture_begin` / :meth:`capture_end` rather
    than one context manager so the ``breakable`` strategy can end a graph at a break op and begin the
    next one without leaving the model's forward.
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    priority: ClassVar[int] = 0
    #: Whether a capture on this platform fails when the forward syncs with the host (``.item()``);
    #: the conformance kit may skip its host-sync check only where this is False.
    detects_host_sync: ClassVar[bool] = False
    #: Whether :meth:`time_replays` measures what a replay costs on the device. A compiling strategy times
    #: its compiled graph against the plain one only where it does (the CPU simulator says no: there the
    #: compiled graph is kept, unless the strategy is given a timer).
    times_replays: ClassVar[bool] = True
    #: Eager runs of the forward on the capture stream before each key's capture (lazy handles, cuBLAS
    #: workspaces and compiles happen there, not inside the capture).
    warmup_iters: ClassVar[int] = 2

    # -- detection -------------------------------------------------------------------------------
    @abstractmethod
    def availability(self) -> Availability:
        """Whether this platform can run here; ``reason`` says why not (what to install or check)."""

    def matches(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` belong to this platform."""
        return device.type == self.device_type

    def default_device(self) -> torch.device:
        """The device the demo and the factory use when the caller names none."""
        return torch.device(self.device_type)

    # -- graphs ----------------------------------------------------------------------------------
    @abstractmethod
    def new_graph(self) -> DeviceGraph:
        """A new, empty graph object."""

    @abstractmethod
    def graph_pool_handle(self) -> Any:
        """A memory-pool handle that several captures can share."""

    @abstractmethod
    def capture_begin(self, graph: DeviceGraph, pool: Any) -> None:
        """Start recording the work issued on the current stream into ``graph``, allocating from ``pool``."""

    @abstractmethod
    def capture_end(self, graph: DeviceGraph) -> None:
        """Stop recording into ``graph``; it can be replayed afterwards."""

    def abort_capture(self, graph: DeviceGraph) -> None:
        """End a capture that failed half-way, swallowing the follow-on error the device raises."""
        with contextlib.suppress(Exception):
            self.capture_end(graph)
        with contextlib.suppress(Exception):
            graph.reset()

    def allocate_into(self, pool: Any) -> contextlib.AbstractContextManager[None]:
        """Context in which eager allocations on the current stream come from the graph ``pool``.

        Break ops run eagerly between graph segments at capture; their outputs allocated in the pool can
        be reused by later segments and sizes once dead, instead of pinning memory of their own per size.
        Platforms without pools: a no-op.
        """
        return contextlib.nullcontext()

    def weak_alias(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor over ``tensor``'s memory that does not keep that memory alive.

        A replay plan holds break-op arguments and outputs through these, so the pool may reuse their
        memory once the capture no longer needs them (only one key replays at a time, in capture order).
        Platforms that cannot alias without owning return ``tensor`` itself.
        """
        return tensor

    def note_outputs(self, pool: Any, outputs: Any) -> None:  # noqa: B027 - optional hook
        """Told, after each capture into ``pool``, the outputs it returned: tensors that stay alive while
        the graph lives, so the pool cannot reuse their memory for later captures. Devices whose allocator
        tracks that itself need nothing (the default); the CPU simulator models a device pool with it."""

    def record_opaque(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` inside the current capture so that replay runs it again.

        Real devices capture the kernels ``fn`` launches, so the default just calls it. The CPU
        simulator records the call itself, because compiled code it cannot see op by op may run inside.
        """
        return fn(*args, **kwargs)

    def translate_capture_error(self, error: BaseException, size: int | None) -> CaptureError | None:
        """Turn a vendor error raised during capture into a :class:`CaptureError` with advice, or ``None``."""
        return None

    # -- streams ---------------------------------------------------------------------------------
    @abstractmethod
    def new_stream(self) -> Any:
        """A new side stream for capture."""

    @abstractmethod
    def current_stream(self) -> Any:
        """The stream work is issued on now."""

    @abstractmethod
    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager that makes ``stream`` current."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all work on the device to finish."""

    def time_replays(self, replay: Callable[[], None], iters: int) -> float:
        """Seconds one call of ``replay`` takes on the device, averaged over ``iters`` calls in a row.

        Strategies time two ways of serving a key with this (a compiled graph against a plain one). The
        default is the host's clock around a synchronized loop, right for the CPU simulator and for any
        device whose :meth:`synchronize` waits for its work; a device with timing events overrides it so
        that host jitter does not count.
        """
        self.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            replay()
        self.synchronize()
        return (time.perf_counter() - start) / max(iters, 1)

    def record_event(self) -> DeviceEvent:
        """An event recorded on the current stream now: it completes when the work issued on that stream
        before it does (a runner's ``submit()`` hands it out after a step). The default suits a device
        whose work is done when issued; an asynchronous device records a real event."""
        return DoneEvent()

    # -- memory ----------------------------------------------------------------------------------
    @abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of device memory."""

    def reserved_bytes(self) -> int:
        """Bytes the device allocator holds now (capture reports the growth per size); 0 if unknown."""
        return 0

    def empty_cache(self) -> None:  # noqa: B027 - optional hook; devices without a cache need nothing
        """Return cached, unused device memory to the device."""

    @contextlib.contextmanager
    def capture_guard(self) -> Iterator[None]:
        """Context entered around a whole capture session (e.g. to forbid host syncs); default no-op."""
        yield

    def describe(self) -> str:
        """A one-line description for ``devgraph info`` (device name, runtime version)."""
        return self.name
