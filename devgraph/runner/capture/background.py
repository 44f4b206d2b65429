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
from devgraph.runner import lifecycle
from devgraph.runner.capture import pending
from devgraph.runner.capture.loop import CaptureReport

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

    def __init__(self, runners: Sequence[Any], *, lock: Any = None) -> None:
        self.runners = list(runners)
        self.lock = lock
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        #: Seconds from construction to the last key captured (``None`` until then).
        self.ready_seconds: float | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._total = 0
        for runner in self.runners:
            with runner._lock:
                self._total += self._begin(runner)
        if self.done:
            self.ready_seconds = 0.0

    @staticmethod
    def _begin(runner: Any) -> int:
        """Arm the runner for key-by-key capture; returns how many keys it will capture."""
        runner._check_open()
        if runner._captured or runner._background is not None:
            return 0
        plan, sets = runner.plan, runner._sets
        if sets.fallback is not None:
            raise ConfigError(
                f"the {plan.phase} runner has a fallback graph set ({sets.fallback.backend.name}); capture "
                "in the background takes runners without one: drop the fallback or call capture()"
            )
        if not runner.backend.uses_graphs or plan.capture.lazy:
            runner.capture()  # nothing to capture now (eager mode; a lazy runner captures on first sight)
            return 0
        keys = plan.schedule.keys()  # largest first
        lifecycle.arm_guard(runner)
        runner.backend.prepare(plan.inputs, keys)
        runner._background = pending.PendingKeys(list(keys), len(keys))
        runner._steps.capturing = True
        return len(keys)

    # -- progress -----------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return self._total

    @property
    def captured(self) -> int:
        """Keys captured so far (over every runner)."""
        return self._total - sum(len(p.keys) for p in self._pending())

    @property
    def done(self) -> bool:
        """Every key captured, or the capture stopped (see :attr:`error`)."""
        return self.error is not None or not self._pending()

    def progress(self) -> dict[str, Any]:
        """Plain data for a health check or a log: keys captured of the total, whether done, the error."""
        return {
            "captured": self.captured,
            "total": self._total,
            "ready": self.done and self.error is None,
            "ready_seconds": None if self.ready_seconds is None else round(self.ready_seconds, 3),
            "error": None if self.error is None else str(self.error),
        }

    def _pending(self) -> list[pending.PendingKeys]:
        return [r._background for r in self.runners if r._background is not None]

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
                with runner._lock:
                    if runner._closed or runner._background is None:
                        continue
                    try:
                        pending.capture_next(runner)
                    except BaseException as exc:
                        self._fail(exc)
                        raise
                    break
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
        return [r.report or r._graphs.empty_report() for r in self.runners]

    def start(self, pause: float = 0.001) -> BackgroundCapture:
        """Capture in a thread of its own, key by key, sleeping ``pause`` seconds between keys so that
        steps waiting for the locks get in. The runners must take their lock (not ``single_thread``) or
        ``lock`` must be given, and no process group may be set (ranks must capture in step)."""
        for runner in self.runners:
            if runner.plan.single_thread and self.lock is None:
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
            with runner._lock:
                pending.abandon(runner)
