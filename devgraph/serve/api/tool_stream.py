"""Chat answers with tool calls: the text split into ``content`` and ``tool_calls``, whole or streamed.

:class:`ToolCallShape` wraps the route's chat shape. A whole answer is split once at the end
(:meth:`~devgraph.serve.api.tools.ToolFormat.split`). A streamed one is split as it grows: plain text is
released as ``content`` deltas (minus a tail that may be the start of a ``<tool_call>`` tag), and each call
is sent as one ``tool_calls`` delta when it is complete (``index``, ``id``, ``type``, ``function.name``
and the whole ``function.arguments``), which is how the OpenAI SDK's stream accumulators take it. With
calls, ``finish_reason`` is ``tool_calls`` and the message's ``content`` is null when nothing else was said.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from devgraph.serve.api.generate import Choice
from devgraph.serve.api.tools import ToolCalling, ToolFormat, call_id
from devgraph.serve.engine.request import TokenLogprob

__all__ = ["ToolCallShape"]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _calls(
    calls: Sequence[tuple[str, str]], first_index: int = 0, *, delta: bool = False
) -> list[dict[str, Any]]:
    return [
        {
            **({"index": first_index + i} if delta else {}),
            "id": call_id(),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        for i, (name, arguments) in enumerate(calls)
    ]


class _Calls:
    """One choice's stream, split as it grows (a choice of ``n`` has its own)."""

    def __init__(self, format: ToolFormat) -> None:
        self._format = format
        self._text = ""  # everything generated so far
        self._read = 0  # self._text[:_read] has been released as content or calls
        self.sent = 0  # calls sent so far
        self._mode: str | None = None  # Llama 3 JSON: "calls" or "content", set by the first character

    def feed(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        """Content that can be released now, and calls that are complete."""
        self._text += text
        if self._format is ToolFormat.LLAMA3_JSON:
            return self._advance_json(final)
        content: list[str] = []
        calls: list[tuple[str, str]] = []
        while True:
            rest = self._text[self._read :]
            start = rest.find(_OPEN)
            segment = (
                rest[:start]
                if start >= 0
                else rest[: len(rest) - (0 if final else _partial_tail(rest, _OPEN))]
            )
            if (self.sent or calls) and not segment.strip():  # after a call, blank runs only separate calls
                if start < 0 and not final:
                    break  # held: text may still follow them
            else:
                content.append(segment)
            self._read += len(segment)
            if start < 0:
                break
            end = rest.find(_CLOSE, start)
            if end < 0 and not final:
                break
            stop = len(rest) if end < 0 else end + len(_CLOSE)
            unparsed, found = self._format.split(rest[start:stop])
            if found:
                calls += found
            else:
                content.append(unparsed)
            self._read += stop - start
        return "".join(content), calls

    def _advance_json(self, final: bool) -> tuple[str, list[tuple[str, str]]]:
        if self._mode is None:
            stripped = self._text.lstrip()
            if not stripped:
                return "", []
            self._mode = "calls" if stripped.startswith("{") else "content"
        if self._mode == "content":
            released, self._read = self._text[self._read :], len(self._text)
            return released, []
        if not final:
            return "", []
        content, calls = self._format.split(self._text)
        self._read = len(self._text)
        return content, calls


class ToolCallShape:
    """A chat shape whose answers may hold tool calls (see the module docstring); each choice of an
    ``n > 1`` request is split on its own."""

    object = "chat.completion"

    def __init__(self, inner: Any, calling: ToolCalling) -> None:
        self._inner = inner
        self._format = calling.format
        self._streams: dict[int, _Calls] = {}  # choice index -> its stream so far

    def opening(self, choice: Choice) -> dict[str, Any] | None:
        return self._inner.opening(choice)  # type: ignore[no-any-return]

    def whole(self, choice: Choice, logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        content, calls = self._format.split(choice.text)
        body: dict[str, Any] = self._inner.whole(choice, logprobs)
        if calls:
            body["message"]["content"] = content or None
            body["message"]["tool_calls"] = _calls(calls)
            if choice.finish == "stop":
                body["finish_reason"] = "tool_calls"
        return body

    def piece(
        self, choice: Choice, text: str, ids: list[int], logprobs: Sequence[TokenLogprob] | None
    ) -> dict[str, Any]:
        stream = self._streams.setdefault(choice.index, _Calls(self._format))
        content, calls = stream.feed(text, final=choice.finish is not None)
        body: dict[str, Any] = self._inner.piece(choice, content, ids, logprobs)
        delta = body["delta"]
        if not content:
            delta.pop("content", None)
        if calls:
            delta["tool_calls"] = _calls(calls, stream.sent, delta=True)
            stream.sent += len(calls)
        if choice.finish == "stop" and stream.sent:
            body["finish_reason"] = "tool_calls"
        return body


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back: it may be a tag arriving)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
