"""The request fields that constrain the output, read into one
:class:`~devgraph.serve.structured.spec.GrammarSpec`; and attaching its compiled grammar to a request.

Taken on both routes:

* ``response_format`` (OpenAI): ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``: the
  output follows ``schema``. With ``strict: true`` a schema keyword the grammar library does not implement
  is refused (400); without it such keywords are ignored, as a model without constraints would.
* ``structured_outputs`` (vLLM since 0.10, its only form since 0.12): exactly one of ``json`` (a schema,
  as an object or a JSON string), ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark or GBNF),
  ``json_object: true``; options ``disable_any_whitespace``, ``disable_additional_properties``,
  ``whitespace_pattern``, ``disable_fallback`` (devgraph has one backend, so it never falls back).
  ``structural_tag`` is refused.
* ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, ``guided_whitespace_pattern``,
  ``guided_decoding_backend`` (vLLM before 0.12; older clients still send them): the same constraints.

At most one constraint per request. Sizes are checked here (``structured/work_limits.py``); compiling, and
what the grammar library says about the text, happen in :func:`attach_grammar`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from devgraph import BackendUnavailableError, ConfigError
from devgraph.messages import shorten
from devgraph.serve.api.fields import Generation
from devgraph.serve.api.protocol import ApiError
from devgraph.serve.structured import work_limits
from devgraph.serve.structured.compiler import GrammarCompiler, GrammarError, GrammarRefused
from devgraph.serve.structured.spec import GrammarKind, GrammarSpec, Whitespace

__all__ = ["STRUCTURED_FIELDS", "attach_grammar", "check_spec", "parse_structured"]

_GUIDED = {
    "guided_json": GrammarKind.JSON_SCHEMA,
    "guided_regex": GrammarKind.REGEX,
    "guided_choice": GrammarKind.CHOICE,
    "guided_grammar": GrammarKind.GRAMMAR,
}
_OUTPUTS_KINDS = {
    "json": GrammarKind.JSON_SCHEMA,
    "regex": GrammarKind.REGEX,
    "choice": GrammarKind.CHOICE,
    "grammar": GrammarKind.GRAMMAR,
    "json_object": GrammarKind.JSON_OBJECT,
}
_OUTPUTS_OPTIONS = {
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
    "disable_fallback",
}
#: The one backend devgraph has, under the names vLLM's clients give it.
_BACKENDS = {"auto", "guidance", "llguidance"}

STRUCTURED_FIELDS = frozenset(
    {
        "response_format",
        "structured_outputs",
        "guided_whitespace_pattern",
        "guided_decoding_backend",
        *_GUIDED,
    }
)


def parse_structured(body: Mapping[str, Any]) -> GrammarSpec | None:
    """The request's constraint, or ``None``; :class:`ApiError` 400 naming the field that is wrong."""
    found: list[tuple[str, GrammarSpec]] = []
    spec = _response_format(body.get("response_format"))
    if spec is not None:
        found.append(("response_format", spec))
    spec = _structured_outputs(body.get("structured_outputs"))
    if spec is not None:
        found.append(("structured_outputs", spec))
    pattern = body.get("guided_whitespace_pattern")
    whitespace = (
        Whitespace(pattern=_text(pattern, "guided_whitespace_pattern", 1024)) if pattern else Whitespace()
    )
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _spec(kind, body[name], name, whitespace=whitespace, strict=True)))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in _BACKENDS:
        raise ApiError(
            400,
            f"guided_decoding_backend {shorten(backend)} is not served: devgraph constrains output with "
            "llguidance ('guidance'); leave the field out",
            param="guided_decoding_backend",
        )
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ApiError(400, f"give one output constraint per request, got {names}", param=found[1][0])
    return dataclasses.replace(found[0][1], origin=found[0][0]) if found else None


def _response_format(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT, "")
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            raise ApiError(
                400,
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                param="response_format",
            )
        strict = schema.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ApiError(
                400, "response_format.json_schema.strict must be true or false", param="response_format"
            )
        return _spec(GrammarKind.JSON_SCHEMA, schema["schema"], "response_format", strict=bool(strict))
    raise ApiError(
        400,
        f"response_format type {shorten(kind if kind is not None else value)} is not served; give "
        "'text', 'json_object' or 'json_schema'",
        param="response_format",
    )


def _structured_outputs(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    name = "structured_outputs"
    if not isinstance(value, dict):
        raise ApiError(400, f"{name} must be an object, got {shorten(value)}", param=name)
    if value.get("structural_tag") is not None:
        raise ApiError(400, f"{name}.structural_tag is not implemented by devgraph serve", param=name)
    unknown = sorted(set(value) - set(_OUTPUTS_KINDS) - _OUTPUTS_OPTIONS - {"structural_tag"})
    if unknown:
        raise ApiError(400, f"{name} does not take {unknown}", param=name)
    for option in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if value.get(option) is not None and not isinstance(value[option], bool):
            raise ApiError(400, f"{name}.{option} must be true or false", param=name)
    kinds = [key for key in _OUTPUTS_KINDS if value.get(key) not in (None, False)]
    if len(kinds) != 1:
        raise ApiError(
            400, f"{name} takes exactly one of {', '.join(_OUTPUTS_KINDS)}, got {kinds or 'none'}", param=name
        )
    pattern = value.get("whitespace_pattern")
    whitespace = Whitespace(
        compact=bool(value.get("disable_any_whitespace")),
        pattern=_text(pattern, f"{name}.whitespace_pattern", 1024, param=name) if pattern else None,
    )
    kind = _OUTPUTS_KINDS[kinds[0]]
    if kind is GrammarKind.JSON_OBJECT:
        if value["json_object"] is not True:
            raise ApiError(400, f"{name}.json_object must be true", param=name)
        return GrammarSpec(kind, "", whitespace=whitespace)
    closed = bool(value.get("disable_additional_properties"))
    return _spec(kind, value[kinds[0]], name, whitespace=whitespace, strict=True, closed=closed)


def _spec(kind: GrammarKind, value: Any, param: str, **options: Any) -> GrammarSpec:
    """A checked spec of ``kind`` from the request's ``value`` (400 naming ``param``)."""
    limit = work_limits.MAX_SOURCE_CHARS[kind]
    if kind is GrammarKind.JSON_SCHEMA:
        schema = value
        if isinstance(value, str):
            _text(value, param, limit)
            try:
                schema = json.loads(value)
            except (ValueError, RecursionError):
                raise ApiError(400, f"{param}: the schema is not valid JSON", param=param) from None
        if not isinstance(schema, dict):
            raise ApiError(
                400, f"{param}: a JSON schema must be an object, got {shorten(schema)}", param=param
            )
        if _depth(schema) > work_limits.MAX_SCHEMA_DEPTH:
            raise ApiError(
                400,
                f"{param}: the schema nests deeper than {work_limits.MAX_SCHEMA_DEPTH} levels",
                param=param,
            )
        spec = GrammarSpec.json_schema(schema, **options)
        if len(spec.source) > limit:
            raise ApiError(400, f"{param}: the schema is longer than {limit} characters", param=param)
        return spec
    if kind is GrammarKind.CHOICE:
        if (
            not isinstance(value, list)
            or not value
            or len(value) > work_limits.MAX_CHOICES
            or not all(isinstance(c, str) and 0 < len(c) <= work_limits.MAX_CHOICE_CHARS for c in value)
        ):
            raise ApiError(
                400,
                f"{param}: choices must be a list of 1 to {work_limits.MAX_CHOICES} non-empty strings of at "
                f"most {work_limits.MAX_CHOICE_CHARS} characters",
                param=param,
            )
        return GrammarSpec.choice(value)
    return GrammarSpec(
        kind, _text(value, param, limit), **{k: v for k, v in options.items() if k == "whitespace"}
    )


def _text(value: Any, name: str, limit: int, *, param: str | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{name} must be a non-empty string, got {shorten(value)}", param=param or name)
    if len(value) > limit:
        raise ApiError(400, f"{name} is longer than {limit} characters", param=param or name)
    return value


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion (a hostile schema cannot exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > work_limits.MAX_SCHEMA_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_spec(compiler: GrammarCompiler, spec: GrammarSpec) -> None:
    """:class:`ApiError` 400 when the operator did not allow ``spec``'s kind."""
    try:
        compiler.check_allowed(spec)
    except GrammarRefused as exc:
        raise ApiError(400, str(exc), param=spec.origin) from None


async def attach_grammar(compiler: GrammarCompiler, generation: Generation) -> Generation:
    """``generation`` with its spec compiled into its sampling parameters, the grammar's end tokens among
    its stop ids (a complete output ends there even with ``ignore_eos``); 400 with the library's reason."""
    spec = generation.grammar
    if spec is None:
        return generation
    check_spec(compiler, spec)
    try:
        grammar = await compiler.compile(spec)
    except GrammarError as exc:
        raise ApiError(400, str(exc), param=spec.origin) from None
    except (BackendUnavailableError, ConfigError) as exc:  # llguidance missing; a tokenizer it cannot read
        raise ApiError(501, str(exc), param=spec.origin, kind="not_implemented") from None
    stops = tuple(dict.fromkeys((*generation.params.stop_token_ids, *grammar.end_ids)))
    params = dataclasses.replace(generation.params, grammar=grammar, stop_token_ids=stops)
    return dataclasses.replace(generation, params=params)
