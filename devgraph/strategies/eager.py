"""``eager``: no graphs at all; the fallback and what ``disabled`` selects."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.keys import GraphKey
from devgraph.contract.modes import Strategy
from devgraph.errors import ReplayError

__all__ = ["EagerBackend"]


class EagerBackend(DeviceGraphBackend):
    """Runs every step eagerly; capture is a no-op. Selected by ``--device-graph-mode disabled``."""

    name = Strategy.EAGER.value
    uses_graphs = False
    runs_breaks_eagerly = True

    def capture_one(self, key: GraphKey, forward_fn: Callable[[], Any]) -> Any:
        return None

    def has_shape(self, key: GraphKey) -> bool:
        return False

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        raise ReplayError(
            "the eager backend captures nothing to replay; the runner runs the forward directly"
        )

    def cleanup(self) -> None:
        pass
