"""``GraphPool``: one graph memory pool that several runners capture into, because they replay one at a time.

The rule: runners sharing a pool never replay at the same time. A draft and a target model, a decode and a
verify runner, one engine loop that runs one phase per step: their graphs' intermediates live in the same
memory, so the pool holds the largest runner's working memory once instead of once per runner. Each
runner's outputs stay its own (valid until that runner's next ``run()``, as always). What breaks the rule:
two threads replaying two runners of the pool at once, or two runners replaying on different streams
without ordering them. ``GraphPool(debug=True)`` (or ``DEVGRAPH_DEBUG=1``) checks the rule on every replay
and raises :class:`~devgraph.errors.ReplayError` naming both runners; without it the check costs nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.platform import GraphPlatform
from devgraph.errors import ConfigError, ReplayError

__all__ = ["DEBUG_ENV", "GraphPool", "PoolMember"]

#: Environment variable that turns on the checks of every GraphPool (``1``).
DEBUG_ENV = "DEVGRAPH_DEBUG"


class PoolMember(Protocol):
    """A runner as its pool knows it: named in reports and errors by its phase and backend."""

    @property
    def phase(self) -> str: ...

    @property
    def backend(self) -> DeviceGraphBackend: ...


class GraphPool:
    """A graph memory pool runners share: ``GraphRunner(..., pool=pool)`` for each of them.

    The pool's handle comes from the first runner's platform (all runners of a pool must be on one
    platform and device). ``debug`` checks the one-at-a-time rule at every replay (default: the
    ``DEVGRAPH_DEBUG`` environment variable). See docs/user-guide.md, "Shared pools".
    """

    def __init__(self, *, debug: bool | None = None, name: str = "shared") -> None:
        if debug is not None and not isinstance(debug, bool):
            raise ConfigError(f"GraphPool debug= must be True, False or None, got {debug!r}")
        self.name = name
        self.debug = debug if debug is not None else os.environ.get(DEBUG_ENV, "") not in ("", "0")
        self.platform: GraphPlatform | None = None
        self.device: Any = None
        self.handle: Any = None
        self._runners: weakref.WeakSet[PoolMember] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._capture_lock = threading.RLock()  # two runners never capture into the pool at once
        self._replaying: PoolMember | None = None  # debug: the runner replaying now
        self._last: tuple[weakref.ReferenceType[PoolMember], Any] | None = None  # debug: last runner, stream

    # -- runners ------------------------------------------------------------------------------------
    def attach(
        self, runner: PoolMember, backends: list[DeviceGraphBackend], platform: GraphPlatform, device: Any
    ) -> None:
        """Make ``runner``'s backends capture into this pool (called by ``GraphRunner``)."""
        with self._lock:
            if self.platform is None:
                self.platform, self.device = platform, device
                self.handle = platform.graph_pool_handle()
            elif platform.name != self.platform.name or str(device) != str(self.device):
                raise ConfigError(
                    f"GraphPool {self.name!r} holds graphs of {self.platform.name} on {self.device}; "
                    "a runner on "
                    f"{platform.name} {device} cannot share it (one pool lives on one device)"
                )
            for backend in backends:
                if not backend.uses_graphs:
                    continue  # a runner in an eager mode shares nothing
                if not backend.supports_shared_pool:
                    raise ConfigError(
                        f"backend {platform.name}:{backend.name} cannot capture into a shared pool "
                        "(supports_shared_pool is False); drop pool= for this runner"
                    )
                backend.use_pool(self.handle)
            self._runners.add(runner)

    def detach(self, runner: PoolMember) -> None:
        with self._lock:
            self._runners.discard(runner)

    @property
    def runners(self) -> list[PoolMember]:
        return list(self._runners)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Held while a runner captures into the pool: captures of two runners never interleave."""
        with self._capture_lock:
            yield

    # -- the one-at-a-time rule (debug) -------------------------------------------------------------
    def replaying(self, runner: PoolMember) -> contextlib.AbstractContextManager[None]:
        """Context around one replay of ``runner``; in debug mode, checks no other runner of the pool is
        replaying, and that the last one to replay did so on this stream or has finished."""
        if not self.debug:
            return contextlib.nullcontext()
        return self._checked(runner)

    @contextlib.contextmanager
    def _checked(self, runner: PoolMember) -> Iterator[None]:
        platform = self.platform
        stream = platform.current_stream() if platform is not None else None
        with self._lock:
            busy = self._replaying
            if busy is not None and busy is not runner:
                raise ReplayError(
                    f"{runner!r} replays while {busy!r} replays from another thread, and both capture into "
                    f"GraphPool {self.name!r}: runners sharing a pool must replay one at a time (their "
                    "graphs use the same memory). Serialize the two, or give them separate pools"
                )
            last = self._last
            if last is not None:
                other, other_stream = last[0](), last[1]
                if (
                    other is not None and other is not runner and other_stream != stream
                ):  # torch: same handle, equal
                    done = getattr(other_stream, "query", lambda: True)()
                    if not done:
                        raise ReplayError(
                            f"{runner!r} replays on stream {stream!r} while {other!r}'s last replay on "
                            f"stream {other_stream!r} has not finished; both capture into GraphPool "
                            f"{self.name!r}, so the two would write the same memory at once. Replay them "
                            "on one stream, or make this stream wait for the other first"
                        )
            self._replaying = runner
        try:
            yield
        finally:
            with self._lock:
                self._replaying = None
                self._last = (weakref.ref(runner), stream)

    def describe(self) -> dict[str, Any]:
        """The pool as plain data: runners, platform and, on the CPU simulator, the modelled device bytes."""
        info: dict[str, Any] = {
            "name": self.name,
            "debug": self.debug,
            "platform": self.platform.name if self.platform is not None else None,
            "runners": [f"{r.phase}:{r.backend.name}" for r in self.runners],
        }
        for attr in ("modelled_bytes", "nbytes"):
            value = getattr(self.handle, attr, None)
            if isinstance(value, int):
                info[attr] = value
        return info

    def __repr__(self) -> str:
        return f"GraphPool({self.name!r}, runners={len(self._runners)}, debug={self.debug})"
