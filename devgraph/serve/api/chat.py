"""``POST /v1/chat/completions``: messages through the model's chat template, and the
``chat.completion`` responses.

Fields beyond the shared ones (``fields.py``): ``messages`` (required: objects with a ``role`` of
system, developer, user, assistant or tool and a ``content`` that is a string or a list of text parts),
``max_completion_tokens`` / ``max_tokens`` (default: the rest of the context), ``logprobs`` (true/false)
and ``top_logprobs`` (0 to 20, with ``logprobs``), and the template's own knobs as vLLM takes them:
``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}`` for Qwen3), ``add_generation_prompt``
(default true) and ``continue_final_message``; ``chat_template`` (a template of the request's own) only where
the server runs with ``--trust-request-chat-template``; ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (``tools.py``), assistant ``tool_calls`` and ``tool`` messages in history; the
structured-output fields (``structured.py``). Images and audio are refused.

A streamed answer opens with a chunk holding ``{"role": "assistant", "content": ""}``, then one chunk per
step with the new text; with ``stream_options.include_usage`` a last chunk has ``choices: []`` and the
usage (with ``continuous_usage_stats``, every chunk carries the usage so far). ``n`` choices are copies
sampled after one prefill. Choices and deltas also carry ``token_ids`` (devgraph's addition).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from devgraph.messages import shorten
from devgraph.serve.api.fields import (
    COMMON_FIELDS,
    Generation,
    as_bool,
    as_int,
    check_fields,
    choices,
    include_usage,
    sampling,
)
from devgraph.serve.api.generate import Choice
from devgraph.serve.api.logprobs import TokenNames
from devgraph.serve.api.protocol import ApiError, check_model
from devgraph.serve.api.structured import STRUCTURED_FIELDS, parse_structured
from devgraph.serve.api.tool_stream import ToolCallShape
from devgraph.serve.api.tools import MESSAGE_EXTRAS, TOOL_FIELDS, history_message, parse_tools
from devgraph.serve.checkpoint.text import Tokenizer
from devgraph.serve.engine.request import MAX_LOGPROBS, TokenLogprob

__all__ = ["ChatShape", "parse_chat"]

FIELDS = COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    *STRUCTURED_FIELDS,
    *TOOL_FIELDS,
}
ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name", "tool_call_id", *MESSAGE_EXTRAS}


def parse_chat(
    body: Any,
    tokenizer: Tokenizer,
    served: str,
    *,
    context: int,
    defaults: Mapping[str, Any],
    eos_token_ids: tuple[int, ...],
) -> tuple[Generation, ChatShape | ToolCallShape]:
    """The checked request, its prompt rendered by the chat template, and how to shape its responses;
    :class:`ApiError` naming the field (a template that refuses the messages: 400 with its reason)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_model(body.get("model"), served)
    check_fields(body, FIELDS, "POST /v1/chat/completions")
    messages = _messages(body.get("messages"))
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(
            400,
            f"chat_template_kwargs must be an object, got {shorten(kwargs)}",
            param="chat_template_kwargs",
        )
    if "chat_template" in body:  # the tokenizer refuses it unless the server trusts request templates
        kwargs = {**kwargs, "chat_template": body["chat_template"]}
    continue_final = as_bool(body, "continue_final_message", False)
    add_prompt = as_bool(body, "add_generation_prompt", not continue_final)
    if continue_final and add_prompt:
        raise ApiError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true",
            param="add_generation_prompt",
        )
    calling = parse_tools(body, _template_text(tokenizer))
    grammar = parse_structured(body)
    if calling is not None and calling.grammar is not None:
        if grammar is not None:
            raise ApiError(
                400, f"tool_choice constrains the answer; leave {grammar.origin} out", param=grammar.origin
            )
        grammar = calling.grammar
    prompt = tokenizer.chat_prompt(
        messages,
        add_generation_prompt=add_prompt,
        continue_final_message=continue_final,
        template_kwargs=kwargs,
        tools=None if calling is None else calling.tools,  # the template's own `tools` variable renders them
    )
    top = _top_logprobs(body)
    stream = as_bool(body, "stream", False)
    limit = as_int(body, "max_completion_tokens", None)
    limit = as_int(body, "max_tokens", None) if limit is None else limit
    if limit is not None and limit < 1:  # (completions take 0, for echo; a chat answer has no echo)
        raise ApiError(400, f"max_tokens must be an integer >= 1, got {limit}", param="max_tokens")
    max_tokens = limit if limit is not None else max(1, context - len(prompt))
    n = choices(body)
    params, stops, include_stop = sampling(
        body, max_tokens=max_tokens, defaults=defaults, eos_token_ids=eos_token_ids, logprobs=top, copies=n
    )
    usage, continuous = include_usage(body, stream)
    generation = Generation(
        [prompt],
        params,
        stream,
        usage,
        stops,
        include_stop,
        served,
        grammar=grammar,
        n=n,
        continuous_usage=continuous,
    )
    shape = ChatShape(tokenizer)
    return generation, (shape if calling is None else ToolCallShape(shape, calling))


def _template_text(tokenizer: Tokenizer) -> str | None:
    """The chat template's source (``None`` without one): it says whether and how tools are rendered."""
    template = getattr(getattr(tokenizer, "transformers_tokenizer", None), "chat_template", None)
    if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else None


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    checked = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object, got {shorten(message)}", param="messages")
        extra = sorted(set(message) - _MESSAGE_KEYS)
        if extra:
            raise ApiError(400, f"{where} has fields devgraph serve does not take: {extra}", param="messages")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(
                400, f"{where}.role must be one of {', '.join(ROLES)}, got {shorten(role)}", param="messages"
            )
        rendered = history_message(message, where)  # tool calls in history (None when it has none)
        if rendered is None:
            rendered = {k: v for k, v in message.items() if k not in MESSAGE_EXTRAS}
            rendered["content"] = _content(message.get("content"), where)
        checked.append(rendered)
    return checked


def _content(value: Any, where: str) -> str:
    """A message's text: a string, or text parts joined by newlines (other parts are refused)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    400,
                    f"{where}.content: only text parts are served (got {shorten(kind or part)}); "
                    "devgraph serve runs text-only models",
                    param="messages",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise ApiError(
        400,
        f"{where}.content must be a string or a list of text parts, got {shorten(value)}",
        param="messages",
    )


def _top_logprobs(body: Mapping[str, Any]) -> int | None:
    wanted = as_bool(body, "logprobs", False)
    top = as_int(body, "top_logprobs", None)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}", param="top_logprobs")
    if top and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


class ChatShape:
    """``chat.completion`` choices, whole and as ``chat.completion.chunk`` deltas (see
    :class:`~.generate.Shape`); log probabilities name tokens and give their own bytes as
    :mod:`~devgraph.serve.api.logprobs` says."""

    object = "chat.completion"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.names = TokenNames(tokenizer)

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        content = []
        for e in entries:
            item = self.names.chat_entry(e.token, e.logprob)
            item["top_logprobs"] = [self.names.chat_entry(i, lp) for i, lp in e.top]
            content.append(item)
        return {"content": content}

    def opening(self, choice: Choice) -> dict[str, Any] | None:
        delta = {"role": "assistant", "content": ""}
        return {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def piece(
        self, choice: Choice, text: str, ids: list[int], logprobs: Sequence[TokenLogprob] | None
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text, "token_ids": ids} if text or ids else {}
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": choice.finish,
        }

    def whole(self, choice: Choice, logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        return {
            "index": choice.index,
            "message": {"role": "assistant", "content": choice.text},
            "token_ids": choice.ids,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": choice.finish,
        }
