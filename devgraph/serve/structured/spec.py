"""What a request asks its output to follow, as plain data: a :class:`GrammarSpec`.

The kinds are a closed set (:class:`GrammarKind`), each with its own limit on the request's text and its
own translation into an llguidance grammar. A spec is hashable: equal specs share one compiled grammar
(see :mod:`~devgraph.serve.structured.compiler`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS_ALLOWED", "GrammarKind", "GrammarSpec", "Whitespace"]


class GrammarKind(enum.Enum):
    """The forms a request's constraint can take. ``family`` groups them for the operator's
    ``--structured-outputs`` setting: ``json`` (schemas and tool calls) or ``text`` (regexes, choices and
    grammars, which constrain free text)."""

    JSON_SCHEMA = "json_schema"  # response_format json_schema, structured_outputs.json, tool calls
    JSON_OBJECT = "json_object"  # response_format json_object, structured_outputs.json_object: any object
    REGEX = "regex"
    CHOICE = "choice"  # one of a list of strings
    GRAMMAR = "grammar"  # a Lark or GBNF grammar
    TOOL_CALLS = "tool_calls"  # tool_choice required or named: devgraph's own Lark grammar of the calls

    @property
    def family(self) -> str:
        json_kinds = (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT, GrammarKind.TOOL_CALLS)
        return "json" if self in json_kinds else "text"


#: ``--structured-outputs`` values and the families each lets through.
KINDS_ALLOWED: dict[str, frozenset[str]] = {
    "all": frozenset({"json", "text"}),
    "json": frozenset({"json"}),
    "none": frozenset(),
}


@dataclass(frozen=True)
class Whitespace:
    """Whitespace between JSON tokens: ``pattern`` (a regex) when given; otherwise none at all when
    ``compact``, else runs of at most ``max_run`` spaces, tabs and newlines (room for indented JSON, but
    never an endless run: a model that keeps choosing whitespace still reaches the next token)."""

    compact: bool = False
    pattern: str | None = None
    max_run: int = 20

    def options(self) -> dict[str, Any]:
        """The llguidance JSON compile options this stands for."""
        if self.pattern is not None:
            return {"whitespace_flexible": True, "whitespace_pattern": self.pattern}
        if self.compact:
            return {"whitespace_flexible": False}
        return {
            "whitespace_flexible": True,
            "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{self.max_run}}}",
        }


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint. ``source``: the schema as JSON text (equal text, one compiled grammar),
    the regex, the choices as a JSON list, or the grammar's text. ``strict``
    (JSON schemas): keywords llguidance does not implement are refused (400) instead of ignored.
    ``closed``: objects take no properties beyond those named (vLLM's ``disable_additional_properties``).
    ``origin``: the request field it came from, for messages (not part of its identity)."""

    kind: GrammarKind
    source: str
    strict: bool = False
    closed: bool = False
    whitespace: Whitespace = Whitespace()
    #: Lark grammars: rules matching a tag's text, or the single token a tokenizer has for it (llguidance
    #: matches a tokenizer's added tokens, such as Qwen2.5's ``<tool_call>``, only by id).
    tags: tuple[tuple[str, str], ...] = ()
    origin: str = field(default="response_format", compare=False)

    @classmethod
    def json_schema(cls, schema: Any, **options: Any) -> GrammarSpec:
        # Keys keep their order: llguidance writes properties in the order the schema lists them.
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False), **options)

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls(GrammarKind.CHOICE, json.dumps(choices, ensure_ascii=False))

    def describe(self) -> str:
        """A short name for messages: ``json_schema``, ``regex``, ..."""
        return self.kind.value
