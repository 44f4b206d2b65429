"""Running one checked generation request through the engine, for either route.

The engine thread hands each step's output to the request's queue (through :class:`Outbox`: one
event-loop wake-up per step, not one per token). The handler turns token ids into text with the
tokenizer's incremental decoder, watches for stop strings (:class:`~devgraph.serve.api.stops.StopMatcher`:
on a match the request ends at once with ``finish_reason: "stop"``), and answers with the route's shape:
one JSON body, or server-sent events ending in ``data: [DONE]``. A handler that ends before its request
finished (the client went away: a failed write, or aiohttp cancelling the handler) aborts the request,
which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from devgraph.serve.api.fields import Generation
from devgraph.serve.api.protocol import ApiError, error_body, now
from devgraph.serve.api.stops import StopMatcher
from devgraph.serve.checkpoint.text import IncrementalDecoder
from devgraph.serve.engine.loop import EngineLoop
from devgraph.serve.engine.request import FinishReason, RequestOutput, TokenLogprob

__all__ = ["Outbox", "Shape", "respond"]

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


class Shape(Protocol):
    """A route's response bodies (without id, object, created, model and usage, which are common)."""

    object: str

    def first(self) -> dict[str, Any] | None: ...

    def chunk(
        self, text: str, ids: list[int], logprobs: Sequence[TokenLogprob] | None, finish: str | None
    ) -> dict[str, Any]: ...

    def whole(
        self, text: str, ids: list[int], logprobs: Sequence[TokenLogprob] | None, finish: str | None
    ) -> dict[str, Any]: ...


class Outbox:
    """Hands engine outputs to the event loop with one wake-up per batch, not one per token.

    ``put`` runs on the engine thread: it appends to a deque and, unless a flush is already scheduled,
    schedules one with ``call_soon_threadsafe``; the flush (on the event loop) moves every pending output
    into its request's queue. At 32 streams that is one wake-up per step instead of 32.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: collections.deque[tuple[asyncio.Queue[RequestOutput], RequestOutput]] = (
            collections.deque()
        )
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, queue: asyncio.Queue[RequestOutput], output: RequestOutput) -> None:
        self._pending.append((queue, output))
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            self._scheduled = False
        while self._pending:
            queue, output = self._pending.popleft()
            queue.put_nowait(output)


@dataclass
class _Progress:
    """What a request has produced so far, as the client sees it."""

    decoder: IncrementalDecoder
    stops: StopMatcher
    prompt_tokens: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish: str | None = None
    error: str | None = None

    def take(self, output: RequestOutput) -> tuple[str, list[int], list[TokenLogprob] | None]:
        """This output's text (stop strings applied), ids and log probabilities; sets ``finish``."""
        self.ids += output.token_ids
        if output.logprobs is not None:
            self.logprobs = (self.logprobs or []) + output.logprobs
        text = self.stops.feed(self.decoder.feed(output.token_ids))
        if self.stops.stopped:
            self.finish = str(FinishReason.STOP)
        elif output.finished:
            text += self.stops.feed(self.decoder.flush())
            text += self.stops.flush()
            self.finish = "stop" if self.stops.stopped else str(output.finish_reason)
            if output.finish_reason is FinishReason.ERROR:
                self.error = output.error
        return text, output.token_ids, output.logprobs

    def usage(self) -> dict[str, int]:
        count = len(self.ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": count,
            "total_tokens": self.prompt_tokens + count,
        }


async def respond(
    request: web.Request,
    engine: EngineLoop,
    generation: Generation,
    shape: Shape,
    queue: asyncio.Queue[RequestOutput],
    request_id: str,
    decoder: IncrementalDecoder,
) -> web.StreamResponse:
    """Answer ``request`` from ``queue`` (its engine outputs); aborts the engine request if the handler
    ends first. ``request_id`` is the engine's, ``cmpl-N`` (chat responses are ``chatcmpl-N``)."""
    progress = _Progress(
        decoder, StopMatcher(generation.stop_strings, generation.include_stop_str), len(generation.prompt)
    )
    finished = False
    try:
        if generation.stream:
            response = await _stream(request, engine, generation, shape, queue, request_id, progress)
        else:
            response = await _collect(engine, generation, shape, queue, request_id, progress)
        finished = True
        return response
    finally:
        if not finished:  # the client went away (or the handler failed): free the request's blocks
            engine.abort(request_id)


def _head(shape: Shape, generation: Generation, request_id: str, created: int, chunk: bool) -> dict[str, Any]:
    chat = shape.object == "chat.completion"
    identity = "chatcmpl-" + request_id.removeprefix("cmpl-") if chat else request_id
    kind = f"{shape.object}.chunk" if chunk and chat else shape.object
    return {"id": identity, "object": kind, "created": created, "model": generation.model}


async def _next(
    engine: EngineLoop, queue: asyncio.Queue[RequestOutput], request_id: str, progress: _Progress
) -> tuple[str, list[int], list[TokenLogprob] | None, bool]:
    output = await queue.get()
    text, ids, logprobs = progress.take(output)
    if progress.stops.stopped and not output.finished:
        engine.abort(request_id, FinishReason.STOP)  # its text reached a stop string: no more steps
    return text, ids, logprobs, progress.finish is not None


async def _collect(
    engine: EngineLoop,
    generation: Generation,
    shape: Shape,
    queue: asyncio.Queue[RequestOutput],
    request_id: str,
    progress: _Progress,
) -> web.Response:
    created = now()
    text, done = "", False
    while not done:
        piece, _, _, done = await _next(engine, queue, request_id, progress)
        text += piece
    if progress.error is not None:
        raise ApiError(500, f"the engine failed on this request: {progress.error}")
    body = _head(shape, generation, request_id, created, chunk=False)
    body.update(shape.whole(text, progress.ids, progress.logprobs, progress.finish))
    body["usage"] = progress.usage()
    return web.json_response(body)


async def _stream(
    request: web.Request,
    engine: EngineLoop,
    generation: Generation,
    shape: Shape,
    queue: asyncio.Queue[RequestOutput],
    request_id: str,
    progress: _Progress,
) -> web.StreamResponse:
    created = now()
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    head = _head(shape, generation, request_id, created, chunk=True)
    usage_field = {"usage": None} if generation.include_usage else {}
    first = shape.first()
    if first is not None:
        await _event(response, {**head, **first, **usage_field})
    done = False
    while not done:
        text, ids, logprobs, done = await _next(engine, queue, request_id, progress)
        if progress.error is not None:
            message = f"the engine failed on this request: {progress.error}"
            await _event(response, error_body(ApiError(500, message)))
            break
        await _event(response, {**head, **shape.chunk(text, ids, logprobs, progress.finish), **usage_field})
    if generation.include_usage and progress.error is None:
        await _event(response, {**head, "choices": [], "usage": progress.usage()})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
