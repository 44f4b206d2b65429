"""A ``devgraph serve`` subprocess for the tests that talk to it over HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


async def stream_events(
    url: str, payload: dict[str, Any], path: str = "/v1/completions"
) -> list[dict[str, Any]]:
    """POST ``payload`` streamed to ``url + path`` with aiohttp (concurrent requests from one process);
    every server-sent event up to ``[DONE]``, parsed. Asserts a 200."""
    import aiohttp  # the tests that stream import-skip without it

    events = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + path, json={**payload, "stream": True}) as response,
    ):
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


class ServerProcess:
    """``python -m devgraph.serve FLAGS`` on a free port of 127.0.0.1, started and waited for (up to
    ``start_timeout`` seconds; ``env``: variables added to this process's); its stderr is kept
    (``stderr``), ``stop()`` sends SIGTERM and returns the exit code. ``graphs_ready``: also wait until
    every graph is captured (the server captures them in the background by default), so a test sees the
    same steps whichever way it started."""

    def __init__(
        self,
        *flags: str,
        env: dict[str, str] | None = None,
        start_timeout: float = 120,
        graphs_ready: bool = True,
    ) -> None:
        command = [
            sys.executable,
            "-m",
            "devgraph.serve",
            *flags,
            "--port",
            "0",
            "--host",
            "127.0.0.1",
        ]
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        deadline = time.monotonic() + start_timeout
        assert self.proc.stdout is not None
        line = ""
        while "listening on" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {''.join(self.stderr)[-2000:]}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server did not start in {start_timeout:g} s")
        self.url = line.rsplit(" ", 1)[-1].strip()
        self.port = int(self.url.rsplit(":", 1)[-1])
        if graphs_ready:
            self.wait_graphs(deadline - time.monotonic())

    def wait_graphs(self, timeout: float) -> dict[str, Any] | None:
        """Wait until /health says every graph is captured (no ``graphs`` entry: captured before listening);
        returns that entry. A capture that failed is the test's to see (``error``), not a wait."""
        deadline = time.monotonic() + max(timeout, 1.0)
        while True:
            graphs = self.request("GET", "/health")[1].get("graphs")
            if graphs is None or graphs["ready"] or graphs["error"]:
                return graphs
            if time.monotonic() > deadline:
                raise RuntimeError(f"graphs not captured in {timeout:g} s: {graphs}")
            time.sleep(0.05)

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
        req = urllib.request.Request(self.url + path, data=body, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                raw = response.read()
                status = response.status
                content_type = response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as error:
            raw, status, content_type = error.read(), error.code, error.headers.get("Content-Type", "")
        return status, json.loads(raw) if "json" in content_type else raw.decode()

    def post(self, payload: Any, path: str = "/v1/completions") -> tuple[int, Any]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return self.request("POST", path, body)

    def stream(self, payload: dict[str, Any], timeout: float = 120) -> Iterator[dict[str, Any]]:
        """POST ``payload`` as a streamed completion; yields each server-sent event (an error event too)
        up to ``[DONE]``. A status other than 200 raises ``urllib.error.HTTPError`` before the first."""
        body = json.dumps({**payload, "stream": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as response:
            for raw in response:
                line = raw.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    yield json.loads(line[6:])

    def workers(self) -> list[int]:
        """The pids of the processes this server spawned (``--tp`` workers; not multiprocessing's resource
        tracker)."""
        pid = self.proc.pid
        found = []
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            try:
                command = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in command:
                found.append(int(child))
        return found

    def stats(self) -> dict[str, Any]:
        return self.request("GET", "/v1/engine/stats")[1]

    def wait_idle(self, timeout: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["running"] == stats["waiting"] == stats["queued"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9
