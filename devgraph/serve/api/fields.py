"""The request fields both generation routes share, and the rule for every other field.

**The rule.** A field devgraph implements is read and checked; a field it does not implement is refused
with a 400 naming it, unless it holds the value that changes nothing (``presence_penalty: 0``,
``logit_bias: {}``, ``n: 1``, ...); a field nobody defined is refused too. Nothing is silently ignored,
so a client never believes a setting took effect when it did not. Fields that only label a request
(``user``, ``metadata``, ``store``) are accepted: they never change what is generated.

Shared fields: ``model``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``
(strings, or token ids as devgraph has always taken them), ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``stream``, ``stream_options`` (``include_usage``,
``continuous_usage_stats``), ``n`` (choices per prompt: copies sampled after one prefill, sharing its KV
blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from devgraph import InputError
from devgraph.messages import shorten
from devgraph.serve.api.protocol import ApiError
from devgraph.serve.engine.request import MAX_COPIES, MAX_STOP_TOKEN_IDS, SamplingParams
from devgraph.serve.structured.spec import GrammarSpec

__all__ = [
    "COMMON_FIELDS",
    "MAX_STOP_STRINGS",
    "Generation",
    "as_bool",
    "as_int",
    "check_fields",
    "choices",
    "include_usage",
    "sampling",
]

#: Stop strings per request (each one is searched in every piece of text).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256

COMMON_FIELDS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
        "ignore_eos", "include_stop_str_in_output", "stream", "stream_options", "n", "user", "metadata",
        "store",
    }
)  # fmt: skip


def _zero(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


def _one(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1)


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def _false(value: Any) -> bool:
    return value is None or value is False


#: Fields devgraph does not implement, accepted only at the value that changes nothing.
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "presence_penalty": (_zero, "0"),
    "frequency_penalty": (_zero, "0"),
    "repetition_penalty": (_one, "1"),
    "min_p": (_zero, "0"),
    "min_tokens": (_zero, "0"),
    "logit_bias": (_empty, "{}"),
    "suffix": (lambda v: v is None or v == "", "null"),
    "echo": (_false, "false"),
    "tools": (_empty, "[]"),
    "functions": (_empty, "[]"),
    "tool_choice": (lambda v: v in (None, "none"), '"none"'),
    "function_call": (lambda v: v in (None, "none"), '"none"'),
    "response_format": (lambda v: v is None or v == {"type": "text"}, '{"type": "text"}'),
    "reasoning_effort": (lambda v: v is None, "null"),
    "modalities": (lambda v: v is None or v == ["text"], '["text"]'),
    "audio": (lambda v: v is None, "null"),
    "prediction": (lambda v: v is None, "null"),
    "web_search_options": (lambda v: v is None, "null"),
    "skip_special_tokens": (lambda v: v is None or v is True, "true"),
    "parallel_tool_calls": (lambda v: True, "any (there are no tools)"),
    "service_tier": (lambda v: v in (None, "auto", "default"), '"auto"'),
}


def check_fields(body: Mapping[str, Any], implemented: Iterable[str], route: str) -> None:
    """:class:`ApiError` 400 for the first field of ``body`` that is neither implemented nor neutral."""
    known = set(implemented)
    for name, value in body.items():
        if name in known:
            continue
        if name in NEUTRAL:
            neutral, shown = NEUTRAL[name]
            if neutral(value):
                continue
            raise ApiError(
                400,
                f"{name} {shorten(value)} is not implemented by devgraph serve; leave it out or give {shown}",
                param=name,
            )
        raise ApiError(400, f"{route} does not take the field {shorten(name)}", param=name)


def as_int(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {shorten(value)}", param=name)
    return value


def as_number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a number, got {shorten(value)}", param=name)
    return float(value)


def as_bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {shorten(value)}", param=name)
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise ApiError(400, f"{name} must be a list of token ids (ints), got {shorten(value)}", param=name)


def _stops(body: Mapping[str, Any]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Stop token ids (``stop`` as ints, ``stop_token_ids``) and stop strings (``stop`` as strings)."""
    ids: list[int] = []
    strings: list[str] = []
    stop = body.get("stop")
    if isinstance(stop, str) or (isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop)):
        strings = [stop] if isinstance(stop, str) else list(stop)
        if len(strings) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_STRING_CHARS for s in strings):
            raise ApiError(
                400,
                f"stop takes at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_STRING_CHARS} characters",
                param="stop",
            )
    elif isinstance(stop, int) and not isinstance(stop, bool):
        ids.append(stop)
    elif stop is not None:
        ids += _token_ids(stop, "stop")
    extra = body.get("stop_token_ids")
    if extra is not None:
        ids += _token_ids(extra, "stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:  # each one is checked against every sampled token
        raise ApiError(
            400,
            f"at most {MAX_STOP_TOKEN_IDS} stop token ids (stop and stop_token_ids together) are "
            f"accepted, got {len(ids)}",
            param="stop_token_ids" if extra is not None else "stop",
        )
    return tuple(ids), tuple(strings)


@dataclass(frozen=True)
class Generation:
    """A checked generation request, whichever route it came from: one or more ``prompts``, each run as
    one engine request of ``params.n`` copies (``best_of`` for completions) of which ``n`` are returned
    as choices (the most likely ones when ``best_of > n``). ``client_logprobs``: whether the client asked
    for the log probabilities (``best_of`` computes them to rank the copies anyway)."""

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    stop_strings: tuple[str, ...]
    include_stop_str: bool
    model: str
    grammar: GrammarSpec | None = None  # structured output: compiled before the request is queued
    n: int = 1
    continuous_usage: bool = False
    client_logprobs: bool = True

    @property
    def prompt(self) -> list[int]:
        """The first prompt (the only one, for chat)."""
        return self.prompts[0]


def sampling(
    body: Mapping[str, Any],
    *,
    max_tokens: int,
    defaults: Mapping[str, Any],
    eos_token_ids: tuple[int, ...],
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    copies: int = 1,
) -> tuple[SamplingParams, tuple[str, ...], bool]:
    """The request's sampling parameters (the model's ``defaults`` where the request sets none; the
    model's EOS ids added to the stop ids unless ``ignore_eos``; ``copies`` sampled per prompt), its stop
    strings, and whether to keep a stop string in the output."""
    ids, strings = _stops(body)
    if not as_bool(body, "ignore_eos", False):
        ids = tuple(dict.fromkeys((*ids, *eos_token_ids)))
    top_k = as_int(body, "top_k", defaults.get("top_k", 0))
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=as_number(body, "temperature", defaults.get("temperature", 1.0)),
            top_p=as_number(body, "top_p", defaults.get("top_p", 1.0)),
            top_k=0 if top_k == -1 else top_k,  # type: ignore[arg-type]
            seed=as_int(body, "seed", None),
            stop_token_ids=ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            n=copies,
        )
    except InputError as exc:
        raise ApiError(400, str(exc), param=_field_named(str(exc))) from None
    return params, strings, as_bool(body, "include_stop_str_in_output", False)


def choices(body: Mapping[str, Any]) -> int:
    """``n``: the choices per prompt (1 to :data:`MAX_COPIES`)."""
    n = as_int(body, "n", 1)
    assert n is not None
    if not 1 <= n <= MAX_COPIES:
        raise ApiError(400, f"n must be an integer from 1 to {MAX_COPIES}", param="n")
    return n


def include_usage(body: Mapping[str, Any], stream: bool) -> tuple[bool, bool]:
    """``stream_options``: ``include_usage`` (a last chunk with the usage) and ``continuous_usage_stats``
    (the usage so far in every chunk, as vLLM sends it); only with ``stream``."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError(
            400, f"stream_options must be an object, got {shorten(options)}", param="stream_options"
        )
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise ApiError(400, f"stream_options does not take {unknown}", param="stream_options")
    try:
        return as_bool(options, "include_usage", False), as_bool(options, "continuous_usage_stats", False)
    except ApiError as exc:
        raise ApiError(400, f"stream_options.{exc.message}", param="stream_options") from None


def _field_named(message: str) -> str | None:
    """The request field a :class:`SamplingParams` error is about (its messages start with the name)."""
    first = message.split(" ", 1)[0]
    named = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "prompt_logprobs", "n")
    return first if first in named else None
