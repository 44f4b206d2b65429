"""The HTTP API of ``devgraph serve`` on aiohttp.

Routes: ``POST /v1/completions`` (JSON, or server-sent events with ``"stream": true``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text) and ``GET /v1/engine/stats`` (the engine's counters as
JSON, for tests and debugging). Handlers never block the event loop: the engine steps in its own thread
(:class:`~devgraph.serve.engine.EngineLoop`) and hands tokens back through ``call_soon_threadsafe``;
reading the engine's stats waits for the current step, so it runs in an executor thread.

A handler that ends before its request finished (the client went away: a failed write, or aiohttp
cancelling the handler) aborts the request, which frees its KV blocks.

Every error is JSON in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: the handlers'
own (:class:`~devgraph.serve.api.protocol.ApiError`) and, through :func:`json_errors`, aiohttp's (unknown
route 404, wrong method 405, body too large 413) and any exception a handler did not expect (500).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from devgraph.errors import InputError
from devgraph.extras import install_hint
from devgraph.messages import shorten
from devgraph.serve.api.metrics import ServeMetrics
from devgraph.serve.api.protocol import (
    ApiError,
    CompletionRequest,
    ModelCard,
    completion_chunk,
    completion_response,
    error_body,
    model_list,
    now,
    parse,
)
from devgraph.serve.api.tokenizer import ByteTokenizer, StreamDecoder
from devgraph.serve.engine.loop import EngineClosed, EngineLoop
from devgraph.serve.engine.request import FinishReason, RequestOutput

__all__ = ["ServerState", "build_app", "json_errors"]

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


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
class ServerState:
    """What the handlers share."""

    engine: EngineLoop
    model_name: str
    metrics: ServeMetrics | None
    max_queued: int
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    draining: bool = False
    body_timeout: float = 30.0  # seconds a request body may take to arrive (--body-timeout)
    outbox: Outbox | None = None  # made on the event loop by the first request


# aiohttp >= 3.9 types application keys; older versions take a plain string.
STATE: Any = (
    web.AppKey("devgraph_serve_state", ServerState) if hasattr(web, "AppKey") else "devgraph_serve_state"
)


def _error(error: ApiError) -> web.Response:
    return web.json_response(error_body(error), status=error.status)


#: aiohttp's error statuses, as OpenAI error types.
_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (404 unknown route, 405 wrong method with its ``Allow`` header, 413, ...) and
    unexpected exceptions (500, logged) as the OpenAI error JSON the handlers' errors already are."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like are not errors
            raise
        message = f"{request.method} {shorten(request.path, 120)}: {exc.reason}"
        if exc.status == 404:
            message += f"; routes: {', '.join(_routes(request.app))}"
        response = _error(ApiError(exc.status, message, kind=_ERROR_TYPES.get(exc.status)))
        if "Allow" in exc.headers:  # 405 says which methods the route takes
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return _error(ApiError(500, "the server failed on this request; see its log"))


def _routes(app: web.Application) -> list[str]:
    """``METHOD /path`` of every route the app serves (HEAD, which aiohttp adds to each GET, left out)."""
    return [
        f"{route.method} {route.resource.canonical}"
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    ]


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[json_errors])
    app[STATE] = state
    app.add_routes(
        [
            web.post("/v1/completions", _completions),
            web.get("/v1/models", _models),
            web.get("/health", _health),
            web.get("/metrics", _metrics),
            web.get("/v1/engine/stats", _stats),
        ]
    )
    return app


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ok"})


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    config = state.engine.engine.model_config
    return web.json_response(model_list(ModelCard(state.model_name, config.vocab_size, config.max_seq_len)))


async def _stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = await asyncio.get_running_loop().run_in_executor(None, state.engine.stats)
    return web.json_response(stats)


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[STATE].metrics
    if metrics is None:
        message = f"GET /metrics needs prometheus_client, which is not installed: {install_hint('serve')}"
        return _error(ApiError(501, message, kind="not_implemented"))
    body, content_type = await asyncio.get_running_loop().run_in_executor(None, metrics.render)
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _read(request: web.Request, state: ServerState) -> CompletionRequest:
    try:
        # A client that stalls mid-body is dropped: it would hold a handler (and the shutdown) forever.
        raw = await asyncio.wait_for(request.read(), state.body_timeout)
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(413, f"the request body is too large ({exc.text})") from None
    except asyncio.TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {state.body_timeout:g} s", kind="timeout"
        ) from None
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {shorten(str(exc))}") from None
    return parse(body, state.tokenizer, state.model_name)


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if state.draining:
        return _error(ApiError(503, "the server is shutting down", kind="unavailable"))
    try:
        parsed = await _read(request, state)
        if state.engine.in_flight() >= state.max_queued:
            raise ApiError(429, f"{state.max_queued} requests are in flight; retry later", kind="overloaded")
    except ApiError as exc:
        return _error(exc)
    except Exception:  # a body the checks above missed: a bug, but the client still gets JSON
        logger.exception("checking a completion request failed")
        return _error(ApiError(500, "the server failed to read this request; see its log"))
    if state.outbox is None:
        state.outbox = Outbox(asyncio.get_running_loop())
    outbox = state.outbox
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    arrival = time.monotonic()
    metrics = state.metrics

    def sink(output: RequestOutput) -> None:  # on the engine thread
        if metrics is not None:
            metrics.observe(output, time.monotonic() - arrival if output.finished else None)
        outbox.put(queue, output)

    try:
        request_id = state.engine.submit(parsed.prompt, parsed.params, sink)
    except InputError as exc:
        return _error(ApiError(400, str(exc)))
    except EngineClosed as exc:
        return _error(ApiError(503, str(exc), kind="unavailable"))
    finished = False
    try:
        if parsed.stream:
            response = await _stream(request, state, parsed, request_id, queue)
        else:
            response = await _collect(state, parsed, request_id, queue)
        finished = True
        return response
    finally:
        if not finished:  # the client went away (or the handler failed): free the request's blocks
            state.engine.abort(request_id)


async def _collect(
    state: ServerState, parsed: CompletionRequest, request_id: str, queue: asyncio.Queue[RequestOutput]
) -> web.Response:
    created = now()
    tokens: list[int] = []
    while True:
        output = await queue.get()
        tokens += output.token_ids
        if output.finished:
            break
    if output.finish_reason is FinishReason.ERROR:
        return _error(ApiError(500, f"the engine failed on this request: {output.error}"))
    text = state.tokenizer.decode(tokens)
    return web.json_response(completion_response(request_id, parsed.model, created, text, tokens, output))


async def _stream(
    request: web.Request,
    state: ServerState,
    parsed: CompletionRequest,
    request_id: str,
    queue: asyncio.Queue[RequestOutput],
) -> web.StreamResponse:
    created = now()
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    decoder = StreamDecoder()
    while True:
        output = await queue.get()
        if output.finish_reason is FinishReason.ERROR:
            message = f"the engine failed on this request: {output.error}"
            await _event(response, error_body(ApiError(500, message)))
            break
        text = decoder.feed(output.token_ids) + (decoder.flush() if output.finished else "")
        await _event(response, completion_chunk(request_id, parsed.model, created, text, output))
        if output.finished:
            break
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
