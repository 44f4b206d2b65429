"""A byte-level tokenizer, so ``curl`` can send text to a random-weight model that has no vocabulary.

The rule, both ways:

* **encode**: the UTF-8 bytes of the text, one token per byte: ``"hé"`` -> ``[104, 195, 169]``.
* **decode**: ids 0-255 are bytes, decoded as UTF-8 (invalid sequences become U+FFFD); an id of 256 or
  more has no text and is written as ``<|id|>``, e.g. ``<|4711|>``.

The reference model's weights are random, so generated text is noise; the tokenizer only makes the
round trip well defined. Streaming uses :class:`StreamDecoder`, which holds back the bytes of a UTF-8
character split across tokens until the character is complete.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

__all__ = ["ByteTokenizer", "StreamDecoder"]

BYTE_TOKENS = 256


class StreamDecoder:
    """Decodes one request's tokens piece by piece; the pieces concatenate to ``decode(all ids)``."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        parts: list[str] = []
        for token in ids:
            if 0 <= token < BYTE_TOKENS:
                parts.append(self._utf8.decode(bytes((token,))))
            else:
                parts.append(self._utf8.decode(b"", final=True))
                self._utf8.reset()
                parts.append(f"<|{token}|>")
        return "".join(parts)

    def flush(self) -> str:
        """Whatever is held back (an unfinished character becomes U+FFFD)."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


class ByteTokenizer:
    """Text to token ids and back, one token per UTF-8 byte (see the module docstring)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        decoder = StreamDecoder()
        return decoder.feed(ids) + decoder.flush()
