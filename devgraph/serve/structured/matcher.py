"""A compiled grammar, each request's place in it, and the step's token masks on the device.

:class:`CompiledGrammar` holds an llguidance matcher at the grammar's start; each request gets a copy
(``deep_copy`` is microseconds: the lexer and the grammar are shared). :class:`BitmaskMasker` computes the
masks of every constrained row of a step in one call to llguidance's thread pool (it releases the GIL;
a few rows are computed on the calling thread, where waking the pool would cost more),
into a host buffer of 32-token words, copies it to the device and sets the forbidden logits to ``-inf``.

The sampler calls it right after the forward was launched and before anything reads the logits, so on a
GPU the masks are computed while the graph runs. The host buffer is reused by the next step, which only
starts after this step's sampled tokens were copied back (the copy waits for the mask's upload too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from devgraph.serve.engine.grammar import GrammarFailed, GrammarState
from devgraph.serve.structured.spec import GrammarSpec
from devgraph.serve.structured.vocab import Vocabulary

__all__ = ["INLINE_ROWS", "BitmaskMasker", "CompiledGrammar", "MatcherState"]

_BITS = 32
#: Up to this many constrained rows the masks are computed on the calling thread, not on llguidance's pool:
#: 32 masks inside a JSON string over a 151k-token vocabulary took 0.06 ms on one thread (CPU, measured
#: while writing this), and a pool whose threads sleep between steps must wake them first (milliseconds
#: on a loaded host).
INLINE_ROWS = 16


class BitmaskMasker:
    """One per served tokenizer: the step's masks, computed on the host, applied on the device."""

    def __init__(self, library: Any, vocab: Vocabulary, threads: int | None = None) -> None:
        self._executor = library.LLExecutor(threads)
        self._words = (vocab.tokenizer.vocab_size + _BITS - 1) // _BITS
        self._host = torch.empty(0, self._words, dtype=torch.int32)
        self._bits: dict[torch.device, torch.Tensor] = {}

    def _buffer(self, rows: int) -> torch.Tensor:
        if self._host.shape[0] < rows:
            pin = torch.cuda.is_available()
            self._host = torch.empty(
                max(rows, 2 * self._host.shape[0]), self._words, dtype=torch.int32, pin_memory=pin
            )
        return self._host[:rows]

    def mask(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState]) -> torch.Tensor:
        count, vocab = logits.shape
        host = self._buffer(count)
        host.fill_(-1)  # every bit set: rows without a grammar keep every token
        row_bytes = self._words * 4
        if len(states) <= INLINE_ROWS:  # a pool's wake-up would cost more than these masks
            for row, state in zip(rows, states, strict=True):
                state.matcher.unsafe_compute_mask_ptr(host[row].data_ptr(), row_bytes)  # type: ignore[attr-defined]
        else:
            matchers = [(state.matcher, row) for row, state in zip(rows, states, strict=True)]  # type: ignore[attr-defined]
            self._executor.unsafe_compute_mask_ptr(matchers, host.data_ptr(), row_bytes, count)
        words = host.to(logits.device, non_blocking=True)
        bits = self._bits.get(logits.device)
        if bits is None:
            bits = self._bits[logits.device] = torch.tensor(
                [1 << i if i < 31 else -(1 << 31) for i in range(_BITS)],
                dtype=torch.int32,
                device=logits.device,
            )
        allowed = (words[:, :, None] & bits) != 0
        allowed = allowed.view(count, self._words * _BITS)[:, :vocab]
        return logits.masked_fill(~allowed, float("-inf"))


class MatcherState:
    """One request's llguidance matcher (implements the engine's ``GrammarState``)."""

    def __init__(self, matcher: Any, masker: BitmaskMasker) -> None:
        self.matcher = matcher
        self._masker = masker

    @property
    def masker(self) -> BitmaskMasker:
        return self._masker

    def advance(self, token: int) -> bool:
        if not self.matcher.consume_token(token):
            reason = self.matcher.get_error() or f"token {token} is not allowed here"
            raise GrammarFailed(f"the output could not follow its grammar: {reason}")
        return bool(self.matcher.is_stopped())


class CompiledGrammar:
    """A grammar ready for requests (implements the engine's ``Grammar``); ``end_ids``: the tokens that
    end its output, which the request must stop on."""

    def __init__(self, spec: GrammarSpec, prototype: Any, masker: BitmaskMasker, vocab: Vocabulary) -> None:
        self.spec = spec
        self._prototype = prototype
        self._masker = masker
        self.end_ids = vocab.end_ids

    def start(self) -> MatcherState:
        return MatcherState(self._prototype.deep_copy(), self._masker)
