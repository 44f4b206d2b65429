"""Bookkeeping shared by the graph-capturing strategies: pools, the stream, one entry per key."""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, Protocol

import torch

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.context import replaying
from devgraph.contract.keys import GraphKey
from devgraph.errors import CaptureError, ReplayError

__all__ = ["CapturedEntry", "GraphStrategy"]


class CapturedEntry(Protocol):
    """What a strategy keeps per key: replays and returns the captured outputs."""

    outputs: Any

    def replay(self) -> Any: ...

    def reset(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class GraphStrategy(DeviceGraphBackend):
    """A strategy that captures one :class:`CapturedEntry` per key, into a shared pool or one per key."""

    supports_release: ClassVar[bool] = True
    supports_shared_pool: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool: Any = None  # the pool of the capture in progress
        self._shared_pool: Any = None
        self._given_pool: Any = None  # a pool handle several backends share (use_pool); outlives cleanup()
        self._key_pools: dict[GraphKey, Any] = {}  # keys captured into a pool of their own
        self._shared = True
        self._stream: Any = None
        self._entries: dict[GraphKey, CapturedEntry] = {}
        self._session = False

    @contextlib.contextmanager
    def capture_session(self, stream: Any, *, shared_pool: bool = True) -> Iterator[None]:
        self._stream = stream
        self._shared = shared_pool
        self._session = True
        try:
            with self.platform.capture_guard(), self.platform.stream(stream):
                yield
        finally:
            self._session = False
            self._pool = None

    def capture_one(self, key: GraphKey, forward_fn: Callable[[], Any]) -> Any:
        if key in self._entries:
            raise CaptureError(
                f"{key} is already captured; call cleanup() before capturing it again", size=key.tokens
            )
        if not self._session:
            raise CaptureError(
                "capture_one() called outside capture_session(); the runner opens it", size=key.tokens
            )
        if self._given_pool is not None:
            self._pool = self._given_pool  # every key, lazily captured ones too: the pool reuses their memory
        elif self._shared:
            if self._shared_pool is None:
                self._shared_pool = self.platform.graph_pool_handle()
            self._pool = self._shared_pool
        else:
            self._pool = self.platform.graph_pool_handle()
        try:
            entry = self._capture(key, forward_fn)
        except BaseException:
            if self._given_pool is None and (not self._shared or not self._entries):
                # A pool whose first capture failed cannot be captured into again on CUDA (the allocator
                # asserts): start the next capture in a fresh one.
                self._shared_pool = None
            raise
        self._entries[key] = entry
        if not self._shared and self._given_pool is None:
            self._key_pools[key] = self._pool
        self.platform.note_outputs(self._pool, entry.outputs)
        return entry.outputs

    def use_pool(self, pool: Any) -> None:
        """Capture every key into ``pool`` (a handle from ``platform.graph_pool_handle()``) that other
        backends share; ``None``: back to a pool of this backend's own."""
        if self._entries:
            raise CaptureError(
                f"{self.name} already holds graphs in its own pool; call cleanup() before sharing a pool"
            )
        self._given_pool = pool

    @abstractmethod
    def _capture(self, key: GraphKey, forward_fn: Callable[[], Any]) -> CapturedEntry:
        """Capture ``forward_fn`` for ``key`` into ``self._pool``; on failure release anything
        half-captured and re-raise."""

    def has_shape(self, key: GraphKey) -> bool:
        return key in self._entries

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        entry = self._entries.get(key)
        if entry is None:
            raise ReplayError(
                f"no graph captured for {key} (captured: {[str(k) for k in self.captured_keys()]}); "
                "capture it first or let the runner fall back to eager"
            )
        return entry.replay()

    def runtime_session(self) -> contextlib.AbstractContextManager[None]:
        return replaying()

    def release(self, key: GraphKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.reset()
        if self._key_pools.pop(key, None) is not None:
            self.platform.empty_cache()  # the key's own pool is unused now: give its memory back

    def cleanup(self) -> None:
        for entry in self._entries.values():
            entry.reset()
        self._entries.clear()
        self._key_pools.clear()
        self._shared_pool = None
        self._pool = None
        self._stream = None
        self.platform.empty_cache()

    def captured_keys(self) -> list[GraphKey]:
        return sorted(self._entries, key=GraphKey.sort_key)

    def describe_key(self, key: GraphKey) -> dict[str, Any]:
        entry = self._entries.get(key)
        return entry.describe() if entry is not None else {}
