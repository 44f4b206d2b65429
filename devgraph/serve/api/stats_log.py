"""The periodic INFO line of ``devgraph serve``: throughput, requests and KV-cache usage, as vLLM logs them.

Every ``--log-stats-interval`` seconds (default 10; 0 turns it off) one line at INFO, built from the
engine's counters: prompt and generation tokens per second over the interval, running and waiting
requests, the share of KV-cache blocks in use, and how many steps replayed a graph. An idle server (no
tokens in this interval or the one before) logs at DEBUG instead, so a quiet log stays quiet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_INTERVAL", "ThroughputLog"]

logger = logging.getLogger("devgraph.serve.stats")

DEFAULT_INTERVAL = 10.0


class ThroughputLog:
    """Turns successive ``stats()`` snapshots into one log line each (see the module docstring)."""

    def __init__(self, stats: Callable[[], dict[str, Any]], interval: float = DEFAULT_INTERVAL) -> None:
        self.stats = stats
        self.interval = interval
        self._last: dict[str, Any] | None = None
        self._last_time = time.monotonic()
        self._was_busy = False

    def line(self, stats: dict[str, Any], now: float) -> tuple[int, str]:
        """The level and text of the line for ``stats`` taken at ``now`` (monotonic seconds)."""
        last = self._last or {"prompt_tokens": 0, "generation_tokens": 0, "replays": 0, "steps": 0}
        seconds = max(now - self._last_time, 1e-9)
        prompt = (stats["prompt_tokens"] - last["prompt_tokens"]) / seconds
        generation = (stats["generation_tokens"] - last["generation_tokens"]) / seconds
        replays = sum(r.get("replays", 0) for r in stats["runners"].values())
        steps = sum(stats["steps"].values())
        total = stats["kv_blocks_total"]
        usage = 100.0 * (1 - stats["kv_blocks_free"] / total) if total else 0.0
        step_delta, replay_delta = steps - last["steps"], replays - last["replays"]
        busy = bool(prompt or generation)
        level = logging.INFO if busy or self._was_busy else logging.DEBUG
        self._was_busy = busy
        self._last = {**stats, "replays": replays, "steps": steps}
        self._last_time = now
        waiting = stats["waiting"] + stats.get("queued", 0)
        text = (
            f"Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: {generation:.1f} "
            f"tokens/s, Running: {stats['running']} reqs, Waiting: {waiting} reqs, KV cache usage: "
            f"{usage:.1f}%, steps: {step_delta} ({replay_delta} graph replays)"
        )
        return level, text

    async def run(self) -> None:
        """Log every ``interval`` seconds until cancelled (reads the stats in an executor thread)."""
        loop = asyncio.get_running_loop()
        self._last = await loop.run_in_executor(None, self._baseline)
        while True:
            await asyncio.sleep(self.interval)
            stats = await loop.run_in_executor(None, self.stats)
            level, text = self.line(stats, time.monotonic())
            logger.log(level, "%s", text)

    def _baseline(self) -> dict[str, Any]:
        stats = self.stats()
        self._last_time = time.monotonic()
        replays = sum(r.get("replays", 0) for r in stats["runners"].values())
        return {**stats, "replays": replays, "steps": sum(stats["steps"].values())}
