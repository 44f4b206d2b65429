"""``example_full``: the ``full`` strategy plus per-key replay counters, as a vendor might add telemetry.

A real vendor backend would usually also bring its own platform (a ``GraphPlatform`` subclass over its
device's graph API, registered with ``devgraph_register_platforms``); this example reuses the built-in
CPU simulator platform so that it runs anywhere.

What a backend implements is :class:`devgraph.DeviceGraphBackend`; subclassing a built-in strategy, as
here, inherits all of it. Graphs are keyed by :class:`devgraph.GraphKey` (the padded size of every axis
plus the engine's variants), and whatever :meth:`describe_key` returns shows up in ``runner.inspect()``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from devgraph import GraphKey
from devgraph.strategies import FullGraphBackend

__all__ = ["ExampleFullBackend"]


class ExampleFullBackend(FullGraphBackend):
    """One graph per key (the ``full`` strategy) that counts replays per key."""

    name = "example_full"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replays: Counter[GraphKey] = Counter()

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        outputs = super().replay(key, static_inputs)
        self.replays[key] += 1
        return outputs

    def release(self, key: GraphKey) -> None:
        super().release(key)
        self.replays.pop(key, None)

    def cleanup(self) -> None:
        super().cleanup()
        self.replays.clear()

    def describe_key(self, key: GraphKey) -> dict[str, Any]:
        return {**super().describe_key(key), "replays": self.replays[key]}
