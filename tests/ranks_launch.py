"""Launching a worker script as several ranks, torchrun-style, for the multi-process tests (tensor and data
parallelism): 127.0.0.1, a free port, one log and one JSON file of findings per rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from devgraph import ranks


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_ranks(
    worker: Path,
    scenarios: str,
    out: Path,
    *,
    world: int = 2,
    device: str = "cpu",
    extra: tuple[str, ...] = (),
    limit: float = 240,
    timeout: float = 10,
) -> dict[int, Any]:
    """Run ``worker`` as ranks ``0..world-1``; returns each rank's findings (``out/rank<r>.json``) with its
    exit code and the end of its log. ``timeout`` is ``DEVGRAPH_RANK_TIMEOUT_S`` for the ranks."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            ranks.RANK_TIMEOUT_ENV: str(timeout),
            "OMP_NUM_THREADS": "1",  # the ranks share the CI machine's cores
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),  # 127.0.0.1 only
        }
        log = (out / f"rank{rank}.log").open("w")
        command = [sys.executable, str(worker), scenarios, "--out", str(out), "--device", device, *extra]
        procs.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + limit
    found: dict[int, Any] = {}
    for rank, (proc, log) in enumerate(procs):
        try:
            code: int | str = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timed out"
        log.close()
        path = out / f"rank{rank}.json"
        found[rank] = json.loads(path.read_text()) if path.exists() else {}
        found[rank]["exit"] = code
        found[rank]["log"] = (out / f"rank{rank}.log").read_text()[-4000:]
    return found
