"""Graph primitives over ``torch.cuda``'s graph API, shared by the CUDA and ROCm (HIP) plug-ins.

ROCm builds of torch expose HIP graphs through the same ``torch.cuda`` calls, so both plug-ins
subclass :class:`TorchCudaGraphPlatform` and differ only in detection and advice. This module imports
nothing but torch.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from devgraph.contract.platform import DeviceGraph, GraphPlatform
from devgraph.errors import CaptureError
from devgraph.messages import CAUSE_ATTRIBUTE, HOST_SYNC, HOST_SYNC_ADVICE, capture_oom

__all__ = ["TorchCudaGraphPlatform"]

#: One capture stream per device for the process (see ``TorchCudaGraphPlatform.new_stream``).
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}
#: id(graph) -> pool of a capture in progress, for abort_capture.
_CAPTURE_POOLS: dict[int, Any] = {}


class _OomCount(threading.local):
    before = 0  # the allocator's out-of-memory count when this thread's last capture began


_OOMS = _OomCount()


def _allocator_ooms() -> int:
    """How often the caching allocator ran out of memory on the current device (0 where unknown)."""
    try:
        return int(torch.cuda.memory_stats_as_nested_dict().get("num_ooms", 0))
    except Exception:  # no CUDA runtime (test fakes on a CPU build)
        return 0


@contextlib.contextmanager
def _allocate_into(pool: Any) -> Iterator[None]:
    """Route this thread's (or stream's, on older torch) allocations into the graph pool ``pool``.

    The same private calls ``torch._inductor.cudagraph_trees`` uses: begin takes a reference on the pool,
    release gives it back, so the pool outlives this block only through the graphs captured into it.
    """
    device = torch.cuda.current_device()
    begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
    if begin is None:  # torch releases before the per-thread variant
        begin = torch._C._cuda_beginAllocateCurrentStreamToPool
    begin(device, pool)
    try:
        yield
    finally:
        torch._C._cuda_endAllocateToPool(device, pool)
        torch._C._cuda_releasePool(device, pool)


class TorchCudaGraphPlatform(GraphPlatform):
    """``torch.cuda.CUDAGraph`` capture into a shared pool on a side stream."""

    device_type = "cuda"
    detects_host_sync = True

    def default_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def new_graph(self) -> DeviceGraph:
        return torch.cuda.CUDAGraph()

    def graph_pool_handle(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture_begin(self, graph: DeviceGraph, pool: Any) -> None:
        # Remembered for abort_capture, which must hand the pool back itself when capture_end fails.
        _CAPTURE_POOLS[id(graph)] = pool
        _OOMS.before = _allocator_ooms()  # an OOM during capture surfaces as an invalidated capture
        # thread_local: other threads of the engine (tokenizer, scheduler) may keep using the device.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # type: ignore[attr-defined]

    def capture_end(self, graph: DeviceGraph) -> None:
        _CAPTURE_POOLS.pop(id(graph), None)
        graph.capture_end()  # type: ignore[attr-defined]

    def abort_capture(self, graph: DeviceGraph) -> None:
        ended = False
        # Silence torch's "The CUDA Graph is empty ... wrong device or stream" for a capture cut short.
        with contextlib.suppress(Exception), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph.capture_end()  # type: ignore[attr-defined]
            ended = True
        pool = _CAPTURE_POOLS.pop(id(graph), None)
        if not ended and pool is not None:
            # An invalidated capture makes torch's capture_end raise before it tells the caching allocator
            # that the capture is over, and reset() then skips releasing the pool: the pool (and every
            # block allocated during the failed capture) would stay reserved for the life of the process.
            device = torch.cuda.current_device()
            with contextlib.suppress(Exception):
                torch._C._cuda_endAllocateToPool(device, pool)
            with contextlib.suppress(Exception):
                torch._C._cuda_releasePool(device, pool)
        with contextlib.suppress(Exception):
            graph.reset()
        # A failed capture can leave the stream in an error state; make the next work start clean.
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()

    def allocate_into(self, pool: Any) -> contextlib.AbstractContextManager[None]:
        # A graph pool exists only with a real device allocator (not under test fakes on a CPU build).
        return _allocate_into(pool) if torch.cuda.is_available() else contextlib.nullcontext()

    def weak_alias(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cuda":
            return tensor
        storage = tensor.untyped_storage()
        borrowed = torch._C._construct_storage_from_data_pointer(
            storage.data_ptr(), tensor.device, storage.nbytes()
        )
        alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        alias.set_(borrowed, tensor.storage_offset(), tensor.shape, tensor.stride())
        return alias

    def translate_capture_error(self, error: BaseException, size: int | None) -> CaptureError | None:
        failures = _allocator_ooms() - _OOMS.before
        if failures > 0 and not isinstance(error, torch.OutOfMemoryError):
            # pytorch#159594: the allocator's retry path frees cached blocks mid-capture, which invalidates
            # the capture; what reaches us is cudaErrorStreamCaptureInvalidated, not the out-of-memory.
            setattr(error, CAUSE_ATTRIBUTE, "out_of_memory")
            return CaptureError(capture_oom(error, failures), size=size)
        text = str(error)
        if (
            "operation not permitted when stream is capturing" in text
            or "cudaErrorStreamCaptureUnsupported" in text
        ):
            return CaptureError(
                f"{HOST_SYNC} during capture ({text.splitlines()[0]}); {HOST_SYNC_ADVICE}", size=size
            )
        return None

    def new_stream(self) -> Any:
        # One stream per device for all captures of the process, as torch.cuda.graph does: cuBLAS keeps a
        # workspace per (handle, stream) until exit, so a new stream per capture() leaks one per runner.
        device = torch.cuda.current_device()
        stream = _CAPTURE_STREAMS.get(device)
        if stream is None:
            stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
        return stream

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        # The side stream must see the work already queued on the current one (weights, KV cache and
        # static inputs written there) before warm-up reads it; work queued after the block must see what
        # warm-up and the eager break ops wrote on the side stream.
        current = torch.cuda.current_stream()
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                yield stream
        finally:
            current.wait_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def time_replays(self, replay: Callable[[], None], iters: int) -> float:
        """CUDA events on the current stream around ``iters`` calls: device time, not the host's."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / max(iters, 1)

    def record_event(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)

    def reserved_bytes(self) -> int:
        return int(torch.cuda.memory_reserved())

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()
