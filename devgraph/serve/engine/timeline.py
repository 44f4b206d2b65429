"""Where a server's steps spend their time on the device, for the serving benchmarks.

``DEVGRAPH_STEP_TIMELINE=PATH`` makes ``devgraph serve`` time every step after the warm-up (a
tensor-parallel worker: every step), twice over:

- ``steps``: every ``run`` of its two runners: the host clock when it is called and when it returns, and
  a CUDA event just before and just after it (the runner's input staging and its replay: the graph's
  time alone);
- ``spans``: every forward the engine issues, from just before its first device work (the copy of the
  step's message) to just after its last (sampling, the copies of the tokens back to the host): the
  engine's whole device work of the step. Between the end of one span and the start of the next the
  device has nothing of the engine's to run: that gap is the device's idle time (the host late with the
  next step); under the overlapped scheduler it is near zero once the device has work queued.

At exit the server writes PATH (JSON): per entry the phase, the tokens and requests, the host start
(``time.monotonic``, the clock every process of the host shares, so a benchmark can pick the steps of one
load phase) and the device start and end in milliseconds from the first event, and the host clock when
the call returned (``host_end_s``). A span also has its step number (the step message's, the same on
every rank) and the CPU time its thread spent in it (``host_cpu_ms``): an issue much longer than its CPU
time is the thread waiting (for the interpreter lock, or in a blocking call), not working. Under ``--tp``
each worker writes its own file, ``PATH.rank<N>``, when it stops cleanly: a span per step it ran, from the
step's message in its hands to its device work issued (its ``requests``: the step's rows, padding
included), so a benchmark sees how long after rank 0 a worker got each step and whether it kept up. On the
CPU the host clock stands in for the events. Two events per entry cost a few microseconds of host time;
off unless the variable is set.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["TIMELINE_ENV", "StepTimeline"]

logger = logging.getLogger(__name__)

TIMELINE_ENV = "DEVGRAPH_STEP_TIMELINE"


class StepTimeline:
    """Times every ``run`` of the runners it wraps; :meth:`save` writes them (at most ``limit`` steps)."""

    def __init__(self, device: torch.device, path: Path, limit: int = 500_000) -> None:
        self.device = device
        self.path = path
        self.limit = limit
        self.cuda = device.type == "cuda"
        self._steps: list[tuple[str, int, int, float, Any, Any, int | None, float]] = []
        self._spans: list[tuple[str, int, int, float, Any, Any, int, float, float]] = []
        self._origin: Any = None  # the first mark taken

    @classmethod
    def from_environment(cls, engine: Any, rank: int = 0) -> StepTimeline | None:
        """A timeline around ``engine``'s runners when :data:`TIMELINE_ENV` names a file, else ``None``;
        ``rank`` other than 0 (a tensor-parallel worker) writes ``<file>.rank<rank>``."""
        path = os.environ.get(TIMELINE_ENV, "").strip()
        if not path:
            return None
        timeline = cls(engine.model.device, Path(path if rank == 0 else f"{path}.rank{rank}"))
        timeline.wrap(engine.decode_runner, "decode")
        timeline.wrap(engine.prefill_runner, "prefill")
        engine.step_observer = timeline
        logger.info("timing every step's device work for %s", path)
        return timeline

    def wrap(self, runner: Any, phase: str) -> None:
        """Time ``runner.run`` from now on (an attribute of this runner object; the class is untouched)."""
        run: Callable[..., Any] = runner.run

        def timed(*args: Any, **inputs: Any) -> Any:
            if len(self._steps) >= self.limit:
                return run(*args, **inputs)
            host, start = time.monotonic(), self._mark()
            try:
                return run(*args, **inputs)
            finally:
                end = self._mark()
                ids, lens = inputs.get("input_ids"), inputs.get("seq_lens")
                tokens = int(ids.shape[0]) if ids is not None else 0
                requests = int(lens.shape[0]) if lens is not None else 0
                self._steps.append((phase, tokens, requests, host, start, end, None, time.monotonic()))

        runner.run = timed

    # -- the engine's spans (StepObserver) ------------------------------------------------------------
    def begin(self, kind: str, step: int = 0) -> Any:
        if len(self._spans) >= self.limit:
            return None
        return kind, step, time.monotonic(), time.thread_time(), self._mark()

    def end(self, mark: Any, tokens: int, requests: int) -> None:
        if mark is not None:
            kind, step, host, cpu, start = mark
            end = self._mark()
            done, cpu = time.monotonic(), time.thread_time() - cpu
            self._spans.append((kind, tokens, requests, host, start, end, step, done, cpu))

    def _mark(self) -> Any:
        if self.cuda:
            mark: Any = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        if self._origin is None:
            self._origin = mark
        return mark

    def steps(self) -> list[dict[str, Any]]:
        """Every timed run: phase, tokens, requests, host_s, host_end_s, device_start_ms, device_end_ms."""
        return self._entries(self._steps)

    def spans(self) -> list[dict[str, Any]]:
        """Every forward the engine issued, as :meth:`steps` (phase ``decode``, ``prefill`` or ``mixed``)
        with its step number (``step``)."""
        return self._entries(self._spans)

    def _entries(self, entries: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
        # One origin for both lists (the first mark taken), so spans and steps share a clock.
        origin = self._origin
        if not entries or origin is None:
            return []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            elapsed = lambda event: origin.elapsed_time(event)  # noqa: E731
        else:
            elapsed = lambda mark: (mark - origin) * 1e3  # noqa: E731
        out = []
        for phase, tokens, requests, host, start, end, *span in entries:
            entry = {
                "phase": phase,
                "tokens": tokens,
                "requests": requests,
                "host_s": round(host, 6),
                "device_start_ms": round(elapsed(start), 4),
                "device_end_ms": round(elapsed(end), 4),
            }
            if span:  # the host clock when the call returned; a span: its step number too
                if span[0] is not None:
                    entry["step"] = span[0]
                entry["host_end_s"] = round(span[1], 6)
            if len(span) > 2:  # a span: the CPU time its thread spent in it (the rest of it waited)
                entry["host_cpu_ms"] = round(1e3 * span[2], 4)
            out.append(entry)
        return out

    def save(self) -> None:
        """Write the steps to the file (after the last step: it waits for the device). A failure is logged,
        never raised: the callers save on their way out, and a benchmark's file must not cut short a
        server's teardown (its engine's close, its process group's)."""
        try:
            data = {
                "device": str(self.device),
                "clock": "time.monotonic",
                "steps": self.steps(),
                "spans": self.spans(),
            }
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Whole or not at all: a process ended while it writes leaves no half a file to trip a reader.
            partial = self.path.with_name(self.path.name + f".{os.getpid()}.partial")
            partial.write_text(json.dumps(data) + "\n")
            os.replace(partial, self.path)
        except Exception:
            logger.exception("the step timeline could not be written to %s (%s)", self.path, TIMELINE_ENV)
            return
        runs, spans = len(data["steps"]), len(data["spans"])
        logger.info("%d timed runs and %d spans written to %s", runs, spans, self.path)
