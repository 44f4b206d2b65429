"""Chat templates rendered in worker processes, bounded in time, memory and output, so that no request can
stall the server.

A chat template is Jinja code. The checkpoint's own is trusted as far as its weights are; one sent in a
request (vLLM's ``chat_template`` field, or ``chat_template_kwargs.chat_template``) is an adversary's, and
even a trusted template runs on request data. Jinja's sandbox stops a template reaching Python's
internals, not a ``{% for %}`` over ``range(100000)`` inside another: rendered on the server's event loop,
one such request froze every other request, ``/health`` and SIGTERM. A Python thread cannot be stopped,
so rendering happens in a small pool of worker processes (:mod:`template_worker`, which bounds each
render itself: wall-clock timer, CPU and address-space limits, output size) that the server kills at its
own deadline when a render runs past it; a fresh worker takes the dead one's place. The caller waits in a
thread of its own, never on the event loop.

Failures are the request's: :class:`~devgraph.serve.checkpoint.text.ChatTemplateError` (400) saying what
the template did (too slow, too large, too much memory, its own error). Every worker busy past the
deadline is :class:`RendererBusy` (503: retry).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import selectors
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devgraph import DevGraphError
from devgraph.serve.checkpoint.text import ChatTemplateError

__all__ = ["RenderLimits", "RendererBusy", "TemplateRenderer"]

logger = logging.getLogger(__name__)

_WORKER = Path(__file__).with_name("template_worker.py")
_HEADER = struct.Struct(">I")
#: Seconds a worker may take to start (import transformers' renderer) before it counts as failed.
START_SECONDS = 120.0
#: Seconds past a render's budget before the server kills its worker (the worker's own timer comes first).
KILL_GRACE = 1.0


class RendererBusy(DevGraphError):
    """Every chat-template worker stayed busy for a whole render budget: the server is overloaded (503)."""


@dataclass(frozen=True)
class RenderLimits:
    """What one render may take: ``seconds`` of wall clock, ``max_chars`` of output, ``memory_bytes`` of
    address space beyond the worker's own; ``workers`` processes render side by side."""

    seconds: float = 5.0
    max_chars: int = 1 << 22
    memory_bytes: int = 1 << 30
    workers: int = 2


class _WorkerGone(Exception):
    """The worker's pipe closed or its deadline passed (it is killed either way)."""


class _Worker:
    """One worker process and its two pipes."""

    def __init__(self, limits: RenderLimits) -> None:
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
        args = [str(limits.seconds), str(limits.max_chars), str(limits.memory_bytes)]
        self.proc = subprocess.Popen(
            [sys.executable, str(_WORKER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.ready = False

    def call(self, request: dict[str, Any], seconds: float) -> dict[str, Any]:
        if not self.ready:
            if self._receive(START_SECONDS) != {"ready": True}:
                raise _WorkerGone("it did not start")
            self.ready = True
        body = json.dumps(request).encode("ascii")
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(_HEADER.pack(len(body)) + body)
            self.proc.stdin.flush()
        except OSError as exc:
            raise _WorkerGone(f"its pipe closed ({exc})") from None
        return self._receive(seconds)  # type: ignore[no-any-return]

    def _receive(self, seconds: float) -> Any:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + seconds
        data = b""
        wanted = _HEADER.size
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(fd, selectors.EVENT_READ)
                while len(data) < wanted:
                    left = deadline - time.monotonic()
                    if left <= 0 or not selector.select(left):
                        raise _WorkerGone(f"no answer within {seconds:g} s")
                    chunk = os.read(fd, max(wanted - len(data), 1 << 16))
                    if not chunk:
                        raise _WorkerGone("it exited")
                    data += chunk
                    if wanted == _HEADER.size and len(data) >= _HEADER.size:
                        wanted += _HEADER.unpack(data[: _HEADER.size])[0]
        except (OSError, ValueError) as exc:  # its pipe closed under us
            raise _WorkerGone(f"its pipe closed ({exc})") from None
        return json.loads(data[_HEADER.size : wanted].decode("ascii"))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """End the process; a thread waiting on its answer sees the pipe's end (its own caller cleans up)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def discard(self) -> None:
        """Kill it and close its pipes (only its caller, no other thread, may still use them)."""
        self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class TemplateRenderer:
    """A pool of chat-template workers (started on the first render, or by :meth:`start`).

    Safe to call from many threads: each render takes an idle worker, waiting at most ``limits.seconds``
    for one (:class:`RendererBusy` after that).
    """

    def __init__(self, limits: RenderLimits | None = None) -> None:
        self.limits = limits or RenderLimits()
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        # Workers die with their renderer even if close() is never called (a tokenizer dropped in code).
        weakref.finalize(self, _kill_all, self._workers)

    def start(self) -> None:
        """Spawn the workers now (they import in the background), so the first chat request does not wait."""
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
            for _ in range(self.limits.workers):
                self._idle.put(self._spawn())

    def _spawn(self) -> _Worker:
        worker = _Worker(self.limits)
        self._workers.add(worker)
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.discard()
        with self._lock:
            self._workers.discard(worker)
            if not self._closed:
                self._idle.put(self._spawn())

    def render(
        self,
        template: str,
        messages: list[dict[str, Any]],
        variables: dict[str, Any],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """``template`` rendered for ``messages`` with ``variables`` (special tokens, the request's
        ``chat_template_kwargs``), as transformers' ``apply_chat_template(tokenize=False)`` renders it."""
        self.start()
        limits = self.limits
        try:
            worker = self._idle.get(timeout=limits.seconds)
        except queue.Empty:
            raise RendererBusy(
                f"every chat-template worker ({limits.workers}) stayed busy for {limits.seconds:g} s; retry"
            ) from None
        request = {
            "template": template,
            "messages": messages,
            "variables": variables,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tools": None if tools is None else [dict(t) for t in tools],
        }
        try:
            reply = worker.call(request, limits.seconds + KILL_GRACE)
        except _WorkerGone as exc:
            self._replace(worker)
            if self._closed:
                raise RendererBusy("the server is shutting down") from None
            raise ChatTemplateError(
                f"the chat template was stopped: {exc} (a render may take {limits.seconds:g} s)"
            ) from None
        if reply.get("error") == "memory" or not worker.alive:  # it ends itself after running out of memory
            self._replace(worker)
        else:
            self._idle.put(worker)
        if "text" in reply:
            return str(reply["text"])
        message = reply.get("message", reply)
        if reply.get("error") == "template":  # its own raise_exception(...) or an error in the template
            raise ChatTemplateError(f"the chat template refused the messages: {message}")
        raise ChatTemplateError(f"the chat template was stopped: {message}")

    def close(self) -> None:
        """Kill every worker; renders waiting on one end at once (503: the server is shutting down)."""
        with self._lock:
            self._closed = True
        _kill_all(self._workers)


def _kill_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.kill()
