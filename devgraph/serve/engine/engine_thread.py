"""Running an :class:`~devgraph.serve.engine.Engine` in a thread of its own.

Other threads (an HTTP server's event loop) call :meth:`EngineLoop.submit` and :meth:`EngineLoop.abort`;
both only enqueue and return at once. The engine thread applies them between steps, runs steps while
there is work, sleeps when there is none, and hands every :class:`RequestOutput` to the sink given at
submission (called on the engine thread: a sink must be quick and thread-safe, e.g.
``loop.call_soon_threadsafe``). All engine state is touched by the engine thread only. When the engine
captures its graphs in the background (:meth:`Engine.capture_in_background`), the engine thread captures
one key after each step and keeps capturing while idle: a capture never overlaps a step.

A step's outputs go to their sinks as soon as it is read (:class:`OutputDelivery`, ``at-once``), or, with
``next-issue`` and a step in flight, once the next step is issued, just before the engine thread waits for
the device: the event loop's Python then runs while this thread waits instead of while it issues. Held
outputs keep their order (they go first, before an abort's or a failure's); see :class:`OutputDelivery`
for what each was measured to do.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from devgraph import ConfigError, DevGraphError
from devgraph.serve.engine.config import OutputDelivery
from devgraph.serve.engine.engine import Engine
from devgraph.serve.engine.request import FinishReason, RequestOutput, SamplingParams
from devgraph.serve.engine.sleep import check_level

__all__ = ["EngineAsleep", "EngineClosed", "EngineLoop", "Sink"]

logger = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]


class EngineClosed(DevGraphError):
    """The engine is shutting down and takes no new requests."""


class EngineAsleep(DevGraphError):
    """The engine sleeps (sleep mode): its KV cache and graphs are freed until POST /wake_up."""


class EngineLoop:
    """Owns ``engine`` and one thread that steps it."""

    def __init__(self, engine: Engine, delivery: OutputDelivery | str = OutputDelivery.AT_ONCE) -> None:
        self.engine = engine
        self.delivery: Final = OutputDelivery.parse(delivery)
        self._cond = threading.Condition()
        self._adds: list[tuple[str, list[int], SamplingParams, Sink]] = []
        self._aborts: list[tuple[str, FinishReason, int | None]] = []
        self._sinks: dict[str, Sink] = {}  # submitted id -> its sink, until all its copies finished
        self._open: dict[str, int] = {}  # submitted id -> copies not finished yet
        self._ids = itertools.count()
        self._closing = False
        self._stop = False
        self._asleep = False  # sleep mode: submit() refuses while set
        self._held: list[RequestOutput] = []  # engine thread: the last step's outputs, for the next issue
        self._state_lock = threading.Lock()  # held while the engine thread touches engine state
        # Taken by another thread around its turn with the state lock, and passed through by the engine
        # thread before each turn: a Lock is not fair, and the engine thread, which takes the state lock
        # again at once while it captures graphs in the background or has steps to run, would otherwise
        # hold /v1/engine/stats, /metrics and POST /sleep until every graph is captured.
        self._turnstile = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="devgraph-engine", daemon=True)

    # -- any thread ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams, sink: Sink) -> str:
        """Queue a request; returns its id. Raises InputError (bad request) or EngineClosed. The sink gets
        the outputs of all its ``n`` copies (``RequestOutput.index`` tells them apart)."""
        tokens = self.engine.check_request(prompt, params)  # reads only immutable config
        with self._cond:
            if self._closing:
                raise EngineClosed("the server is shutting down and takes no new requests")
            if self._asleep:
                raise EngineAsleep("the engine is asleep (sleep mode): POST /wake_up, then send requests")
            request_id = f"cmpl-{next(self._ids)}"
            self._adds.append((request_id, tokens, params, sink))
            self._cond.notify()
        return request_id

    def abort(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT, index: int | None = None
    ) -> None:
        """End a request at the next step, every copy or copy ``index``: ``ABORT`` (its client went away)
        or ``STOP`` (its text reached a stop string)."""
        with self._cond:
            self._aborts.append((request_id, reason, index))
            self._cond.notify()

    def in_flight(self) -> int:
        with self._cond:
            return len(self._adds) + len(self._sinks)

    def stats(self) -> dict[str, Any]:
        """A consistent snapshot of :meth:`Engine.stats` (waits for the current step to end)."""
        with self._turnstile, self._state_lock:
            stats = self.engine.stats()
        stats["queued"] = len(self._adds)
        return stats

    def fail_all(self, error: str) -> None:
        """Take no more requests and end every one in flight with ``finish_reason`` error (500), from any
        thread, without waiting for the engine thread (a lost tensor-parallel rank may hold it)."""
        with self._cond:
            self._closing = True
            sinks = {request_id: sink for request_id, *_, sink in self._adds}
            sinks.update(self._sinks)
            self._adds, self._sinks, self._open = [], {}, {}
        for request_id, sink in sinks.items():
            try:
                sink(RequestOutput(request_id, [], True, FinishReason.ERROR, error=error))
            except Exception:
                logger.exception("output sink for %s failed", request_id)

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Put the engine to sleep (:meth:`Engine.sleep`) between two steps; refused (ConfigError) while
        requests are in flight or queued. Blocks until done: call it from a worker thread."""
        check_level(level)  # a level that can never work is the caller's mistake (400), before the 409
        with self._turnstile, self._state_lock:  # the engine thread is between steps, not stepping
            with self._cond:
                if self._adds or self._sinks or self.engine.has_work:
                    raise ConfigError(
                        f"{len(self._adds) + len(self._sinks)} request(s) are in flight; sleep when the "
                        "server is idle"
                    )
                self._asleep = True  # no request gets in from here on
            try:
                return self.engine.sleep(level)
            except BaseException:
                with self._cond:
                    self._asleep = self.engine.is_sleeping
                raise

    def wake_up(self) -> dict[str, Any]:
        """Wake the engine (:meth:`Engine.wake_up`): KV cache, then graphs; requests are taken again."""
        with self._turnstile, self._state_lock:
            result = self.engine.wake_up()
            with self._cond:
                self._asleep = False
                self._cond.notify()  # a background capture the sleep stopped goes on while idle
        return result

    @property
    def is_sleeping(self) -> bool:
        with self._cond:
            return self._asleep

    def shutdown(self, drain_seconds: float = 0.0) -> None:
        """Stop taking requests; let in-flight ones finish for up to ``drain_seconds``, abort the rest,
        stop the thread."""
        with self._cond:
            self._closing = True
        deadline = time.monotonic() + drain_seconds
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    # -- the engine thread ---------------------------------------------------------------------------
    def _main(self) -> None:
        device = self.engine.model.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        while True:
            with self._cond:
                while not (
                    self._adds or self._aborts or self._stop or self.engine.has_work or self._capturing()
                ):
                    self._cond.wait()
                adds, self._adds = self._adds, []
                # In flight from the moment they leave the queue, in the same critical section: sleep()
                # between this and the state lock below must see them (it refuses while any are in flight).
                for request_id, _, params, sink in adds:
                    self._sinks[request_id] = sink
                    self._open[request_id] = params.n  # copies of an n > 1 request not finished yet
                aborts, self._aborts = self._aborts, []
                stop = self._stop
            with self._turnstile:  # another thread waiting for the state lock gets it first
                pass
            with self._state_lock:
                self._apply(adds, aborts)
                if stop:
                    self._deliver_held()
                    for request_id in list(self._sinks):
                        for output in self.engine.abort_group(request_id):
                            self._deliver(output)
                    return
                self._step()
                self._capture_one()

    def _capturing(self) -> bool:
        background = self.engine.background
        return background is not None and not background.done

    def _capture_one(self) -> None:
        """One key of the background capture, between two steps (or while idle)."""
        background = self.engine.background
        if background is None or background.done:
            return
        try:
            more = background.step()
        except Exception:  # the runners fall back to eager steps; the error shows in /health
            logger.exception("capturing the graphs in the background failed; steps stay eager")
            return
        if not more:
            logger.info(
                "all %d graphs captured in the background, %.2f s after the engine was built",
                background.total,
                background.ready_seconds or 0.0,
            )

    def _apply(
        self,
        adds: list[tuple[str, list[int], SamplingParams, Sink]],
        aborts: list[tuple[str, FinishReason, int | None]],
    ) -> None:
        for request_id, tokens, params, _ in adds:
            try:
                self.engine.add_request(tokens, params, request_id)
            except Exception as exc:  # checked at submit; a failure here is a bug, reported per request
                logger.warning("adding request %s failed: %r", request_id, exc)
                self._open[request_id] = 1  # one error output ends it
                self._deliver(RequestOutput(request_id, [], True, FinishReason.ERROR, error=repr(exc)))
        if aborts:
            self._deliver_held()  # a request's earlier tokens before its abort's output
        for request_id, reason, index in aborts:
            for output in self.engine.abort_group(request_id, reason, index):
                self._deliver(output)

    def _step(self) -> None:
        if not self.engine.has_work:
            self._deliver_held()
            return
        try:
            outputs = self.engine.step(before_read=self._deliver_held)
        except Exception as exc:  # never let the thread die: fail what is in flight and go on
            logger.exception("engine step failed")
            self._deliver_held()
            for request_id in list(self._sinks):
                for aborted in self.engine.abort_group(request_id):
                    aborted.finish_reason, aborted.error = FinishReason.ERROR, repr(exc)
                    self._deliver(aborted)
            return
        if self.delivery is OutputDelivery.NEXT_ISSUE and self.engine.step_in_flight:  # after the next issue
            self._held = outputs
            return
        for output in outputs:
            self._deliver(output)

    def _deliver_held(self) -> None:
        held, self._held = self._held, []
        for output in held:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        group = output.group
        sink = self._sinks.get(group)
        if sink is None:
            return
        if output.finished:
            left = self._open.get(group, 1) - 1  # fail_all (another thread) may have emptied the maps
            if left <= 0:
                self._sinks.pop(group, None)
                self._open.pop(group, None)
            else:
                self._open[group] = left
        try:
            sink(output)
        except Exception:  # a closed event loop or a broken sink must not stop the engine
            logger.exception("output sink for %s failed", output.request_id)
