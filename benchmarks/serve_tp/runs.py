"""One ``devgraph serve`` measured: start-up (with its weight loading), greedy tokens, load phases timed
from the client and from the server's own step timeline (CUDA events), and, on the last ``--tp 2``
server, a worker killed while a request streams."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from servers import ServerProcess

from devgraph.serve.bench.loadgen import TraceRequest, run_load
from devgraph.serve.engine.timeline import TIMELINE_ENV
from serve_tp.analysis import hosts, window
from serve_tp.plan import Model

__all__ = ["Served", "kill_a_worker", "prompts_for", "start"]


def prompts_for(count: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def _load(url: str, trace: list[TraceRequest], concurrency: int) -> dict[str, Any]:
    return asyncio.run(run_load(url, trace, concurrency=concurrency, progress=False, timeout=300))


class Served:
    """A started server, its timeline file, and what was measured on it (``record``: its flags with the
    checkpoint's temporary folder named, not spelled out)."""

    def __init__(self, label: str, flags: list[str], work: Path, start_timeout: float) -> None:
        self.label = label
        self.timeline = work / f"{label}-timeline.json"
        shown = [f"<a temporary folder>/{Path(f).name}" if f.startswith(str(work)) else f for f in flags]
        self.record: dict[str, Any] = {"flags": shown}
        began = time.monotonic()
        self.server = ServerProcess(
            *flags,
            "--log-level",
            "warning",
            env={TIMELINE_ENV: str(self.timeline)},
            start_timeout=start_timeout,
        )
        self.record["listening_s"] = round(time.monotonic() - began, 2)
        self.record["startup"] = self.server.stats().get("startup", {})
        self.windows: dict[str, tuple[float, float]] = {}

    @property
    def url(self) -> str:
        return self.server.url

    def greedy(self, prompts: list[list[int]], new_tokens: int) -> list[list[int] | None]:
        """Every prompt at once, greedy: the tokens per prompt (None where a request failed)."""
        trace = [TraceRequest(i, p, new_tokens) for i, p in enumerate(prompts)]
        results = _load(self.url, trace, len(prompts))["results"]
        return [r["token_ids"] if r["ok"] else None for r in results]

    def run_loads(self, model: Model, vocab: int) -> None:
        """Each load phase; the client's summary and its time window (for the timeline)."""
        self.record["loads"] = {}
        for number, load in enumerate(model.loads):
            trace = [
                TraceRequest(i, p, load.output)
                for i, p in enumerate(prompts_for(load.requests, load.prompt, vocab, seed=100 + number))
            ]
            began = time.monotonic()
            summary = _load(self.url, trace, load.concurrency)["summary"]
            self.windows[load.name] = (began, time.monotonic())
            entry = {k: v for k, v in summary.items() if k != "first_errors" or v}
            self.record["loads"][load.name] = {**entry, "concurrency": load.concurrency}

    def stop(self) -> None:
        """SIGTERM; then the timeline's figures per load phase (written by the server as it exits)."""
        self.record["exit_code"] = self.server.stop()
        self.read_timeline()

    def read_timeline(self) -> None:
        if not self.timeline.exists():
            self.record["timeline"] = "not written"
            return
        try:
            data = json.loads(self.timeline.read_text())
        except (OSError, ValueError) as exc:
            self.record["timeline"] = f"unreadable: {exc!r}"
            return
        steps, spans = data["steps"], data.get("spans", [])
        worker_file = self.timeline.with_name(self.timeline.name + ".rank1")  # the first worker's, if any
        try:
            worker = json.loads(worker_file.read_text()).get("spans", []) if worker_file.exists() else []
        except (OSError, ValueError) as exc:  # rank 0's figures stand without the worker's
            self.record["worker_timeline"] = f"unreadable: {exc!r}"
            worker = []
        self.record["timeline"] = {name: window(steps, *bounds) for name, bounds in self.windows.items()}
        self.record["hosts"] = {
            name: hosts(spans, steps, worker, *bounds) for name, bounds in self.windows.items()
        }


def start(
    label: str, directory: Path, model: Model, device: str, extra: list[str], work: Path, left: float
) -> Served:
    flags = ["--model", str(directory), "--device", device, *model.flags, *extra]
    return Served(label, flags, work, start_timeout=max(30.0, left))


def kill_a_worker(server: ServerProcess, max_tokens: int) -> dict[str, Any]:
    """SIGKILL a worker after the 5th token of a long streamed request: when the request got its error,
    when the server exited, its exit code and last log lines."""
    (worker,) = server.workers()
    payload = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    result: dict[str, Any] = {"worker_pid": worker, "tokens_before_error": 0}
    killed = time.monotonic()
    for event in server.stream(payload):
        if "error" in event:
            result["error_after_s"] = round(time.monotonic() - killed, 3)
            result["error"] = event["error"]["message"][:300]
            break
        result["tokens_before_error"] += 1
        if result["tokens_before_error"] == 5:
            killed = time.monotonic()
            os.kill(worker, signal.SIGKILL)
    try:
        result["exit_code"] = server.proc.wait(timeout=120)
        result["exit_after_s"] = round(time.monotonic() - killed, 3)
    except Exception as exc:  # recorded: a server that did not exit is the finding
        result["exit_code"] = None
        result["not_exited"] = repr(exc)
        server.proc.kill()
    result["log_tail"] = [line.rstrip() for line in server.stderr if "tensor-parallel" in line][-4:]
    return result
