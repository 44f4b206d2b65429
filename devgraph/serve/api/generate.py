"""Running one checked generation request through the engine, for either route.

A request holds one or more prompts (a completions ``prompt`` list); each is submitted as one engine
request of ``n`` copies (``best_of`` copies where that is larger), which the engine samples from one
prefill. The engine thread hands each step's outputs to the request's :class:`Mailbox` (through
:class:`Outbox`: one event-loop wake-up per step, not one per token; a stream writes the chunks of the
outputs that arrived together in one write). Each choice (a copy) turns its token ids into text with
the tokenizer's incremental decoder, watches for stop strings
(:class:`~devgraph.serve.api.stops.StopMatcher`: on a match that copy ends at once with
``finish_reason: "stop"``), and the answer takes the route's shape: one JSON body, or server-sent events
ending in ``data: [DONE]``. Choice ``i`` of prompt ``p`` has ``index`` ``p * n + i``; with ``best_of``,
the ``n`` copies of highest cumulative log probability are returned.

A stream never sends a chunk with empty text, except a choice's last (its ``finish_reason``): tokens
whose text is not out yet (part of a character, the start of a possible stop string) travel with the
next chunk that has text, ids and log probabilities included, so a client that counts chunks as tokens
is never told of a token without its text. ``stream_options.continuous_usage_stats`` puts the usage so
far in every chunk.

A handler that ends before its request finished (the client went away: a failed write, or aiohttp
cancelling the handler) aborts every copy, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from devgraph import InputError
from devgraph.serve.api.fields import Generation
from devgraph.serve.api.metrics import ServeMetrics
from devgraph.serve.api.protocol import ApiError, error_body, now
from devgraph.serve.api.stops import StopMatcher
from devgraph.serve.checkpoint.text import IncrementalDecoder, Tokenizer
from devgraph.serve.engine.engine_thread import EngineAsleep, EngineClosed, EngineLoop
from devgraph.serve.engine.request import FinishReason, RequestOutput, TokenLogprob

__all__ = ["ASLEEP_MESSAGE", "Choice", "Outbox", "Shape", "respond"]

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
ASLEEP_MESSAGE = "the server is asleep (sleep mode): POST /wake_up, then send requests again"


@dataclass
class Choice:
    """One choice (a copy of one prompt) as the client sees it so far."""

    prompt: int  # which prompt of the request
    copy: int  # which copy of that prompt
    decoder: IncrementalDecoder
    stops: StopMatcher
    index: int = 0  # the choice's index in the response
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text: str = ""
    finish: str | None = None
    error: str | None = None
    sent_first: bool = False  # a stream chunk of this choice went out
    pending_ids: list[int] = field(default_factory=list)  # streamed: waiting for their text
    pending_logprobs: list[TokenLogprob] | None = None

    def take(self, output: RequestOutput) -> str:
        """This output's text (stop strings applied); records its ids and log probabilities, and
        ``finish`` when the choice ended."""
        self.ids += output.token_ids
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
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
        self.text += text
        return text

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.logprob for entry in self.logprobs or ())


class Shape(Protocol):
    """A route's choices (the id, object, created, model and usage around them are common)."""

    object: str

    def opening(self, choice: Choice) -> dict[str, Any] | None:
        """The stream's first chunk of a choice, before any text (chat: the assistant role), or None."""
        ...

    def piece(
        self, choice: Choice, text: str, ids: list[int], logprobs: Sequence[TokenLogprob] | None
    ) -> dict[str, Any]:
        """A stream chunk's choice: new text, its ids and log probabilities; ``choice.finish`` if ended."""
        ...

    def whole(self, choice: Choice, logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        """A whole response's choice."""
        ...


class Mailbox:
    """One HTTP request's engine outputs on the event loop. :class:`Outbox`'s flush puts them in; the
    handler takes every output there in one go (:meth:`take`), so it wakes once per flush however many
    outputs the flush brought (``n`` copies, or steps it fell behind on), not once per output."""

    def __init__(self) -> None:
        self._outputs: list[RequestOutput] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, output: RequestOutput) -> None:
        """On the event loop."""
        self._outputs.append(output)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[RequestOutput]:
        """Every output put in since the last take, oldest first; waits for one when there is none."""
        while not self._outputs:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        outputs, self._outputs = self._outputs, []
        return outputs


class Outbox:
    """Hands engine outputs to the event loop with one wake-up per batch, not one per token.

    ``put`` runs on the engine thread: it appends to a deque and, unless a flush is already scheduled,
    schedules one with ``call_soon_threadsafe``; the flush (on the event loop) moves every pending output
    into its request's :class:`Mailbox`. At 32 streams that is one wake-up of the loop per step instead of
    32. The lock is taken only to schedule a flush: an output appended while one is scheduled is moved by
    that flush, which clears the flag before it drains the deque.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: collections.deque[tuple[Mailbox, RequestOutput]] = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, mailbox: Mailbox, output: RequestOutput) -> None:
        self._pending.append((mailbox, output))
        if self._scheduled:  # the scheduled flush has not cleared the flag yet: it drains this one too
            return
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            self._scheduled = False
        pending = self._pending
        while pending:
            mailbox, output = pending.popleft()
            mailbox.put(output)


class _Run:
    """The engine requests of one HTTP request and their choices."""

    def __init__(self, engine: EngineLoop, generation: Generation, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.generation = generation
        copies = generation.params.n
        self.groups: dict[str, int] = {}  # engine request id -> prompt index
        self.choices: dict[tuple[int, int], Choice] = {}
        for p, prompt in enumerate(generation.prompts):
            for c in range(copies):
                stops = StopMatcher(generation.stop_strings, generation.include_stop_str)
                self.choices[p, c] = Choice(p, c, tokenizer.decoder(prompt), stops, index=p * copies + c)
        self.open = len(self.choices)
        self.failed: str | None = None

    def submit(self, mailbox: Mailbox, outbox: Outbox, metrics: ServeMetrics | None) -> None:
        """Check every prompt, then submit each (so a bad second prompt submits none)."""
        params = self.generation.params
        for prompt in self.generation.prompts:
            self.engine.engine.check_request(prompt, params)
        arrival = time.monotonic()

        def sink(output: RequestOutput) -> None:  # on the engine thread
            if metrics is not None:
                metrics.observe(output, time.monotonic() - arrival)
            outbox.put(mailbox, output)

        for p, prompt in enumerate(self.generation.prompts):
            self.groups[self.engine.submit(prompt, params, sink)] = p

    def abort(self) -> None:
        for group in self.groups:
            self.engine.abort(group)

    async def next(self, mailbox: Mailbox) -> list[tuple[Choice, str, RequestOutput]]:
        """The outputs that arrived (at least one), each with its choice and new text, in order; stops
        after the one that closed the last open choice or failed the request (as reading them one by
        one would). A choice that reached a stop string is aborted."""
        return list(self.each(await mailbox.take()))

    def each(self, outputs: list[RequestOutput]) -> Iterator[tuple[Choice, str, RequestOutput]]:
        """:meth:`next` one output at a time: each is taken (its choice's text, finish and the usage
        updated) only when asked for, so what is built from the one before it sees the state as it was
        then (a chunk's ``finish_reason`` and usage, a stream's tokens before a failure)."""
        for output in outputs:
            if self.choices[self.groups[output.group], output.index].finish is not None:
                continue  # a copy a stop string ended had outputs in flight (and its abort's): not sent
            yield self._take(output)
            if not self.open or self.failed is not None:
                return

    def _take(self, output: RequestOutput) -> tuple[Choice, str, RequestOutput]:
        choice = self.choices[self.groups[output.group], output.index]
        was_open = choice.finish is None
        text = choice.take(output)
        if choice.stops.stopped and not output.finished:
            self.engine.abort(output.group, FinishReason.STOP, output.index)
        if was_open and choice.finish is not None:
            self.open -= 1
        if choice.error is not None:
            self.failed = choice.error
        return choice, text, output

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.generation.prompts)
        completion = sum(len(c.ids) for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def returned(self) -> list[Choice]:
        """The choices the response holds, by index: all, or with ``best_of`` the ``n`` most likely copies
        of each prompt (indexed ``p * n + rank``)."""
        n, copies = self.generation.n, self.generation.params.n
        if n == copies:
            return sorted(self.choices.values(), key=lambda c: c.index)
        kept = []
        for p in range(len(self.generation.prompts)):
            ranked = sorted(
                (self.choices[p, c] for c in range(copies)), key=lambda c: c.cumulative_logprob, reverse=True
            )
            for rank, choice in enumerate(ranked[:n]):
                choice.index = p * n + rank
                kept.append(choice)
        return kept

    def group_tokens(self) -> list[int]:
        """Per prompt, the most tokens any of its copies generated (request_max_num_generation_tokens)."""
        most = [0] * len(self.generation.prompts)
        for choice in self.choices.values():
            most[choice.prompt] = max(most[choice.prompt], len(choice.ids))
        return most


async def respond(
    request: web.Request,
    engine: EngineLoop,
    generation: Generation,
    shape: Shape,
    *,
    outbox: Outbox,
    tokenizer: Tokenizer,
    metrics: ServeMetrics | None,
) -> web.StreamResponse:
    """Submit ``generation`` and answer ``request`` from its outputs; aborts every engine request if the
    handler ends first. :class:`ApiError`: 400 for a prompt the engine cannot take, 503 while it is
    closing or asleep, 500 when the engine failed the request (before a stream started)."""
    run = _Run(engine, generation, tokenizer)
    mailbox = Mailbox()
    try:
        run.submit(mailbox, outbox, metrics)
    except InputError as exc:
        run.abort()
        raise ApiError(400, str(exc)) from None
    except EngineAsleep:
        run.abort()
        raise ApiError(503, ASLEEP_MESSAGE, kind="unavailable") from None
    except EngineClosed as exc:
        run.abort()
        raise ApiError(503, str(exc), kind="unavailable") from None
    finished = False
    try:
        if generation.stream:
            response = await _stream(request, run, shape, mailbox)
        else:
            response = await _collect(run, shape, mailbox)
        finished = True
        if metrics is not None:
            for tokens in run.group_tokens():
                metrics.observe_group(tokens)
        return response
    finally:
        if not finished:  # the client went away (or the handler failed): free the requests' blocks
            run.abort()


def _head(shape: Shape, generation: Generation, request_id: str, created: int, chunk: bool) -> dict[str, Any]:
    chat = shape.object == "chat.completion"
    identity = "chatcmpl-" + request_id.removeprefix("cmpl-") if chat else request_id
    kind = f"{shape.object}.chunk" if chunk and chat else shape.object
    return {"id": identity, "object": kind, "created": created, "model": generation.model}


def _visible(run: _Run, logprobs: Sequence[TokenLogprob] | None) -> Sequence[TokenLogprob] | None:
    """Log probabilities the client asked for (``best_of`` computes them for itself otherwise)."""
    return logprobs if run.generation.client_logprobs else None


async def _collect(run: _Run, shape: Shape, mailbox: Mailbox) -> web.Response:
    created = now()
    while run.open and run.failed is None:
        await run.next(mailbox)
    if run.failed is not None:
        raise ApiError(500, f"the engine failed on this request: {run.failed}")
    body = _head(shape, run.generation, next(iter(run.groups)), created, chunk=False)
    body["choices"] = [shape.whole(c, _visible(run, c.logprobs)) for c in run.returned()]
    body["usage"] = run.usage()
    return web.json_response(body)


async def _stream(request: web.Request, run: _Run, shape: Shape, mailbox: Mailbox) -> web.StreamResponse:
    created = now()
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    try:
        await _events(response, run, shape, mailbox, created)
    except Exception as exc:
        if isinstance(exc, ConnectionError):
            raise  # the client left: respond() aborts its requests
        # The stream has begun, so no 500 response can follow (aiohttp would write its status line into
        # the open stream): the error is the stream's last event, as an engine failure's is.
        logger.exception("streaming a %s response failed", request.path)
        run.abort()
        message = "the server failed while streaming this request; see its log"
        await _event(response, error_body(ApiError(500, message)))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _events(
    response: web.StreamResponse, run: _Run, shape: Shape, mailbox: Mailbox, created: int
) -> None:
    """The stream's events up to (not including) ``[DONE]``: the chunks of the outputs that arrived
    together (one engine step's, for this request) go out in one write."""
    generation = run.generation
    chunk = _ChunkEncoder(_head(shape, generation, next(iter(run.groups)), created, chunk=True))

    def usage() -> dict[str, Any] | None:
        return run.usage() if generation.continuous_usage else None

    has_usage = generation.continuous_usage or generation.include_usage
    for choice in sorted(run.choices.values(), key=lambda c: c.index):
        opening = shape.opening(choice)
        if opening is not None:
            await response.write(chunk.encode([opening], has_usage, usage()))
    while run.open:
        events: list[bytes] = []
        for choice, text, output in run.each(await mailbox.take()):
            if run.failed is not None:
                message = f"the engine failed on this request: {run.failed}"
                events.append(_encoded(error_body(ApiError(500, message))))
                break
            choice.pending_ids += output.token_ids
            if output.logprobs is not None:
                choice.pending_logprobs = (choice.pending_logprobs or []) + output.logprobs
            if not text and choice.finish is None and not (output.prompt_logprobs and not choice.sent_first):
                continue  # no text yet: these tokens go with the next chunk that has some
            ids, logprobs = choice.pending_ids, choice.pending_logprobs
            choice.pending_ids, choice.pending_logprobs = [], None
            piece = shape.piece(choice, text, ids, _visible(run, logprobs))
            choice.sent_first = True
            events.append(chunk.encode([piece], has_usage, usage()))
        if events:
            await response.write(b"".join(events))
        if run.failed is not None:
            break
    if generation.include_usage and run.failed is None:
        await response.write(chunk.encode([], True, run.usage()))


#: Compact JSON (no spaces), as every event is written; one encoder, not one per event.
_JSON = json.JSONEncoder(separators=(",", ":"))


def _encoded(payload: dict[str, Any]) -> bytes:
    return b"data: " + _JSON.encode(payload).encode() + b"\n\n"


class _ChunkEncoder:
    """A stream's chunk events as bytes: the head (``id``, ``object``, ``created``, ``model``) is
    serialised once, then each chunk's ``choices`` and ``usage`` after it; the bytes are those of
    :func:`_encoded` of ``{**head, "choices": ..., "usage": ...}``."""

    def __init__(self, head: dict[str, Any]) -> None:
        self._prefix = b"data: " + _JSON.encode(head)[:-1].encode() + b',"choices":'

    def encode(self, choices: list[dict[str, Any]], has_usage: bool, usage: dict[str, Any] | None) -> bytes:
        """A chunk of ``choices``; ``has_usage``: with a ``usage`` field (``null`` when ``usage`` is None)."""
        body = _JSON.encode(choices)
        if has_usage:
            body += ',"usage":' + _JSON.encode(usage)
        return self._prefix + body.encode() + b"}\n\n"


async def _event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(_encoded(payload))
