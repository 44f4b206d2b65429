"""The served tokenizer as llguidance sees it: every token's bytes, and the tokens that end an output.

* A checkpoint's tokenizer (transformers, byte-level BPE or SentencePiece with byte fallback) goes through
  ``llguidance.hf.from_tokenizer``, which reads the Rust tokenizer's own table (added and special tokens
  included). Its end tokens are the ones the server stops on (the generation config's EOS ids and the
  tokenizer's), so a grammar that is complete lets the model end the way it was trained to.
* The byte tokenizer of the random-weight presets (one token per UTF-8 byte, ids 256 and up without text)
  is described token by token: ids 0-255 are their byte, the rest are special tokens, and id 256 is the
  end a grammar allows when it is complete (the engine stops on it; it is never part of the output).

The vocabulary is the model's (``vocab_size``, often padded past the tokenizer's): ids the tokenizer
cannot produce are special tokens, which no grammar allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from devgraph import ConfigError
from devgraph.serve.checkpoint.text import Tokenizer

__all__ = ["BYTE_END_TOKEN", "Vocabulary", "vocabulary"]

#: The byte tokenizer's end token for grammars (the first id without text).
BYTE_END_TOKEN = 256


@dataclass(frozen=True)
class Vocabulary:
    """``tokenizer``: the ``llguidance.LLTokenizer``; ``end_ids``: the tokens that end a complete output;
    ``size``: the model's vocabulary (the width of its logits)."""

    tokenizer: Any
    end_ids: tuple[int, ...]
    size: int


class _ByteTable:
    """The byte tokenizer in the shape ``llguidance.TokenizerWrapper`` reads."""

    def __init__(self, size: int) -> None:
        self.eos_token_id = BYTE_END_TOKEN
        self.bos_token_id = None
        self.tokens = [bytes((i,)) for i in range(256)] + [f"<|{i}|>".encode() for i in range(256, size)]
        self.special_token_ids = list(range(256, size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def vocabulary(library: Any, tokenizer: Tokenizer, size: int, end_ids: Sequence[int]) -> Vocabulary:
    """The served tokenizer for llguidance (takes about a second for a 150k-token vocabulary: build it
    once, off the event loop). ``end_ids``: the ids the server stops on."""
    backend = getattr(tokenizer, "transformers_tokenizer", None)
    if backend is not None:
        import llguidance.hf

        ends = tuple(dict.fromkeys(end_ids)) or tuple(tokenizer.eos_token_ids)
        if not ends:
            raise ConfigError(
                "structured output needs an end-of-sequence token, and this tokenizer and generation "
                "config name none"
            )
        try:
            table = llguidance.hf.from_tokenizer(
                backend, n_vocab=max(size, len(backend)), eos_token=list(ends)
            )
        except ValueError as exc:  # a slow (Python-only) tokenizer
            raise ConfigError(f"structured output cannot read this tokenizer: {exc}") from None
        return Vocabulary(table, ends, size)
    if size <= BYTE_END_TOKEN:
        raise ConfigError(
            f"structured output with the byte tokenizer needs a vocabulary of more than {BYTE_END_TOKEN} "
            f"tokens (id {BYTE_END_TOKEN} ends a constrained output); this model has {size}"
        )
    table = library.LLTokenizer(library.TokenizerWrapper(_ByteTable(size)))
    return Vocabulary(table, (BYTE_END_TOKEN,), size)
