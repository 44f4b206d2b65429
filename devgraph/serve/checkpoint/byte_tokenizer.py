"""A byte-level tokenizer, so ``curl`` can send text to a random-weight preset that has no vocabulary.

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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from devgraph.serve.checkpoint.text import ChatTemplateError, check_unicode

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
    """Text to token ids and back, one token per UTF-8 byte (see the module docstring). No chat template
    and no end-of-sequence token: a preset's model is random."""

    eos_token_ids: tuple[int, ...] = ()

    @property
    def has_chat_template(self) -> bool:
        return False

    def start(self) -> None:  # nothing renders chats here
        pass

    def close(self) -> None:
        pass

    def encode(self, text: str) -> list[int]:
        return list(check_unicode(text, "the prompt").encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        decoder = StreamDecoder()
        return decoder.feed(ids) + decoder.flush()

    def decoder(self, prompt: Sequence[int] = ()) -> StreamDecoder:
        return StreamDecoder()

    def token_text(self, token: int) -> str:
        return (
            bytes((token,)).decode("utf-8", errors="replace") if 0 <= token < BYTE_TOKENS else f"<|{token}|>"
        )

    def token_bytes(self, token: int) -> bytes:
        return bytes((token,)) if 0 <= token < BYTE_TOKENS else self.token_text(token).encode("utf-8")

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: Mapping[str, Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        raise ChatTemplateError(
            "this server runs a random-weight preset, which has no chat template: use /v1/completions, "
            "or serve a checkpoint with a chat template (devgraph serve --model DIR)"
        )
