"""Tool calling on ``POST /v1/chat/completions``: the request's ``tools`` and ``tool_choice``, the
tool-call format of the served model's family, and reading tool calls back out of its text.

* ``tools`` (OpenAI function tools) are handed to the checkpoint's chat template as its ``tools``
  variable, so the model sees them the way it was trained to; a template that never reads ``tools`` is
  refused (the model would not know them).
* The format follows the template (:meth:`ToolFormat.of_template`): **Hermes** (``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, Qwen2.5 and Qwen3) or **Llama 3 JSON** (``{"name": ..., "parameters":
  {...}}``, Llama 3.1 and later).
* ``tool_choice``: ``auto`` (default with tools) lets the model answer or call, and its text is parsed;
  ``required`` and a named function (``{"type": "function", "function": {"name": ...}}``) constrain the
  output, with a grammar, to calls in the family's format whose arguments follow each function's
  ``parameters`` schema; ``none`` renders no tools and parses nothing. ``parallel_tool_calls: false`` lets
  a constrained answer hold one call (Llama 3 templates take one call per turn anyway).
* History: assistant messages with ``tool_calls`` (``function.arguments`` a JSON string, given to the
  template as the object it holds) and ``tool`` messages with ``tool_call_id``.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devgraph.messages import shorten
from devgraph.serve.api.protocol import ApiError
from devgraph.serve.structured.compiler import close_objects
from devgraph.serve.structured.spec import GrammarKind, GrammarSpec

__all__ = ["MESSAGE_EXTRAS", "TOOL_FIELDS", "ToolCalling", "ToolFormat", "history_message", "parse_tools"]

TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
#: Tools per request, and characters of their JSON together (they become a grammar and a prompt).
MAX_TOOLS = 128
MAX_TOOLS_CHARS = 64 * 1024
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: Tool calls in a constrained answer use the separators the templates render history with (``tojson``).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolFormat(enum.Enum):
    """How a model family writes a tool call (closed: each name parses and constrains its own way)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"

    @classmethod
    def of_template(cls, template: str) -> ToolFormat | None:
        """The format a chat template teaches, or ``None`` when it is neither."""
        if "<tool_call>" in template:
            return cls.HERMES
        if '"parameters"' in template and ("<|python_tag|>" in template or "ipython" in template):
            return cls.LLAMA3_JSON
        return None

    @property
    def arguments_key(self) -> str:
        return "arguments" if self is ToolFormat.HERMES else "parameters"

    @property
    def parallel(self) -> bool:
        """Whether one answer may hold several calls (Llama 3 templates refuse several in history)."""
        return self is ToolFormat.HERMES

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> GrammarSpec:
        """A grammar for answers that are nothing but calls to ``tools`` (one or more when ``parallel``)."""
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["name"]},
                    # A function takes the parameters it declares: no others unless its schema says so.
                    self.arguments_key: close_objects(
                        tool.get("parameters") or {"type": "object", "properties": {}}
                    ),
                },
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": _COMPACT}
        call = json.dumps(schema, sort_keys=False, ensure_ascii=False)
        tags: tuple[tuple[str, str], ...] = ()
        if self is ToolFormat.HERMES:
            body = f'call: tool_open "\\n" %json{call} "\\n" tool_close'
            start = 'start: call ("\\n" call)*' if parallel else "start: call"
            tags = (("tool_open", "<tool_call>"), ("tool_close", "</tool_call>"))
        else:
            body = f"call: %json{call}"
            start = 'start: call ("; " call)*' if parallel and self.parallel else "start: call"
        return GrammarSpec(GrammarKind.TOOL_CALLS, f"{start}\n{body}\n", tags=tags, origin="tool_choice")

    def split(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """The answer's content and its calls as (name, arguments JSON text); text that does not parse as
        a call stays content."""
        if self is ToolFormat.HERMES:
            calls, content, position = [], [], 0
            for match in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL):
                call = self._call(match.group(1))
                if call is None:
                    continue
                content.append(text[position : match.start()])
                position = match.end()
                calls.append(call)
            content.append(text[position:])
            # Text before the first call is content as written; after it, blank runs only separate calls.
            return content[0] + "".join(piece for piece in content[1:] if piece.strip()), calls
        stripped = text.strip()
        if not stripped.startswith("{"):
            return text, []
        parsed = (
            [self._call(piece) for piece in stripped.split("; ")]
            if "; " in stripped
            else [self._call(stripped)]
        )
        if any(call is None for call in parsed):
            return text, []
        return "", [call for call in parsed if call is not None]

    def _call(self, text: str) -> tuple[str, str] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(self.arguments_key, value.get("arguments", value.get("parameters", {})))
        return value["name"], json.dumps(arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools as the template gets them, how its answer is read, and its grammar (``None``
    for ``auto``: the model chooses)."""

    tools: list[dict[str, Any]]
    format: ToolFormat
    grammar: GrammarSpec | None
    #: The only function a named ``tool_choice`` allows.
    named: str | None = None


def parse_tools(body: Mapping[str, Any], template: str | None) -> ToolCalling | None:
    """The request's tool calling, or ``None`` (no tools, or ``tool_choice: none``); 400 naming the
    field. ``template``: the chat template's text (its tool-call format), ``None`` without one."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, f"tool_choice {shorten(choice)} needs tools", param="tool_choice")
        return None
    functions = _functions(tools)
    if choice == "none":
        return None
    named = _named(choice, functions)
    if template is None or "tools" not in template:
        raise ApiError(
            400,
            "this model's chat template does not render tools, so the model would not see them; serve it "
            "with a template that does (--chat-template), or leave tools out",
            param="tools",
        )
    form = ToolFormat.of_template(template)
    if form is None:
        raise ApiError(
            400,
            "devgraph serve reads tool calls in the Hermes format (<tool_call>, Qwen) and the Llama 3 JSON "
            "format; this model's chat template teaches neither",
            param="tools",
        )
    wanted = [f for f in functions if f["name"] == named] if named else functions
    grammar = None
    if choice == "required" or named:
        grammar = form.grammar(wanted, parallel is not False and named is None)
    return ToolCalling([{"type": "function", "function": f} for f in functions], form, grammar, named)


def _functions(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must be a list of at most {MAX_TOOLS} tools", param="tools")
    if len(json.dumps(tools)) > MAX_TOOLS_CHARS:
        raise ApiError(400, f"tools are longer than {MAX_TOOLS_CHARS} characters of JSON", param="tools")
    functions = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ApiError(400, f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ApiError(
                400,
                f"{where}.function.name must be 1 to 64 letters, digits, _ . or -, got {shorten(name)}",
                param="tools",
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ApiError(400, f"{where}.function.parameters must be a JSON schema object", param="tools")
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ApiError(400, f"{where}.function does not take {unknown}", param="tools")
        functions.append(dict(function))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools name a function twice", param="tools")
    return functions


def _named(choice: Any, functions: list[dict[str, Any]]) -> str | None:
    if choice in (None, "auto", "required"):
        return None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400,
            'tool_choice must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {shorten(choice)}',
            param="tool_choice",
        )
    if name not in {f["name"] for f in functions}:
        raise ApiError(
            400, f"tool_choice names {shorten(name)}, which is not among the tools", param="tool_choice"
        )
    return name


#: Keys of a message devgraph takes; the SDK sends the null ones back when a response is reused as history.
_NULL_KEYS = {"refusal", "audio", "function_call", "annotations", "reasoning_content"}
#: Message keys the chat route accepts beyond role, content, name and tool_call_id.
MESSAGE_EXTRAS = frozenset({*_NULL_KEYS, "tool_calls"})


def history_message(message: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """An assistant message with ``tool_calls`` as the template wants it (arguments as objects, no null
    keys), or ``None`` when it has none; 400 for a malformed call."""
    for key in _NULL_KEYS & set(message):
        if message[key] is not None:
            raise ApiError(400, f"{where}.{key} is not taken by devgraph serve", param="messages")
    calls = message.get("tool_calls")
    if not calls:
        return None
    if message.get("role") != "assistant" or not isinstance(calls, list):
        raise ApiError(400, f"{where}: tool_calls belong to assistant messages, as a list", param="messages")
    rendered = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, (str, dict)):
            raise ApiError(
                400,
                f"{where}.tool_calls[{index}] needs function.name and function.arguments",
                param="messages",
            )
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise ApiError(
                    400, f"{where}.tool_calls[{index}].function.arguments is not valid JSON", param="messages"
                ) from None
        rendered.append(
            {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    content = message.get("content")
    kept = {k: v for k, v in message.items() if k not in _NULL_KEYS and k not in ("tool_calls", "content")}
    return {**kept, "content": content if isinstance(content, str) else "", "tool_calls": rendered}


def call_id() -> str:
    """A new tool call's id (``call_`` and 24 hex digits, as OpenAI's)."""
    return f"call_{uuid.uuid4().hex[:24]}"
