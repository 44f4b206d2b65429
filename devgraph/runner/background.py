"""Serving before the graphs are ready: steps run eagerly from the moment the weights are loaded while
the runners' keys are captured one at a time, and each key replays its graph once it is captured.

The concurrency rule: **a capture never overlaps a step** (of any runner on the device). A key is
captured under the runner's lock (and the engine's ``lock``, when given), so steps run between two keys,
never during one, and a key becomes visible to the dispatcher only after its capture is complete.
Capturing *beside* eager steps is not sound, for three reasons (docs/user-guide.md, "Serving before the
graphs are ready", has the links):

* CUDA: PyTorch's rule is that no uncaptured CUDA work runs in the process while a capture is under way.
  ``torch.cuda.graph`` captures in ``cudaStreamCaptureModeGlobal`` by default, where another thread's
  potentially unsafe call (a ``cudaMalloc`` of the caching allocator, a synchronizing copy of a sampled
  token) fails or invalidates the capture. ``capture_error_mode="thread_local"`` lifts that check for
  other threads, but the caching allocator still treats every allocation on the device as "during
  capture" while one is under way, and can query an event recorded by the capture from the other thread
  (``cudaErrorCapturedEvent``, pytorch/pytorch#193982).
* State: a key's warm-ups run the forward, which advances declared state (a write position, a step
  counter); the capture saves it before and restores it after. An eager step running meanwhile would see
  the warm-ups' state, or have its own update undone by the restore.
* Memory: the runner's static input buffers and the graphs' pool are written by warm-ups and replays;
  only one may use them at a time.

Two ways to drive it: :meth:`BackgroundCapture.step` from the engine's own loop (one key between two
steps, or while idle: nothing else is needed, the serving engine does this), or
:meth:`BackgroundCapture.start`, a thread that takes the locks per key.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from devgraph.errors import ConfigError
from devgraph.runner.capture.job import CaptureReport
from devgraph.runner.capture.pending import PendingKeys
from devgraph.runner.graph_runner import GraphRunner

__all__ = ["BackgroundCapture"]

logger = logging.getLogger(__name__)


class BackgroundCapture:
    """Captures the keys of ``runners`` (in that order, each runner's largest key first) one key per
    :meth:`step`; until a key is captured, its steps run eagerly, counted as ``capturing`` in ``stats()``.

    ``lock``: held around each key's capture besides the runner's own lock; pass the lock your engine
    holds around every step when it steps several runners on one device (or steps from another thread
    than :meth:`step` is called from). Built on runners that were not captured yet; a runner already
    captured, lazily capturing, or without graphs has nothing to capture.
    """

    def __init__(self, runners: Sequence[GraphRunner], *, lock: Any = None) -> None:
        self.runners = list(runners)
        self.lock = lock
        self.error: BaseException | None = None
        self.abandoned = False  # abandon(): stopped for good before every key, without an error
        self.started = time.perf_counter()
        #: Seconds from construction to the last key captured (``None`` until then).
        self.ready_seconds: float | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Each runner's keys to capture (its graph life's record; a runner with nothing to capture has none).
        begun = (runner.life.begin_background() for runner in self.runners)
        self._jobs: list[PendingKeys] = [job for job in begun if job is not None]
        if self.done:
            self.ready_seconds = 0.0

    # -- progress -----------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return sum(job.total for job in self._jobs)

    @property
    def captured(self) -> int:
        """Keys captured so far whose graphs are held now (over every runner): after a failed key, only
        those of the runners that finished before it."""
        return sum(job.held for job in self._jobs)

    @property
    def done(self) -> bool:
        """Every key captured, or the capture stopped (see :attr:`error` and :attr:`abandoned`)."""
        return self.error is not None or not any(job.open for job in self._jobs)

    def progress(self) -> dict[str, Any]:
        """Plain data for a health check or a log: keys captured (and held) of the total, whether done, the
        error."""
        return {
            "captured": self.captured,
            "total": self.total,
            "ready": self.done and self.error is None and not self.abandoned,
            "ready_seconds": None if self.ready_seconds is None else round(self.ready_seconds, 3),
            "error": None if self.error is None else str(self.error),
        }

    # -- driving it ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Capture the next key (in the calling thread, under ``lock`` and the runner's lock); returns
        whether keys remain. A failed capture releases that runner's graphs, stops the whole background
        capture (the runners not fully captured then run eagerly, ``before_capture``) and raises its
        :class:`CaptureError`."""
        if self.error is not None:
            return False
        with self.lock if self.lock is not None else contextlib.nullcontext():
            for runner in self.runners:
                try:
                    if runner.life.capture_next():
                        break
                except BaseException as exc:
                    self._fail(exc)
                    raise
        more = not self.done
        if not more and self.ready_seconds is None:
            self.ready_seconds = time.perf_counter() - self.started
        return more

    def finish(self) -> list[CaptureReport]:
        """Capture every key left now (stopping the thread first); returns each runner's report. Raises
        the error that stopped the capture, if one did."""
        self.stop()
        while self.step():
            pass
        if self.error is not None:
            raise self.error
        return [r.life.current_report() for r in self.runners]

    def start(self, pause: float = 0.001) -> BackgroundCapture:
        """Capture in a thread of its own, key by key, sleeping ``pause`` seconds between keys so that
        steps waiting for the locks get in. The runners must take their lock (not ``single_thread``) or
        ``lock`` must be given, and no process group may be set (ranks must capture in step)."""
        for runner in self.runners:
            if runner.plan.safety.single_thread and self.lock is None:
                raise ConfigError(
                    f"the {runner.phase} runner was built with single_thread=True (no lock): a capture "
                    "thread needs BackgroundCapture(lock=...) held around every step, or call step() "
                    "from the thread that steps"
                )
            if runner.plan.process_group is not None or runner.plan.dp_group is not None:
                raise ConfigError(
                    f"the {runner.phase} runner has a process group: its ranks capture each key together, "
                    "so call step() at the same point of every rank's loop instead of start()"
                )
        if self._thread is None and not self.done:
            device = next((r.device for r in self.runners), None)
            self._thread = threading.Thread(
                target=self._run, args=(pause, device), name="devgraph-capture", daemon=True
            )
            self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the capture thread; returns whether every key is done."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.done

    def stop(self) -> None:
        """Stop the capture thread after the key it is capturing (keys left stay pending)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        self._stop.clear()

    def abandon(self) -> None:
        """Stop for good (no error): the thread stops after its key, the runners still capturing release
        the keys they captured and run eagerly (``before_capture``) until captured again; a runner whose
        keys were all captured keeps them. :attr:`done` from here on."""
        self.stop()
        with self.lock if self.lock is not None else contextlib.nullcontext():
            self.abandoned = not self.done
            for runner in self.runners:
                runner.life.abandon()

    def _run(self, pause: float, device: Any) -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        while not self._stop.is_set():
            try:
                if not self.step():
                    return
            except BaseException as exc:  # recorded in self.error; steps go on eagerly
                logger.error("devgraph: capture in the background stopped: %s", exc)
                return
            time.sleep(pause)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        for runner in self.runners:
            runner.life.abandon()
