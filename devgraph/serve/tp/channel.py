"""Rank 0 -> the other ranks: each step's batch, a heartbeat while idle, the stop.

One gloo group of its own (not the runners' control group, whose per-step key check runs inside the
forward, nor the device group): a broadcast from rank 0 per message. The workers wait in a broadcast
between steps; gloo ends that wait after :func:`~devgraph.ranks.group.rank_timeout_s`, so rank 0 sends a
heartbeat whenever it has sent nothing for a quarter of it (an idle server keeps its workers), and a
worker whose wait times out or whose connection closes knows rank 0 is gone.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch

from devgraph.errors import DevGraphError
from devgraph.messages import describe_error
from devgraph.ranks.group import RANK_TIMEOUT_ENV, rank_timeout_s

__all__ = ["IDLE", "STOP", "RankLost", "StepChannel"]

IDLE = ("idle",)
STOP = ("stop",)


class RankLost(DevGraphError):
    """A tensor-parallel rank died or did not answer within the rank timeout."""


class StepChannel:
    """Built by every rank, in the same order (after ``init_process_group``)."""

    def __init__(self) -> None:
        self.timeout_s = rank_timeout_s()
        self.group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        self.rank = torch.distributed.get_rank()
        self._lock = threading.Lock()  # rank 0: one broadcast at a time (steps and heartbeats)
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def send(self, message: Any) -> None:
        """Rank 0: broadcast ``message`` (picklable); :class:`RankLost` when a rank is gone."""
        with self._lock:
            if self._closed.is_set() and message is not STOP:
                raise RankLost("the step channel is closed")
            try:
                torch.distributed.broadcast_object_list([message], src=0, group=self.group)
            except Exception as exc:  # gloo: a closed connection or a timeout
                raise RankLost(self._why(exc)) from exc
            self._last = time.monotonic()

    def receive(self) -> Any:
        """Ranks 1..N-1: the next message; :class:`RankLost` when rank 0 is gone."""
        box: list[Any] = [None]
        try:
            torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        except Exception as exc:
            raise RankLost(self._why(exc)) from exc
        return box[0]

    def start_heartbeat(self) -> None:
        """Rank 0: a thread that sends :data:`IDLE` after a quarter of the timeout without a message."""
        interval = min(5.0, self.timeout_s / 4)

        def beat() -> None:
            while not self._closed.wait(interval / 2):
                if time.monotonic() - self._last >= interval:
                    try:
                        self.send(IDLE)
                    except RankLost:
                        return  # the step or the rank monitor reports it

        self._heartbeat = threading.Thread(target=beat, name="devgraph-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    def close(self) -> None:
        """Stop the heartbeat (rank 0); later sends other than :data:`STOP` raise."""
        self._closed.set()
        if self._heartbeat is not None:
            self._heartbeat.join()

    def _why(self, exc: Exception) -> str:
        return (
            f"{describe_error(exc, limit=200)} (a rank exited or did not answer within "
            f"{RANK_TIMEOUT_ENV}={self.timeout_s:g} s)"
        )
