"""Graph primitives over ``torch.accelerator.Graph``: device graphs on whatever accelerator this torch drives
(NVIDIA CUDA, AMD through a ROCm build, Intel XPU, an out-of-tree device that registers a graph
implementation with torch), with no vendor package.

torch 2.12 added ``torch.accelerator.Graph`` (``keep_graph``, ``pool``, ``capture_error_mode``) beside the
device-neutral streams (``torch.Stream``, ``torch.accelerator.current_stream`` / ``set_stream``) and memory
calls that earlier releases already had. Everything here is found by feature, never by version string: a
torch without one of the calls in :data:`ACCELERATOR_API` makes the platform unusable, and the reason names
the torch version and each missing call. This module imports nothing but torch and the contract.

What the vendor-neutral API does not offer, and so this platform does not do (docs/hardware.md):

* routing eager allocations into a graph pool (``allocate_into``): break ops' outputs hold memory of their
  own per size instead of sharing the pool, so ``breakable`` and ``tc_piecewise`` use more graph memory
  than on the CUDA plug-in;
* giving back the pool of a capture the device invalidated (the CUDA plug-in reaches torch's private
  allocator calls for that): the blocks of such a failed capture stay reserved until the process ends.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from devgraph.contract.platform import Availability, DeviceGraph, GraphPlatform
from devgraph.errors import BackendUnavailableError, CaptureError
from devgraph.messages import HOST_SYNC, HOST_SYNC_ADVICE, describe_error

__all__ = [
    "ACCELERATOR_API",
    "GRAPH_RELEASE",
    "AcceleratorGraphPlatform",
    "AcceleratorPool",
    "missing_api",
]

#: The ``torch.accelerator`` calls the platform makes; a torch lacking any of them cannot run it.
ACCELERATOR_API = (
    "Graph",
    "current_accelerator",
    "is_available",
    "current_device_index",
    "current_stream",
    "set_stream",
    "synchronize",
    "get_memory_info",
    "memory_reserved",
    "empty_cache",
)
#: The torch release that first shipped ``torch.accelerator.Graph`` (its release notes), for the refusal.
GRAPH_RELEASE = "2.12"
#: Other threads of an engine may keep using the device while one captures (the same choice as the CUDA
#: plug-in); torch documents each mode's meaning as backend-specific.
CAPTURE_ERROR_MODE = "thread_local"

# Device errors that mean the captured region synchronized with the host or made a non-capturable call:
# CUDA's and HIP's runtime texts, and torch's "<call> during XPU graph capture" refusal.
_HOST_SYNC_ERRORS = re.compile(
    r"operation not permitted when stream is capturing|StreamCapture(Unsupported|Invalidated|Implicit)"
    r"|during \w+ graph capture",
    re.IGNORECASE,
)

#: One capture stream per device for the process: a library's per-stream workspaces (cuBLAS keeps one per
#: handle and stream) would otherwise leak one stream's worth per runner.
_CAPTURE_STREAMS: dict[tuple[str, int], Any] = {}
#: id(graph) -> the pool of a capture in progress, whose id the capture fills in when it ends.
_CAPTURE_POOLS: dict[int, AcceleratorPool | None] = {}


def missing_api() -> list[str]:
    """The calls of :data:`ACCELERATOR_API` (and ``torch.Stream``) this torch lacks, by full name."""
    accelerator = getattr(torch, "accelerator", None)
    missing = [f"torch.accelerator.{name}" for name in ACCELERATOR_API if not hasattr(accelerator, name)]
    if not hasattr(torch, "Stream"):
        missing.append("torch.Stream")
    return missing


def _accelerator_type() -> str | None:
    """The device type torch drives as its accelerator (``cuda``, ``xpu``, ...), ``None`` without one."""
    current = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)
    if current is None:
        return None
    device = current()
    return None if device is None else str(device.type)


def _takes_mode(graph: Any) -> bool:
    """Whether this torch's ``Graph.capture_begin`` takes ``capture_error_mode`` (the first form of the API);
    later releases take it at construction and keep it in the ``capture_error_mode`` attribute."""
    try:
        return "capture_error_mode" in inspect.signature(graph.capture_begin).parameters
    except (TypeError, ValueError):
        return False


class AcceleratorPool:
    """A graph memory pool that several captures share.

    torch names a pool by an id tuple. Where it has no call that makes a fresh id
    (``torch.accelerator.generate_graph_pool_handle``), the first capture into the pool starts one of its
    own and the id comes from that graph's ``pool()`` once the capture ends; later captures pass it on. A
    first capture that fails leaves the pool without an id, so the next capture starts a fresh one (a pool
    whose first capture failed cannot be captured into again on CUDA).
    """

    __slots__ = ("handle",)

    def __init__(self, handle: tuple[int, int] | None = None) -> None:
        self.handle = handle

    def __repr__(self) -> str:
        return f"AcceleratorPool({self.handle!r})"


class AcceleratorGraphPlatform(GraphPlatform):
    """``torch.accelerator.Graph`` capture into a shared pool on a side ``torch.Stream``.

    ``device_type`` names the platform's kind; its tensors live on the device type torch reports as its
    accelerator, which is what :meth:`matches` and :meth:`default_device` answer with. Its priority sits
    above the CPU simulator and below every vendor plug-in, so it serves the devices no vendor plug-in
    claims; ``DEVGRAPH_PLATFORM=accelerator`` chooses it for a device that one does.
    """

    name: ClassVar[str] = "accelerator"
    device_type: ClassVar[str] = "accelerator"
    priority: ClassVar[int] = 1
    # CUDA and HIP captures fail on a host sync; a device whose capture lets one through fails the
    # conformance kit's capture_errors check, which is how that would be found.
    detects_host_sync: ClassVar[bool] = True

    # -- detection -------------------------------------------------------------------------------
    def availability(self) -> Availability:
        version = torch.__version__
        missing = missing_api()
        if missing:
            return Availability(
                False,
                f"torch {version} has no {', '.join(missing)} (torch.accelerator.Graph arrived in torch "
                f"{GRAPH_RELEASE}); upgrade torch, or use the device's vendor plug-in (devgraph-cuda, "
                "devgraph-rocm, devgraph-npu)",
            )
        kind = _accelerator_type()
        if kind is None:
            return Availability(
                False,
                f"torch {version} has no accelerator (torch.accelerator.current_accelerator() is None: a "
                "CPU-only build); the cpu platform simulates graphs on the CPU",
            )
        if not torch.accelerator.is_available():
            return Availability(
                False,
                f"torch {version} is built for {kind} but sees no {kind} device "
                "(torch.accelerator.is_available() is False); check the driver and the visible devices",
            )
        try:
            torch.accelerator.Graph()
        except Exception as exc:  # the device type registered no graph implementation with torch
            return Availability(
                False,
                f"torch {version} has no graph support for {kind} through torch.accelerator.Graph "
                f"({describe_error(exc)})",
            )
        return Availability(True, f"torch.accelerator.Graph on {kind} (torch {version})")

    def matches(self, device: torch.device) -> bool:
        kind = _accelerator_type()
        return kind is not None and device.type == kind

    def default_device(self) -> torch.device:
        kind = _accelerator_type()
        if kind is None:
            raise BackendUnavailableError(
                f"platform accelerator is unusable here: {self.availability().reason}"
            )
        return torch.device(kind, torch.accelerator.current_device_index())

    # -- graphs ----------------------------------------------------------------------------------
    def new_graph(self) -> DeviceGraph:
        graph: DeviceGraph = torch.accelerator.Graph(keep_graph=False)
        return graph

    def graph_pool_handle(self) -> AcceleratorPool:
        generate = getattr(torch.accelerator, "generate_graph_pool_handle", None)
        return AcceleratorPool(tuple(generate()) if generate is not None else None)

    def capture_begin(self, graph: DeviceGraph, pool: Any) -> None:
        shared = pool if isinstance(pool, AcceleratorPool) else None
        target: Any = graph
        # The pool is read from the graph at capture_begin (torch documents setting it before a capture).
        target.graph_pool = shared.handle if shared is not None else pool
        _CAPTURE_POOLS[id(graph)] = shared
        if _takes_mode(target):
            target.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
        else:
            target.capture_error_mode = CAPTURE_ERROR_MODE
            target.capture_begin()

    def capture_end(self, graph: DeviceGraph) -> None:
        target: Any = graph
        target.capture_end()
        shared = _CAPTURE_POOLS.pop(id(graph), None)
        if shared is not None and shared.handle is None:
            shared.handle = tuple(target.pool())

    def abort_capture(self, graph: DeviceGraph) -> None:
        target: Any = graph
        _CAPTURE_POOLS.pop(id(graph), None)
        # Silence torch's "the graph is empty ... wrong device or stream" for a capture cut short.
        with contextlib.suppress(Exception), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            target.capture_end()
        with contextlib.suppress(Exception):
            graph.reset()
        # A failed capture can leave the stream in an error state; make the next work start clean.
        with contextlib.suppress(Exception):
            torch.accelerator.synchronize()

    def translate_capture_error(self, error: BaseException, size: int | None) -> CaptureError | None:
        text = str(error).strip()
        if not _HOST_SYNC_ERRORS.search(text):
            return None
        return CaptureError(
            f"{HOST_SYNC} during capture ({text.splitlines()[0]}); {HOST_SYNC_ADVICE}", size=size
        )

    # -- streams ---------------------------------------------------------------------------------
    def new_stream(self) -> Any:
        device = self.default_device()
        key = (device.type, device.index or 0)
        stream = _CAPTURE_STREAMS.get(key)
        if stream is None:
            stream = _CAPTURE_STREAMS[key] = torch.Stream(device=device)
        return stream

    def current_stream(self) -> Any:
        return torch.accelerator.current_stream()

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        # The side stream must see the work already queued on the current one (weights, KV cache, static
        # inputs) before warm-up reads it; work queued after the block must see what the block wrote.
        current = torch.accelerator.current_stream()
        stream.wait_stream(current)
        torch.accelerator.set_stream(stream)
        try:
            yield stream
        finally:
            torch.accelerator.set_stream(current)
            current.wait_stream(stream)

    def synchronize(self) -> None:
        torch.accelerator.synchronize()

    def record_event(self) -> Any:
        # The device's work runs after the call that issued it returns: a real event, never "done".
        event = torch.Event()
        event.record(torch.accelerator.current_stream())
        return event

    # -- memory ----------------------------------------------------------------------------------
    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.accelerator.get_memory_info()
        return int(free), int(total)

    def reserved_bytes(self) -> int:
        return int(torch.accelerator.memory_reserved())

    def empty_cache(self) -> None:
        torch.accelerator.empty_cache()

    def describe(self) -> str:
        if not self.availability():
            return self.name
        free, total = self.mem_get_info()
        return (
            f"{_accelerator_type()} through torch.accelerator.Graph (torch {torch.__version__}, "
            f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free)"
        )
