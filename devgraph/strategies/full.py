"""``full``: one device graph per shape key, the whole forward inside it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from devgraph.context import capture_flag
from devgraph.platform import DeviceGraph
from devgraph.strategies._base import GraphStrategy

__all__ = ["FullGraphBackend"]


@dataclass
class _FullEntry:
    graph: DeviceGraph
    outputs: Any

    def replay(self) -> Any:
        self.graph.replay()
        return self.outputs

    def reset(self) -> None:
        self.graph.reset()
        self.outputs = None


class FullGraphBackend(GraphStrategy):
    """Captures the entire forward, break ops included, as one graph per size.

    The fastest replay (one launch per step); every op in the forward, break ops too, must be
    capturable. The usual choice for decode.
    """

    name = "full"

    def _capture(self, key: int, forward_fn: Callable[[], Any]) -> _FullEntry:
        platform = self.platform
        graph = platform.new_graph()
        platform.capture_begin(graph, self._pool)
        try:
            with capture_flag():
                outputs = forward_fn()
        except BaseException:
            platform.abort_capture(graph)
            raise
        platform.capture_end(graph)
        return _FullEntry(graph, outputs)
