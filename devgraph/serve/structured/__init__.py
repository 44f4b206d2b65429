"""Structured output: constraining what a request generates to a JSON schema, a regex, a list of choices
or a grammar, with llguidance (the ``structured`` extra), the masks applied to the logits after the graphs.

The engine sees only its seam (:mod:`devgraph.serve.engine.grammar`); this package implements it:
``spec`` (what a request asks for), ``limits`` (how much work it may cause), ``vocab`` (the tokenizer as
llguidance reads it), ``compiler`` (compiling, bounded and cached) and ``matcher`` (each request's state
and the step's masks). llguidance is imported on first use only.
"""

from devgraph.serve.structured.compiler import GrammarCompiler, GrammarError, GrammarRefused
from devgraph.serve.structured.matcher import BitmaskMasker, CompiledGrammar
from devgraph.serve.structured.spec import GrammarKind, GrammarSpec, Whitespace

__all__ = [
    "BitmaskMasker",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarKind",
    "GrammarRefused",
    "GrammarSpec",
    "Whitespace",
]
