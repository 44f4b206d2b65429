"""Turning a request's :class:`~devgraph.serve.structured.spec.GrammarSpec` into a grammar the engine
can run, within bounds (see :mod:`~devgraph.serve.structured.work_limits`), and only where the operator
allowed that kind of constraint (``devgraph serve --structured-outputs``).

One :class:`GrammarCompiler` per server. It imports llguidance on first use (:class:`ConfigError` naming
the extra when it is missing), builds the tokenizer table once, and keeps the compiled grammars of the
last requests: a repeated schema costs a dictionary look-up and a matcher copy. A schema, regex or
grammar the library refuses is a :class:`GrammarError` carrying the library's reason (a 400 for the API).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import queue
import threading
from collections.abc import Sequence
from typing import Any

from devgraph import InputError
from devgraph.extras import require_extra
from devgraph.messages import shorten
from devgraph.serve.checkpoint.text import Tokenizer
from devgraph.serve.structured import work_limits
from devgraph.serve.structured.matcher import BitmaskMasker, CompiledGrammar
from devgraph.serve.structured.spec import KINDS_ALLOWED, GrammarKind, GrammarSpec
from devgraph.serve.structured.vocab import Vocabulary, vocabulary

__all__ = ["GrammarCompiler", "GrammarError", "GrammarRefused", "load_library"]


class GrammarError(InputError):
    """A request's schema, regex or grammar that cannot be compiled (the message says why)."""


class GrammarRefused(InputError):
    """A kind of constraint this server's operator did not allow."""


def load_library() -> Any:
    """llguidance, or :class:`~devgraph.errors.BackendUnavailableError` naming the extra to install."""
    return require_extra(
        "llguidance",
        extra="structured",
        needed_by="structured output (response_format, tools, structured_outputs)",
    )


class GrammarCompiler:
    """Compiles and caches grammars for one served tokenizer. ``allowed``: an ``--structured-outputs``
    value (``all``, ``json`` or ``none``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        end_ids: Sequence[int] = (),
        *,
        allowed: str = "all",
        mask_threads: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._end_ids = tuple(end_ids)
        self._families = KINDS_ALLOWED[allowed]
        self._allowed = allowed
        self._mask_threads = mask_threads
        self._lock = threading.Lock()  # the vocabulary and masker are built once; the cache is shared
        self._setup: tuple[Any, Vocabulary, BitmaskMasker] | None = None
        self._cache: collections.OrderedDict[GrammarSpec, CompiledGrammar] = collections.OrderedDict()
        self._pool = CompilePool(work_limits.COMPILE_THREADS)
        self._preparing: concurrent.futures.Future[Any] | None = None

    def check_allowed(self, spec: GrammarSpec) -> None:
        """:class:`GrammarRefused` when the operator did not allow ``spec``'s kind."""
        if spec.kind.family not in self._families:
            allowed = "none" if not self._families else "JSON schemas and tool calls only"
            raise GrammarRefused(
                f"this server takes no {spec.describe()} constraints (--structured-outputs {self._allowed}: "
                f"{allowed}); ask its operator, or leave the field out"
            )

    def prepare(self) -> concurrent.futures.Future[Any]:
        """Import llguidance and build the tokenizer table on the compile pool (about a second for a
        150k-token vocabulary), once; the server starts it at start-up, so no request waits for it."""
        with self._lock:
            if self._preparing is None:
                self._preparing = self._pool.submit(self._ready)
            return self._preparing

    async def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled on the compile pool (off the event loop) within ``work_limits.COMPILE_SECONDS``
        (the tokenizer table, built once, is not the request's time)."""
        self.check_allowed(spec)
        await asyncio.wrap_future(self.prepare())
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
        future = asyncio.wrap_future(self._pool.submit(self._compile, spec))
        try:
            return await asyncio.wait_for(asyncio.shield(future), work_limits.COMPILE_SECONDS)
        except asyncio.TimeoutError:
            raise GrammarError(
                f"the {spec.describe()} did not compile within {work_limits.COMPILE_SECONDS:g} s; simplify it"
            ) from None

    def compile_now(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled, waiting for it (the engine's own callers, tests and benchmarks)."""
        self.check_allowed(spec)
        return self._pool.submit(self._compile, spec).result()

    def close(self) -> None:
        self._pool.close()

    # -- on a compile thread ---------------------------------------------------------------------
    def _ready(self) -> tuple[Any, Vocabulary, BitmaskMasker]:
        with self._lock:
            if self._setup is None:
                library = load_library()
                vocab = vocabulary(library, self._tokenizer, self._vocab_size, self._end_ids)
                self._setup = (library, vocab, BitmaskMasker(library, vocab, self._mask_threads))
            return self._setup

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        library, vocab, masker = self._ready()
        grammar = _grammar_text(library, spec, vocab)
        matcher = library.LLMatcher(
            vocab.tokenizer, grammar, log_level=0, limits=work_limits.parser_limits(library)
        )
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask builds the lexer's start: paid here, not in a step
        if matcher.is_error():
            raise GrammarError(
                f"the {spec.describe()} was refused by llguidance: {shorten(matcher.get_error(), 400)}"
            )
        compiled = CompiledGrammar(spec, matcher, masker, vocab)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > work_limits.CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled


class CompilePool:
    """Compile threads with a deep stack: the grammar library recurses over a grammar's nesting while it
    compiles (a chain of some 3000 rules overflows an 8 MiB stack and would take the server down), so
    its threads get :data:`work_limits.COMPILE_STACK_BYTES` of stack (address space; only what is used is
    memory). Never the event loop's thread, nor the engine's."""

    def __init__(self, threads: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Any, tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._threads = []
        with _STACK_LOCK:  # threading.stack_size is process-wide: set only around these starts
            previous = threading.stack_size(work_limits.COMPILE_STACK_BYTES)
            try:
                for index in range(threads):
                    thread = threading.Thread(
                        target=self._work, name=f"devgraph-grammar-{index}", daemon=True
                    )
                    thread.start()
                    self._threads.append(thread)
            finally:
                threading.stack_size(previous)

    def submit(self, function: Any, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((future, function, args))
        return future

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, function, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args))
            except BaseException as exc:  # handed to the waiting request, which answers 400 or 500
                future.set_exception(exc)


_STACK_LOCK = threading.Lock()


def _grammar_text(library: Any, spec: GrammarSpec, vocab: Vocabulary) -> str:
    """The llguidance grammar of ``spec`` (:class:`GrammarError` for text the library cannot read)."""
    matcher = library.LLMatcher
    try:
        if spec.kind is GrammarKind.JSON_SCHEMA:
            schema = json.loads(spec.source)
            if spec.closed:
                schema = close_objects(schema)
            options = {**spec.whitespace.options(), "lenient": not spec.strict}
            return str(matcher.grammar_from_json_schema(schema, overrides=options))
        if spec.kind is GrammarKind.JSON_OBJECT:
            return str(
                matcher.grammar_from_json_schema({"type": "object"}, overrides=spec.whitespace.options())
            )
        if spec.kind is GrammarKind.REGEX:
            return str(matcher.grammar_from_regex(spec.source))
        if spec.kind is GrammarKind.CHOICE:
            return str(library.grammar_from("choice", spec.source))
        if spec.kind is GrammarKind.TOOL_CALLS:
            return str(matcher.grammar_from_lark(spec.source + _tag_rules(spec, vocab)))
        return str(library.grammar_from("grammar", spec.source))
    except ValueError as exc:
        raise GrammarError(
            f"the {spec.describe()} was refused by llguidance: {shorten(str(exc), 400)}"
        ) from None


def _tag_rules(spec: GrammarSpec, vocab: Vocabulary) -> str:
    """A Lark rule per tag: its text, or the tokenizer's own token for it where it has one."""
    rules = []
    for rule, text in spec.tags:
        ids = vocab.tokenizer.tokenize_str(text, parse_special=True)
        token = f" | <[{ids[0]}]>" if len(ids) == 1 and vocab.tokenizer.is_special_token(ids[0]) else ""
        rules.append(f"{rule}: {json.dumps(text)}{token}\n")
    return "".join(rules)


def close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say otherwise
    (vLLM's ``disable_additional_properties``); the depth was bounded when the request was read."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: close_objects(value) for key, value in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed
