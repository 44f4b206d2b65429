"""The engine's seam for constrained decoding: what a request's grammar must offer, not how it works.

A request whose :class:`~devgraph.serve.engine.request.SamplingParams` carry a :class:`Grammar` gets its
own :class:`GrammarState` (``Grammar.start()``) when it enters the engine. Each step, after the graph
returned the logits, the sampler hands the rows of constrained requests to their grammar's
:class:`LogitsMasker`, which sets every token the grammar forbids to ``-inf``; the graphs never see a
grammar, so they keep replaying. After sampling, the engine feeds the token to the state
(:meth:`GrammarState.advance`): when nothing but the end may follow, the request finishes with
``finish_reason: "stop"``.

The implementation (llguidance) lives in :mod:`devgraph.serve.structured`; the engine imports nothing of
it, so an engine without constrained requests never loads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from devgraph import InputError

__all__ = ["Grammar", "GrammarFailed", "GrammarState", "LogitsMasker"]


class GrammarFailed(InputError):
    """A request's grammar could not go on (it grew past its limits at run time): the request ends with
    ``finish_reason: "error"`` and this message; the other requests of its step are not touched."""


class GrammarState(Protocol):
    """One request's position in its grammar."""

    @property
    def masker(self) -> LogitsMasker:
        """The masker that computes this state's allowed tokens (one per tokenizer, shared)."""
        ...

    def advance(self, token: int) -> bool:
        """Take the sampled ``token``; ``True`` when the output is complete (only the end may follow).
        :class:`GrammarFailed` when the grammar cannot take it."""
        ...


class Grammar(Protocol):
    """A compiled grammar: immutable, shared by every request that uses it."""

    def start(self) -> GrammarState:
        """A fresh state at the grammar's beginning, for one request."""
        ...


class LogitsMasker(Protocol):
    """Masks logits rows to what each row's grammar allows next."""

    def mask(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState]) -> torch.Tensor:
        """``logits [R, V]`` with every token that ``states[i]`` forbids set to ``-inf`` in row
        ``rows[i]`` (other rows as they were); may return a new tensor rather than write in place."""
        ...
