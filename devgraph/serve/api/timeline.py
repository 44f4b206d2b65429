"""Where a server's steps spend their time on the device, for the serving benchmarks.

``DEVGRAPH_STEP_TIMELINE=PATH`` makes ``devgraph serve`` (rank 0 under ``--tp``) time every forward of its
two runners after the warm-up: the host clock when the step's device work is queued, and a CUDA event just
before and just after the runner's ``run`` (its input staging and its replay). At exit the server writes
PATH (JSON): per step the phase, the tokens and requests, the host start (``time.monotonic``, the clock every
process of the host shares, so a benchmark can pick the steps of one load phase) and the device start and
end in milliseconds from the first event. From it: a step's device time (end - start) next to the ITL a
client saw (the host's share of a step), and the device's idle time between two steps (start - previous
end: sampling, scheduling, building and handing over the next batch). On the CPU the host clock stands in
for the events. Two events per step cost a few microseconds of host time; off unless the variable is set.
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
        self._steps: list[tuple[str, int, int, float, Any, Any]] = []

    @classmethod
    def from_environment(cls, engine: Any) -> StepTimeline | None:
        """A timeline around ``engine``'s runners when :data:`TIMELINE_ENV` names a file, else ``None``."""
        path = os.environ.get(TIMELINE_ENV, "").strip()
        if not path:
            return None
        timeline = cls(engine.model.device, Path(path))
        timeline.wrap(engine.decode_runner, "decode")
        timeline.wrap(engine.prefill_runner, "prefill")
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
                self._steps.append((phase, tokens, requests, host, start, end))

        runner.run = timed

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def steps(self) -> list[dict[str, Any]]:
        """Every timed step: phase, tokens, requests, host_s, device_start_ms, device_end_ms."""
        if not self._steps:
            return []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            first = self._steps[0][4]
            elapsed = lambda event: first.elapsed_time(event)  # noqa: E731
        else:
            origin = self._steps[0][4]
            elapsed = lambda mark: (mark - origin) * 1e3  # noqa: E731
        return [
            {
                "phase": phase,
                "tokens": tokens,
                "requests": requests,
                "host_s": round(host, 6),
                "device_start_ms": round(elapsed(start), 4),
                "device_end_ms": round(elapsed(end), 4),
            }
            for phase, tokens, requests, host, start, end in self._steps
        ]

    def save(self) -> None:
        """Write the steps to the file (after the last step: it waits for the device)."""
        data = {"device": str(self.device), "clock": "time.monotonic", "steps": self.steps()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(data) + "\n")
        logger.info("%d timed steps written to %s", len(data["steps"]), self.path)
