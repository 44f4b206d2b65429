"""The HTTP API of ``devgraph serve`` on aiohttp.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or server-sent events with
``"stream": true``), ``GET /v1/models`` and ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``
(Prometheus text) and ``GET /v1/engine/stats`` (the engine's counters and the start-up times as JSON);
with ``--enable-sleep-mode``, ``POST /sleep`` (``?level=1``), ``POST /wake_up`` and ``GET /is_sleeping``.
Handlers never block the event loop: the engine steps in its own thread
(:class:`~devgraph.serve.engine.EngineLoop`) and hands tokens back through ``call_soon_threadsafe``;
reading the engine's stats waits for the current step, so it runs in an executor thread; so does reading a
chat request, whose template renders in a worker process (``checkpoint/template_render.py``) for up to its
time budget: one request's template never stalls the others, ``/health`` or a SIGTERM. How one
generation request runs is in ``generate.py``; what each route takes, in ``completions.py`` and
``chat.py``.

Every error is JSON in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: the handlers'
own (:class:`~devgraph.serve.api.protocol.ApiError`) and, through :func:`json_errors`, aiohttp's (unknown
route 404, wrong method 405, body too large 413) and any exception a handler did not expect (500).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from devgraph import ConfigError, InputError
from devgraph.extras import install_hint
from devgraph.messages import shorten
from devgraph.serve.api.chat import parse_chat
from devgraph.serve.api.completions import parse_completion
from devgraph.serve.api.fields import Generation
from devgraph.serve.api.generate import ASLEEP_MESSAGE, Outbox, Shape, respond
from devgraph.serve.api.metrics import ServeMetrics
from devgraph.serve.api.protocol import ApiError, ModelCard, error_body, model_list, model_object
from devgraph.serve.api.structured import attach_grammar
from devgraph.serve.checkpoint.byte_tokenizer import ByteTokenizer
from devgraph.serve.checkpoint.template_render import RendererBusy
from devgraph.serve.checkpoint.text import Tokenizer
from devgraph.serve.engine.engine_thread import EngineLoop
from devgraph.serve.structured.compiler import GrammarCompiler

__all__ = ["ServerState", "build_app", "json_errors"]

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the handlers share. ``sampling_defaults``: the model's generation config (temperature, top_p,
    top_k) for requests that set none; ``eos_token_ids``: where generation stops unless ``ignore_eos``;
    ``startup``: the start-up stages' seconds, reported by ``/v1/engine/stats``."""

    engine: EngineLoop
    model_name: str
    metrics: ServeMetrics | None
    max_queued: int
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    root: str | None = None
    startup: dict[str, Any] = field(default_factory=dict)
    draining: bool = False
    body_timeout: float = 30.0  # seconds a request body may take to arrive (--body-timeout)
    outbox: Outbox | None = None  # made on the event loop by the first request
    sleep_mode: bool = False  # --enable-sleep-mode: POST /sleep, POST /wake_up, GET /is_sleeping
    created: int = field(default_factory=lambda: int(time.time()))
    structured_outputs: str = "all"  # --structured-outputs: which constraints requests may carry
    grammars: GrammarCompiler | None = None  # made by the first constrained request

    def grammar_compiler(self) -> GrammarCompiler:
        """The server's grammar compiler (llguidance is imported by its first compile, not here)."""
        if self.grammars is None:
            self.grammars = GrammarCompiler(
                self.tokenizer,
                self.engine.engine.model_config.vocab_size,
                self.eos_token_ids,
                allowed=self.structured_outputs,
            )
        return self.grammars

    #: Threads that read chat requests: each may wait on a template render (threads start on demand).
    chat_threads: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(CHAT_THREADS, thread_name_prefix="devgraph-chat")
    )

    def card(self) -> ModelCard:
        config = self.engine.engine.model_config
        return ModelCard(self.model_name, config.vocab_size, config.max_seq_len, self.root, self.created)


#: Chat requests read at once (more wait for a thread); past the render workers, each waits for one of
#: them for at most a render's budget, then gets 503.
CHAT_THREADS = 32

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
    except Exception as exc:
        if isinstance(exc, ConnectionError) and _client_left(request):
            # A client that hangs up (Ctrl-C, a load generator's cancel) is no server failure: its
            # requests were aborted on the way out; aiohttp drops this reply to the closed connection.
            logger.info("%s %s: the client closed the connection (%s)", request.method, request.path, exc)
            return web.Response(status=499, text="client closed request")
        logger.exception("%s %s failed", request.method, request.path)
        return _error(ApiError(500, "the server failed on this request; see its log"))


def _check_room(state: ServerState, adding: int) -> None:
    """429 when the engine requests this one adds (one per prompt) would take the in-flight count past
    ``--max-queued-requests``; 400 when this request alone has more prompts than the limit (retrying it
    can never succeed)."""
    limit = state.max_queued
    if adding > limit:
        raise ApiError(
            400,
            f"this request has {adding} prompts and the server takes at most {limit} requests in flight "
            "(--max-queued-requests): send the prompts in smaller lists",
            param="prompt",
        )
    if state.engine.in_flight() + adding > limit:
        raise ApiError(429, f"{limit} requests are in flight; retry later", kind="overloaded")


def _client_left(request: web.Request) -> bool:
    """Whether the client's connection is gone (closed, or closing)."""
    transport = request.transport
    return transport is None or transport.is_closing()


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
            web.post("/v1/chat/completions", _chat),
            web.get("/v1/models", _models),
            web.get("/v1/models/{model:.+}", _model),
            web.get("/health", _health),
            web.get("/metrics", _metrics),
            web.get("/v1/engine/stats", _stats),
        ]
    )
    if state.sleep_mode:
        app.add_routes(
            [
                web.post("/sleep", _sleep),
                web.post("/wake_up", _wake_up),
                web.get("/is_sleeping", _is_sleeping),
            ]
        )
    return app


async def _sleep(request: web.Request) -> web.Response:
    """Free the graphs and the KV cache of an idle engine (level 1; the weights stay)."""
    state = request.app[STATE]
    text = request.query.get("level", "1")
    try:
        level = int(text)
    except ValueError:
        return _error(ApiError(400, f"level must be an integer, got {shorten(text)}", param="level"))
    try:
        freed = await asyncio.get_running_loop().run_in_executor(None, state.engine.sleep, level)
    except ConfigError as exc:
        status = 400 if "level" in str(exc) else 409
        return _error(ApiError(status, str(exc), param="level" if status == 400 else None))
    return web.json_response({"is_sleeping": True, **freed})


async def _wake_up(request: web.Request) -> web.Response:
    """Allocate the KV cache again, then capture the graphs again; requests are taken once it returns."""
    state = request.app[STATE]
    took = await asyncio.get_running_loop().run_in_executor(None, state.engine.wake_up)
    return web.json_response({"is_sleeping": False, **took})


async def _is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": request.app[STATE].engine.is_sleeping})


def _asleep_error() -> web.Response:
    return _error(ApiError(503, ASLEEP_MESSAGE, kind="unavailable"))


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    if state.sleep_mode and state.engine.is_sleeping:
        return web.json_response({"status": "sleeping"})
    background = state.engine.engine.background  # progress() reads counters only: no need to wait a step
    if background is None:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "ok", "graphs": background.progress()})


async def _models(request: web.Request) -> web.Response:
    return web.json_response(model_list(request.app[STATE].card()))


async def _model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name != state.model_name:
        message = f"model {shorten(name)} is not served here; this server serves {state.model_name!r}"
        return _error(ApiError(404, message, param="model", kind="not_found_error"))
    return web.json_response(model_object(state.card()))


async def _stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = await asyncio.get_running_loop().run_in_executor(None, state.engine.stats)
    return web.json_response({**stats, "startup": state.startup})


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[STATE].metrics
    if metrics is None:
        message = f"GET /metrics needs prometheus_client, which is not installed: {install_hint('serve')}"
        return _error(ApiError(501, message, kind="not_implemented"))
    body, content_type = await asyncio.get_running_loop().run_in_executor(None, metrics.render)
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _read(request: web.Request, state: ServerState) -> Any:
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
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {shorten(str(exc))}") from None


Parser = Callable[[Any, ServerState], tuple[Generation, Shape]]


def _parse_completion(body: Any, state: ServerState) -> tuple[Generation, Shape]:
    return parse_completion(
        body,
        state.tokenizer,
        state.model_name,
        defaults=state.sampling_defaults,
        eos_token_ids=state.eos_token_ids,
    )


def _parse_chat(body: Any, state: ServerState) -> tuple[Generation, Shape]:
    return parse_chat(
        body,
        state.tokenizer,
        state.model_name,
        context=state.engine.engine.model_config.max_seq_len,
        defaults=state.sampling_defaults,
        eos_token_ids=state.eos_token_ids,
    )


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, _parse_completion)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generation(request, _parse_chat, off_loop=True)


async def _generation(request: web.Request, parse: Parser, *, off_loop: bool = False) -> web.StreamResponse:
    state = request.app[STATE]
    if state.draining:
        return _error(ApiError(503, "the server is shutting down", kind="unavailable"))
    if state.sleep_mode and state.engine.is_sleeping:
        return _asleep_error()
    try:
        body = await _read(request, state)
        if off_loop:  # a chat template renders for up to its budget: not on the event loop
            loop = asyncio.get_running_loop()
            generation, shape = await loop.run_in_executor(state.chat_threads, parse, body, state)
        else:
            generation, shape = parse(body, state)
        if generation.grammar is not None:  # compiled off the event loop, bounded, cached
            generation = await attach_grammar(state.grammar_compiler(), generation)
        _check_room(state, len(generation.prompts))
    except ApiError as exc:
        return _error(exc)
    except InputError as exc:  # a chat template that refuses the messages, text that is not Unicode
        return _error(ApiError(400, str(exc), param="messages" if off_loop else "prompt"))
    except RendererBusy as exc:
        return _error(ApiError(503, str(exc), kind="unavailable"))
    except Exception as exc:  # a body the checks above missed: a bug, but the client still gets JSON
        if isinstance(exc, ConnectionError) and _client_left(request):
            raise  # the client hung up mid-body: json_errors says so, quietly
        logger.exception("checking a %s request failed", request.path)
        return _error(ApiError(500, "the server failed to read this request; see its log"))
    if state.outbox is None:
        state.outbox = Outbox(asyncio.get_running_loop())
    try:
        return await respond(
            request,
            state.engine,
            generation,
            shape,
            outbox=state.outbox,
            tokenizer=state.tokenizer,
            metrics=state.metrics,
        )
    except ApiError as exc:  # refused by the engine (400, 503), or failed by it before a stream (500)
        return _error(exc)
