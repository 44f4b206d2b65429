"""How much work one request's schema, regex or grammar may cause (request data is never code).

Three bounds, each checked before the next costs anything:

1. **Size of the request's text** (:data:`MAX_SOURCE_CHARS` per kind, :data:`MAX_SCHEMA_DEPTH`,
   :data:`MAX_CHOICES`): checked while the request is parsed, before any compile.
2. **The library's own fuel** (:func:`parser_limits`): llguidance counts the work of building the lexer
   and of each step's mask and stops a grammar that spends more, with a reason; the defaults here are
   below the library's so that one request cannot hold a compile thread for long.
3. **Wall time and concurrency** (:data:`COMPILE_SECONDS`, :data:`COMPILE_THREADS`): compiles run on a
   small pool of their own, off the event loop; a request whose compile takes longer is answered 400, and
   at most :data:`COMPILE_THREADS` compiles run at once, so a flood of schemas cannot starve the server.
   Compiled grammars are kept in a cache of :data:`CACHE_ENTRIES` (repeated schemas compile once).
"""

from __future__ import annotations

from typing import Any

from devgraph.serve.structured.spec import GrammarKind

__all__ = [
    "CACHE_ENTRIES",
    "COMPILE_SECONDS",
    "COMPILE_STACK_BYTES",
    "COMPILE_THREADS",
    "MAX_CHOICES",
    "MAX_CHOICE_CHARS",
    "MAX_SCHEMA_DEPTH",
    "MAX_SOURCE_CHARS",
    "parser_limits",
]

#: Characters of the request's text per kind (a JSON schema counts as its compact JSON).
MAX_SOURCE_CHARS: dict[GrammarKind, int] = {
    GrammarKind.JSON_SCHEMA: 64 * 1024,
    GrammarKind.JSON_OBJECT: 0,
    GrammarKind.REGEX: 4 * 1024,
    GrammarKind.CHOICE: 64 * 1024,
    GrammarKind.GRAMMAR: 32 * 1024,
    GrammarKind.TOOL_CALLS: 128 * 1024,  # written by devgraph from the tools (64 KiB of JSON at most)
}
#: Nesting of a JSON schema (objects and lists inside each other).
MAX_SCHEMA_DEPTH = 32
#: Strings of a choice, and characters of each.
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
#: Seconds a compile may take before the request is refused.
COMPILE_SECONDS = 5.0
#: Compiles at once (each on a thread of the compile pool).
COMPILE_THREADS = 2
#: Compiled grammars kept for reuse.
CACHE_ENTRIES = 128
#: Stack of each compile thread (the library recurses over a grammar's nesting while it compiles).
COMPILE_STACK_BYTES = 256 * 1024 * 1024

#: llguidance's fuel, below its own defaults (in brackets): ~50k lexer fuel per ms, ~20k items per ms.
_LIMITS = {
    "initial_lexer_fuel": 500_000,  # building the lexer (1_000_000): about 10 ms of work
    "step_lexer_fuel": 200_000,  # one step's mask (200_000)
    "step_max_items": 50_000,  # Earley items per step (50_000)
    "max_lexer_states": 50_000,  # lexer states: about 1-2 kB each, so <= 100 MB per grammar (250_000)
    "max_grammar_size": 200_000,  # symbols of the grammar (500_000)
    "verbose_errors": False,  # a message never echoes the grammar's internals back at length
}


def parser_limits(library: Any) -> Any:
    """``llguidance.LLParserLimits`` with the values above."""
    return library.LLParserLimits(**_LIMITS)
