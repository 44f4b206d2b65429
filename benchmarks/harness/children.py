"""Child processes: a section that must start from nothing (a cold compile, the first capture of a process,
a library that changes process-wide state) runs in a process of its own, with its own empty inductor and
Triton caches, writes its JSON to a file and is given only what is left of the time budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.device import Budget

__all__ = ["child_env", "run_child", "script_command"]


def child_env(cache_root: Path, name: str) -> dict[str, str]:
    """The environment of a child: its own empty inductor and Triton caches under ``cache_root/name``."""
    env = dict(os.environ)
    root = cache_root / name
    env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    env["TRITON_CACHE_DIR"] = str(root / "triton")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("OUT", None)  # the child writes where it is told, not into the parent's $OUT
    return env


def script_command(script: str, *args: str) -> list[str]:
    """``python SCRIPT ARGS``: the benchmark script (``__file__``) run again as a child."""
    return [sys.executable, str(Path(script).resolve()), *args]


def run_child(
    command: list[str], out: Path, env: dict[str, str], budget: Budget, *, cap: float, keep: float = 0.0
) -> dict[str, Any]:
    """Run ``command`` and return the JSON it wrote to ``out``. Its timeout is ``cap`` seconds, cut to what
    the budget has left after ``keep`` seconds kept for later sections; the budget is never overrun."""
    timeout = min(cap, budget.left() - keep)
    if timeout <= 0:
        raise TimeoutError(f"time budget: {budget.left():.0f}s left, {keep:.0f}s kept for later sections")
    subprocess.run(command, env=env, check=True, timeout=timeout)
    result: dict[str, Any] = json.loads(out.read_text())
    return result
