"""``example_full``: the ``full`` strategy plus per-size replay counters, as a vendor might add telemetry.

A real vendor backend would usually also bring its own platform (a ``GraphPlatform`` subclass over its
device's graph API, registered with ``devgraph_register_platforms``); this example reuses the built-in
CPU simulator platform so that it runs anywhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from devgraph.strategies import FullGraphBackend

__all__ = ["ExampleFullBackend"]


class ExampleFullBackend(FullGraphBackend):
    """One graph per size (the ``full`` strategy) that counts replays per size."""

    name = "example_full"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replays: Counter[int] = Counter()

    def replay(self, key: int, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        outputs = super().replay(key, static_inputs)
        self.replays[key] += 1
        return outputs

    def cleanup(self) -> None:
        super().cleanup()
        self.replays.clear()
