"""Graph primitives over ``torch.cuda``'s graph API, shared by the CUDA and ROCm (HIP) plug-ins.

ROCm builds of torch expose HIP graphs through the same ``torch.cuda`` calls, so both plug-ins
subclass :class:`TorchCudaGraphPlatform` and differ only in detection and advice. This module imports
nothing but torch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from devgraph.errors import CaptureError
from devgraph.platform import DeviceGraph, GraphPlatform

__all__ = ["TorchCudaGraphPlatform"]


class TorchCudaGraphPlatform(GraphPlatform):
    """``torch.cuda.CUDAGraph`` capture into a shared pool on a side stream."""

    device_type = "cuda"

    def default_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def new_graph(self) -> DeviceGraph:
        return torch.cuda.CUDAGraph()

    def graph_pool_handle(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture_begin(self, graph: DeviceGraph, pool: Any) -> None:
        # thread_local: other threads of the engine (tokenizer, scheduler) may keep using the device.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # type: ignore[attr-defined]

    def capture_end(self, graph: DeviceGraph) -> None:
        graph.capture_end()  # type: ignore[attr-defined]

    def abort_capture(self, graph: DeviceGraph) -> None:
        with contextlib.suppress(Exception):
            graph.capture_end()  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            graph.reset()
        # A failed capture can leave the stream in an error state; make the next work start clean.
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()

    def translate_capture_error(self, error: BaseException, size: int | None) -> CaptureError | None:
        text = str(error)
        if "operation not permitted when stream is capturing" in text or "cudaErrorStreamCaptureUnsupported" in text:
            return CaptureError(
                f"an op synchronized with the host or used a non-capturable API during capture ({text.splitlines()[0]}); "
                "remove .item()/.tolist()/.cpu()/nonzero and data-dependent shapes from the captured forward, or "
                "make that op a @devgraph.graph_break op",
                size=size,
            )
        return None

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)

    def reserved_bytes(self) -> int:
        return int(torch.cuda.memory_reserved())

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()
