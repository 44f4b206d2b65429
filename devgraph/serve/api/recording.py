"""``devgraph serve --record-steps PATH``: the server's traffic recorded for ``devgraph tune``.

From the end of the warm-up (its requests are not traffic), both runners count their steps
(``GraphRunner.record_steps``); the trace file (``devgraph.write_trace``: steps per count, the sizes
captured and the bytes each took) is written every ``--record-interval`` seconds and once more at
shutdown, replaced whole each time (a reader never sees half a file). Then::

    devgraph tune PATH --out tuned.json
    devgraph serve ... --tuned tuned.json
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from devgraph import ConfigError, write_trace
from devgraph.messages import shorten

__all__ = ["TrafficRecorder", "check_record_path"]

logger = logging.getLogger(__name__)


def check_record_path(path: str) -> Path:
    """``--record-steps PATH`` must be writable before minutes of start-up; :class:`ConfigError` if not."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--record-steps {shorten(path)} is a directory; give a file path")
    if not target.parent.is_dir():
        raise ConfigError(
            f"--record-steps {shorten(path)}: directory {shorten(str(target.parent))} does not exist"
        )
    probe = target.with_name(f".{target.name}.partial")  # where write_trace writes before replacing
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"--record-steps {shorten(path)} cannot be written ({exc.strerror or exc})"
        ) from None
    return target


class TrafficRecorder:
    """Records ``runners``' steps from :meth:`start` and writes them to ``path`` (the module docstring)."""

    def __init__(self, path: Path, runners: list[Any], interval: float) -> None:
        self.path = path
        self.runners = runners
        self.interval = interval
        self.started = False

    def start(self) -> None:
        for runner in self.runners:
            runner.record_steps(True)
        self.started = True
        logger.info("recording the steps of both runners to %s (devgraph tune reads it)", self.path)

    def write(self) -> bool:
        """Write the trace now; a failure (a full disk) is logged, never raised: serving goes on."""
        if not self.started:
            return False
        try:
            steps = [runner.recorded_steps() for runner in self.runners]
            write_trace(self.path, steps)
        except (OSError, ConfigError) as exc:
            logger.warning("could not write the recorded steps to %s: %s", self.path, exc)
            return False
        logger.debug("recorded steps written to %s (%d steps)", self.path, sum(s.steps for s in steps))
        return True

    async def run(self) -> None:
        """Write every ``interval`` seconds (off the event loop: the runners' locks wait for a step)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval)
            await loop.run_in_executor(None, self.write)
