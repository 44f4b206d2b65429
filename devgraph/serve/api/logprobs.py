"""Log probabilities as the OpenAI API defines them, for both routes.

* A token is named by its text when its own bytes are whole UTF-8, else ``bytes:`` and its bytes as
  ``\\xNN`` escapes (``bytes:\\xe2\\x80``, vLLM's name for a token that holds part of a character): two
  tokens that would both render as U+FFFD never share a name. Where two distinct tokens still decode to
  the same text, the later one in a top-logprobs dict is named ``token_id:N`` (vLLM's name for a token
  by id), so the completions dict always holds every alternative asked for.
* Chat's ``bytes`` are the token's own bytes (a client joins split characters from them).
* ``-inf`` (a token the model rules out) is sent as -9999.0, as OpenAI does: JSON has no infinity.
* Completions' ``top_logprobs`` holds the ``logprobs`` most likely tokens and the chosen one (up to
  ``logprobs + 1`` entries, as the API documents); chat's ``top_logprobs`` exactly ``top_logprobs``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from devgraph.serve.checkpoint.text import Tokenizer
from devgraph.serve.engine.request import TokenLogprob

__all__ = ["LOGPROB_FLOOR", "TokenNames", "finite", "merge_completion_logprobs"]

#: What a log probability of -inf is sent as.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class TokenNames:
    """Names, texts and bytes of tokens for one tokenizer (cached per token id)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._names: dict[int, str] = {}

    def name(self, token: int) -> str:
        name = self._names.get(token)
        if name is None:
            raw = self.tokenizer.token_bytes(token)
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                name = "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
            self._names[token] = name
        return name

    def top_dict(self, pairs: Sequence[tuple[int, float]]) -> dict[str, float]:
        """A completions ``top_logprobs`` entry: one key per distinct token, most likely first."""
        entry: dict[str, float] = {}
        seen: set[int] = set()
        for token, logprob in pairs:
            if token in seen:  # the chosen token, already among the most likely
                continue
            seen.add(token)
            key = self.name(token)
            if key in entry:
                key = f"token_id:{token}"
            entry[key] = finite(logprob)
        return entry

    def chat_entry(self, token: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.name(token),
            "logprob": finite(logprob),
            "bytes": list(self.tokenizer.token_bytes(token)),
        }

    def completion_logprobs(
        self, tokens: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int
    ) -> dict[str, Any]:
        """The completions ``logprobs`` object of ``tokens`` (``None`` entries: a prompt's first token,
        which has no log probability), their text starting at character ``offset`` of the choice."""
        names: list[str] = []
        offsets: list[int] = []
        scores: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for token, entry in zip(tokens, entries, strict=True):
            names.append(self.name(token))
            offsets.append(offset)
            offset += len(self.tokenizer.token_text(token))
            if entry is None:
                scores.append(None)
                tops.append(None)
                continue
            scores.append(finite(entry.logprob))
            tops.append(self.top_dict([*entry.top, (entry.token, entry.logprob)]))
        return {"tokens": names, "token_logprobs": scores, "top_logprobs": tops, "text_offset": offsets}


def merge_completion_logprobs(parts: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Completions ``logprobs`` objects of consecutive pieces of one choice, as one."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return {key: [v for p in present for v in p[key]] for key in present[0]}
