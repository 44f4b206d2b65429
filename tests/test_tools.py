"""Tool calling's pieces without a server: the request's tools and tool_choice, the Hermes and Llama 3
JSON formats (their grammars and how answers are read), tool calls in history, and the streamed deltas
(which must add up to what a whole answer says)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from devgraph.serve.api.chat import ChatShape
from devgraph.serve.api.generate import Choice
from devgraph.serve.api.protocol import ApiError
from devgraph.serve.api.stops import StopMatcher
from devgraph.serve.api.tool_stream import ToolCallShape
from devgraph.serve.api.tools import ToolFormat, history_message, parse_tools
from devgraph.serve.checkpoint.byte_tokenizer import ByteTokenizer

TEMPLATES = Path(__file__).resolve().parent / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    return {name: (TEMPLATES / f"{name}.jinja").read_text() for name in ("qwen2.5", "llama3.1")}


def test_the_template_decides_the_format(templates: dict[str, str]) -> None:
    assert ToolFormat.of_template(templates["qwen2.5"]) is ToolFormat.HERMES
    assert ToolFormat.of_template(templates["llama3.1"]) is ToolFormat.LLAMA3_JSON
    assert ToolFormat.of_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_tool_choice_chooses_the_grammar(templates: dict[str, str]) -> None:
    body = {"tools": [WEATHER, TIME]}
    auto = parse_tools(body, templates["qwen2.5"])
    assert auto is not None and auto.grammar is None and auto.tools == [WEATHER, TIME]
    required = parse_tools({**body, "tool_choice": "required"}, templates["qwen2.5"])
    assert required is not None and required.grammar is not None
    assert '("\\n" call)*' in required.grammar.source and "get_time" in required.grammar.source
    single = parse_tools(
        {**body, "tool_choice": "required", "parallel_tool_calls": False}, templates["qwen2.5"]
    )
    assert single is not None and single.grammar is not None and "call)*" not in single.grammar.source
    named = parse_tools(
        {**body, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, templates["llama3.1"]
    )
    assert named is not None and named.grammar is not None and named.named == "get_time"
    assert "get_weather" not in named.grammar.source and '"parameters"' in named.grammar.source
    assert parse_tools({**body, "tool_choice": "none"}, templates["qwen2.5"]) is None
    assert parse_tools({}, None) is None


@pytest.mark.parametrize(
    ("body", "template", "message"),
    [
        ({"tools": [{"type": "function"}]}, "qwen2.5", "tools[0] must be"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "qwen2.5", "function.name must be"),
        ({"tools": [WEATHER, WEATHER]}, "qwen2.5", "name a function twice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "qwen2.5",
            "not among",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "qwen2.5", "tool_choice must be"),
        ({"tool_choice": "required"}, "qwen2.5", "needs tools"),
        ({"tools": [WEATHER]}, None, "does not render tools"),
        ({"tools": [WEATHER]}, "plain {{ tools }}", "teaches neither"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "qwen2.5", "parallel_tool_calls must be"),
    ],
)
def test_bad_tools_are_400s_that_say_why(
    templates: dict[str, str], body: dict[str, Any], template: str | None, message: str
) -> None:
    with pytest.raises(ApiError, match=re.escape(message)) as caught:
        parse_tools(body, templates.get(template, template) if template else None)
    assert caught.value.status == 400


def test_answers_split_into_content_and_calls() -> None:
    hermes = ToolFormat.HERMES
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert hermes.split(text) == ("Let me look.\n", [("get_weather", '{"city": "Oslo"}')])
    two = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
    )
    assert hermes.split(two) == ("", [("a", "{}"), ("b", '{"x": 1}')])
    assert hermes.split("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert hermes.split("no calls here") == ("no calls here", [])
    llama = ToolFormat.LLAMA3_JSON
    assert llama.split('{"name": "get_time", "parameters": {}}') == ("", [("get_time", "{}")])
    assert llama.split('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}') == (
        "",
        [("a", '{"x": 1}'), ("b", "{}")],
    )
    assert llama.split("Hello {there}") == ("Hello {there}", [])


def test_history_gives_the_template_arguments_as_objects() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        ],
    }
    rendered = history_message(message, "messages[1]")
    assert rendered == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
        ],
    }
    assert history_message({"role": "assistant", "content": "hi", "tool_calls": None}, "m") is None
    with pytest.raises(ApiError, match="not valid JSON"):
        history_message({**message, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}, "m")
    with pytest.raises(ApiError, match="refusal is not taken"):
        history_message({**message, "refusal": "no"}, "m")


def _choice(text: str = "", finish: str | None = None) -> Choice:
    return Choice(0, 0, ByteTokenizer().decoder(), StopMatcher(()), text=text, finish=finish)


def _stream(shape: ToolCallShape, pieces: list[str]) -> tuple[str, list[dict[str, Any]], str | None]:
    content, calls, finish = "", [], None
    choice = _choice()
    for index, piece in enumerate(pieces):
        choice.finish = "stop" if index == len(pieces) - 1 else None
        delta_choice = shape.piece(choice, piece, [], None)
        content += delta_choice["delta"].get("content") or ""
        calls += delta_choice["delta"].get("tool_calls", [])
        finish = delta_choice["finish_reason"]
    return content, calls, finish


@pytest.mark.parametrize("form", ["qwen2.5", "llama3.1"])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_deltas_add_up_to_the_whole_answer(templates: dict[str, str], form: str, size: int) -> None:
    if form == "qwen2.5":
        text = (
            "Sure.\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
        )
    else:
        text = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'
    calling = parse_tools({"tools": [WEATHER, TIME]}, templates[form])
    assert calling is not None
    whole = ToolCallShape(ChatShape(ByteTokenizer()), calling).whole(_choice(text, "stop"), None)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    content, calls, finish = _stream(ToolCallShape(ChatShape(ByteTokenizer()), calling), pieces)
    assert finish == whole["finish_reason"] == "tool_calls"
    assert content == (whole["message"]["content"] or "")
    assert [c["index"] for c in calls] == list(range(len(calls)))
    expected = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in whole["message"]["tool_calls"]
    ]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_plain_answers_stream_as_content(templates: dict[str, str]) -> None:
    calling = parse_tools({"tools": [WEATHER]}, templates["qwen2.5"])
    assert calling is not None
    text = "It is sunny in Oslo; <tool_ maybe not. Bye."
    content, calls, finish = _stream(ToolCallShape(ChatShape(ByteTokenizer()), calling), list(text))
    assert (content, calls, finish) == (text, [], "stop")
