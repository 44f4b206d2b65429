"""A bounded, least-recently-used set of lazily captured keys (the encoder graph cache).

An encoder sees a different token count for almost every batch; capturing every bucket at start-up wastes
memory and time. A lazily capturing runner captures a key the first time a step needs it and keeps at
most ``max_graphs`` graphs and ``max_bytes`` of graph memory, evicting the least recently used.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from devgraph.contract.keys import GraphKey
from devgraph.runner.options import LazyPolicy

__all__ = ["LazyGraphs", "LruKeys"]


class LruKeys:
    """Captured keys with their graph bytes, oldest use first."""

    def __init__(self, policy: LazyPolicy) -> None:
        self.policy = policy
        self._keys: OrderedDict[GraphKey, int] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def bytes(self) -> int:
        return sum(self._keys.values())

    def touch(self, key: GraphKey) -> None:
        self._keys.move_to_end(key)

    def add(self, key: GraphKey, nbytes: int) -> None:
        self._keys[key] = nbytes

    def remove(self, key: GraphKey) -> None:
        self._keys.pop(key, None)

    def make_room(self) -> list[GraphKey]:
        """Keys to evict, oldest first, so one more graph fits under ``max_graphs``."""
        limit = self.policy.max_graphs
        if limit is None or len(self._keys) < limit:
            return []
        return list(self._keys)[: len(self._keys) - limit + 1]

    def over_bytes(self, keep: GraphKey) -> list[GraphKey]:
        """Keys to evict, oldest first, until the graphs fit under ``max_bytes`` (never ``keep``)."""
        limit = self.policy.max_bytes
        if limit is None:
            return []
        victims, total = [], self.bytes
        for key, nbytes in self._keys.items():
            if total <= limit:
                break
            if key != keep:
                victims.append(key)
                total -= nbytes
        return victims

    def ensure(
        self,
        key: GraphKey,
        *,
        has_graph: Callable[[GraphKey], bool],
        capture: Callable[[GraphKey], int],
        evict: Callable[[GraphKey], None],
    ) -> bool:
        """Make ``key`` hold a graph before a step replays it; returns whether it already did (a hit).

        On a miss: evict (oldest first) to make room under ``max_graphs``, ``capture(key)`` (returns the
        graph's bytes), then evict until the graphs fit under ``max_bytes`` (never ``key`` itself).
        """
        if key in self._keys and has_graph(key):
            self.touch(key)
            return True
        for victim in self.make_room():
            evict(victim)
        self.add(key, capture(key))
        for victim in self.over_bytes(keep=key):
            evict(victim)
        return False

    def clear(self) -> None:
        self._keys.clear()


class LazyGraphs:
    """A lazily capturing runner's side of the cache: capture a key on first sight, keep the bounds.

    ``capture(key)`` captures one key and returns its graph bytes; ``release(key)`` drops its graph (the
    backend's ``release``, and the runner's report of it). Counts land in the runner's statistics.
    """

    def __init__(
        self,
        policy: LazyPolicy,
        stats: Any,
        has_graph: Callable[[GraphKey], bool],
        capture: Callable[[GraphKey], int],
        release: Callable[[GraphKey], None],
    ) -> None:
        self.keys = LruKeys(policy)
        # Keys whose capture failed (the error was raised once): later steps of them run eagerly, counted.
        self.failed: set[GraphKey] = set()
        self._stats = stats
        self._has_graph = has_graph
        self._capture = capture
        self._release = release

    def lookup(self, key: GraphKey, count: bool) -> None:
        """Make ``key`` hold a graph before it replays. ``verify()`` (``count=False``) is no step: it counts
        no hit; a capture it causes is real work and counts as a miss."""
        hit = self.keys.ensure(key, has_graph=self._has_graph, capture=self._timed_capture, evict=self._evict)
        if hit and count:
            self._stats.lazy_hits += 1

    def _timed_capture(self, key: GraphKey) -> int:
        start = time.perf_counter()
        nbytes = self._capture(key)
        self._stats.lazy_misses += 1
        self._stats.lazy_capture_seconds += time.perf_counter() - start
        return nbytes

    def _evict(self, key: GraphKey) -> None:
        self._release(key)
        self.keys.remove(key)
        self._stats.lazy_evictions += 1

    def clear(self) -> None:
        self.keys.clear()
        self.failed.clear()
