"""Rank 0 -> the other ranks: each step's batch, then the stop, through a shared-memory ring.

Rank 0 builds the channel (:class:`StepChannel`) before it spawns the workers; each worker maps it first
thing (:class:`WorkerChannel`). A step is encoded once (:mod:`~devgraph.serve.engine.wire`), copied
into the ring (:mod:`~devgraph.serve.tp.ring`) and read by every worker; nothing comes back.

A lost rank, both ways, within the rank timeout (``DEVGRAPH_RANK_TIMEOUT_S``, default 60 s) or sooner:

- a worker sees rank 0 gone when its parent process changed (rank 0 exited: at once), when rank 0 closed
  the ring, or when rank 0's heartbeat (a timestamp its thread writes every ``min(5, timeout / 4)`` s,
  idle or not) is older than the timeout (rank 0 alive but stuck);
- rank 0 sees a worker gone through the world's monitor (its exit code, :mod:`~devgraph.serve.tp.world`),
  which also asks :meth:`StepChannel.stalled` whether a worker has left a step unread for longer than the
  timeout (alive but stuck; rank 0's own thread may be blocked in a collective then), and a send that
  waits that long for a full ring gives up. :meth:`StepChannel.abort` makes every wait give up at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from devgraph import DevGraphError
from devgraph.ranks.group import RANK_TIMEOUT_ENV, rank_timeout_s
from devgraph.serve.engine.wire import StepMessage, decode_step, stop_message
from devgraph.serve.tp.ring import RingReader, RingWriter

__all__ = ["RankLost", "StepChannel", "WorkerChannel"]

logger = logging.getLogger(__name__)


class RankLost(DevGraphError):
    """A tensor-parallel rank died or did not answer within the rank timeout."""


def _timeout_note(timeout_s: float) -> str:
    return f"{RANK_TIMEOUT_ENV}={timeout_s:g} s"


class StepChannel:
    """Rank 0's end: :meth:`send` a step to every worker; a heartbeat thread; the stalled-worker check."""

    def __init__(self, ranks: int, *, slots: int = 16, capacity: int = 256 << 10) -> None:
        self.timeout_s = rank_timeout_s()
        self.ring = RingWriter(ranks - 1, slots=slots, capacity=capacity)
        self._aborted: str | None = None
        self._closed = threading.Event()
        self._suspects: dict[int, int] = {}
        self._heartbeat = threading.Thread(target=self._beat, name="devgraph-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    @property
    def path(self) -> Path:
        """The ring's file: each worker maps it (:class:`WorkerChannel`)."""
        return self.ring.path

    def send(self, message: StepMessage) -> None:
        """Copy ``message`` to every worker; :class:`RankLost` when one has stopped reading (the ring stays
        full for the rank timeout) or the channel was aborted."""
        if self._aborted is not None:
            raise RankLost(self._aborted)
        started = time.monotonic()

        def check() -> None:
            if self._aborted is not None:
                raise RankLost(self._aborted)
            if time.monotonic() - started > self.timeout_s:
                late = ", ".join(str(reader + 1) for reader in sorted(self.ring.unread(0.0)))
                raise RankLost(
                    f"tensor-parallel rank(s) {late or '?'} took no step for {self.timeout_s:g} s "
                    f"({_timeout_note(self.timeout_s)})"
                )

        self.ring.write(message.buffer, check)

    def send_stop(self) -> None:
        """The last message: every worker closes its runners and exits 0."""
        self.send(stop_message())

    def stalled(self) -> str | None:
        """Why a worker counts as lost: it left a step unread for longer than the rank timeout (seen on two
        calls in a row, for the same step: a slot being rewritten can look stale for an instant)."""
        late = self.ring.unread(self.timeout_s)
        confirmed = sorted(r for r, seq in late.items() if self._suspects.get(r) == seq)
        self._suspects = late
        if not confirmed:
            return None
        ranks = ", ".join(str(reader + 1) for reader in confirmed)
        return (
            f"tensor-parallel rank(s) {ranks} left a step unread for more than {self.timeout_s:g} s "
            f"(alive but not answering; {_timeout_note(self.timeout_s)})"
        )

    def abort(self, reason: str) -> None:
        """Make a send that waits, and every later send, raise :class:`RankLost` with ``reason``."""
        self._aborted = reason

    def _beat(self) -> None:
        interval = min(5.0, self.timeout_s / 4)
        attached = False
        while True:
            self.ring.beat()
            if not attached and self.ring.attached():
                attached = True
                self.ring.unlink()  # every worker mapped it: a crash from here on leaves no file behind
            if self._closed.wait(min(interval, 0.05) if not attached else interval):
                return

    def close(self) -> None:
        """Stop the heartbeat, mark the ring closed (workers still waiting give up), remove it."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._heartbeat.join()
        self.ring.close()


class WorkerChannel:
    """A worker's end: :meth:`receive` the next step; :class:`RankLost` when rank 0 is gone."""

    def __init__(self, path: Path | str, rank: int, *, pin: bool = False) -> None:
        """``pin``: receive into pinned memory (this rank's device is a GPU: one non-blocking copy)."""
        self.timeout_s = rank_timeout_s()
        self.ring = RingReader(path, rank - 1)
        self.rank = rank
        # Spawned by rank 0: rank 0's exit re-parents this process, which is seen at once.
        self._parent = os.getppid() if os.getppid() == self.ring.writer_pid else None
        self.pin = pin

    def receive(self, allocate: Callable[[int], torch.Tensor] | None = None) -> StepMessage:
        """The next message (:data:`~devgraph.serve.engine.wire.STOP` as its kind ends the worker), in a
        buffer from ``allocate`` (reused ones of a
        :class:`~devgraph.serve.engine.message_memory.MessageMemory`) or a new one."""
        buffer = self.ring.read(allocate or self._allocate, self._check)
        return decode_step(buffer)

    def _allocate(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def _check(self) -> None:
        writer = self.ring.writer_pid
        if self._parent is not None and os.getppid() != self._parent:
            raise RankLost(f"rank 0 (pid {writer}) exited")
        if self._parent is None and not _alive(writer):
            raise RankLost(f"rank 0 (pid {writer}) exited")
        if self.ring.closed:
            raise RankLost("rank 0 closed the step channel")
        age = self.ring.heartbeat_age()
        if age > self.timeout_s:
            raise RankLost(
                f"rank 0 (pid {writer}) has not been heard from for {age:.1f} s "
                f"({_timeout_note(self.timeout_s)})"
            )

    def close(self) -> None:
        self.ring.close()


def _alive(pid: int) -> bool:
    """Is ``pid`` running (not gone, not a zombie waiting for its parent)?"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
