"""Bookkeeping shared by the graph-capturing strategies: one pool, one stream, entries per shape key."""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch

from devgraph.backend import DeviceGraphBackend
from devgraph.context import replay_flag
from devgraph.errors import CaptureError, ReplayError

__all__ = ["CapturedEntry", "GraphStrategy"]


class CapturedEntry(Protocol):
    """What a strategy keeps per shape key: replays and returns the captured outputs."""

    outputs: Any

    def replay(self) -> Any: ...

    def reset(self) -> None: ...


class GraphStrategy(DeviceGraphBackend):
    """A strategy that captures one :class:`CapturedEntry` per shape key into a shared pool."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool: Any = None
        self._stream: Any = None
        self._entries: dict[int, CapturedEntry] = {}

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        if self._pool is None:
            self._pool = self.platform.graph_pool_handle()
        self._stream = stream
        with self.platform.capture_guard(), self.platform.stream(stream):
            yield

    def capture_one(self, key: int, forward_fn: Callable[[], Any]) -> Any:
        if key in self._entries:
            raise CaptureError(
                f"size {key} is already captured; call cleanup() before capturing it again", size=key
            )
        if self._pool is None:
            raise CaptureError(
                "capture_one() called outside capture_session(); the runner opens it", size=key
            )
        entry = self._capture(key, forward_fn)
        self._entries[key] = entry
        return entry.outputs

    @abstractmethod
    def _capture(self, key: int, forward_fn: Callable[[], Any]) -> CapturedEntry:
        """Capture ``forward_fn`` for ``key``; on failure release anything half-captured and re-raise."""

    def has_shape(self, key: int) -> bool:
        return key in self._entries

    def replay(self, key: int, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        try:
            entry = self._entries[key]
        except KeyError:
            raise ReplayError(
                f"no graph captured for size {key} (captured: {sorted(self._entries)}); "
                "capture it first or let the runner fall back to eager"
            ) from None
        return entry.replay()

    def runtime_session(self) -> contextlib.AbstractContextManager[None]:
        return replay_flag()

    def cleanup(self) -> None:
        for entry in self._entries.values():
            entry.reset()
        self._entries.clear()
        self._pool = None
        self._stream = None
        self.platform.empty_cache()

    def captured_keys(self) -> list[int]:
        return sorted(self._entries)
