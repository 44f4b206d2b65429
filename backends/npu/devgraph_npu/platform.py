"""The NPU platform: Ascend NPU graphs (aclgraph) through torch-npu's ``torch.npu`` graph API."""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, ClassVar

import torch

from devgraph import Availability, CaptureError, DeviceGraph, GraphPlatform
from devgraph.messages import HOST_SYNC, HOST_SYNC_ADVICE
from devgraph_npu import _torch_npu as api

__all__ = ["NpuPlatform", "STREAM_EXHAUSTION", "translate_ascend_error"]

#: Error texts of the Ascend runtime when a capture runs out of device streams (each captured graph
#: holds streams; a device has about 2048): error 207008 at capture begin, 207005 at a stream wait.
STREAM_EXHAUSTION = re.compile(
    r"207008|207005|stream resources? (are|is) insufficient|no stream resource|Insufficient_Stream_Resources"
    r"|resource alloc fail",
    re.IGNORECASE,
)
_HOST_SYNC = re.compile(
    r"not permitted when stream is capturing|stream is capturing|capture.*not support", re.IGNORECASE
)


def translate_ascend_error(error: BaseException, size: int | None) -> CaptureError | None:
    """A :class:`CaptureError` with the fix for a known Ascend capture failure, or ``None``."""
    text = str(error)
    first = next((line.strip() for line in text.splitlines() if line.strip()), text)
    where = f"size {size}" if size is not None else "a graph"
    if STREAM_EXHAUSTION.search(text):
        code = "207008" if "207008" in text else ("207005" if "207005" in text else "stream exhaustion")
        return CaptureError(
            f"the Ascend runtime ran out of stream resources capturing {where} (error {code}: "
            f"{first[:160]}). "
            "Every captured NPU graph keeps device streams and a device has about 2048: capture fewer sizes "
            "(pass sizes=[...] or a lower max_size, e.g. --device-graph-mode "
            '\'{"decode": {"backend": "full", "max_size": 64}}\'), run fewer processes per NPU, and '
            "upgrade the Ascend driver/firmware and CANN (newer drivers free and reuse capture streams)",
            size=size,
        )
    if _HOST_SYNC.search(text):
        return CaptureError(
            f"{HOST_SYNC} while capturing {where} ({first[:160]}); {HOST_SYNC_ADVICE}; per-step host values "
            "belong in a StaticInput(host=True) that the NPU backend passes to NPUGraph.update",
            size=size,
        )
    return None


class NpuPlatform(GraphPlatform):
    """Ascend NPU graphs on ``torch.device("npu")``.

    Every capture goes through ``torch.npu.graph(..., auto_dispatch_capture=True)`` (when torch-npu
    has it), so attention ops with host-side sequence lengths can be re-issued at replay with
    :meth:`update_graph`. torch-npu is imported only when something here needs it.
    """

    name: ClassVar[str] = "npu"
    device_type: ClassVar[str] = "npu"
    priority: ClassVar[int] = 90

    def __init__(self) -> None:
        self._captures: dict[int, Any] = {}
        self._lock = threading.Lock()

    # -- detection -------------------------------------------------------------------------------
    def availability(self) -> Availability:
        return api.probe()

    def default_device(self) -> torch.device:
        return torch.device(self.device_type, api.current_device())

    def describe(self) -> str:
        if not self.availability():
            return self.name
        return f"{api.device_name()} (torch-npu {api.version()}, torch {torch.__version__})"

    def supports_host_update(self) -> bool:
        """Whether captures record ops for ``NPUGraph.update`` (torch-npu with ``auto_dispatch_capture``)."""
        return api.supports_host_update()

    # -- graphs ----------------------------------------------------------------------------------
    def new_graph(self) -> DeviceGraph:
        return api.new_graph()

    def graph_pool_handle(self) -> Any:
        return api.graph_pool_handle()

    def capture_begin(self, graph: DeviceGraph, pool: Any) -> None:
        context = api.begin_capture(
            graph, pool, api.current_stream(), auto_dispatch=self.supports_host_update()
        )
        with self._lock:
            self._captures[id(graph)] = context

    def capture_end(self, graph: DeviceGraph) -> None:
        with self._lock:
            context = self._captures.pop(id(graph), None)
        if context is None:
            raise CaptureError(f"capture_end() on {graph!r}, which this platform is not capturing")
        api.end_capture(context)

    def abort_capture(self, graph: DeviceGraph) -> None:
        with self._lock:
            context = self._captures.pop(id(graph), None)
        api.abort_capture(context, graph)

    def translate_capture_error(self, error: BaseException, size: int | None) -> CaptureError | None:
        return translate_ascend_error(error, size)

    def update_graph(self, graph: DeviceGraph, cpu_update_input: list[dict[str, Any]]) -> None:
        """Re-issue the ops recorded in ``graph`` with new host-side arguments before its next replay."""
        api.update(graph, cpu_update_input)

    def update_records(self, graph: DeviceGraph) -> list[set[str]] | None:
        """Keyword names of each op recorded for update in ``graph`` (``None``: torch-npu does not say)."""
        return api.update_records(graph)

    # -- streams ---------------------------------------------------------------------------------
    def new_stream(self) -> Any:
        return api.new_stream()

    def current_stream(self) -> Any:
        return api.current_stream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return api.stream(stream)

    def synchronize(self) -> None:
        api.synchronize()

    def record_event(self) -> Any:
        return api.record_event()

    # -- memory ----------------------------------------------------------------------------------
    def mem_get_info(self) -> tuple[int, int]:
        return api.mem_get_info()

    def reserved_bytes(self) -> int:
        return api.memory_reserved()

    def empty_cache(self) -> None:
        api.empty_cache()
