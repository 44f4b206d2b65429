"""A checkpoint's own tokenizer and chat template, through transformers' ``AutoTokenizer``.

transformers is optional in the serving path (the ``serve`` extra does not pull it in): serving a
checkpoint without it stops at start-up with one line naming the extra to install.

* Completion prompts are encoded with the tokenizer's special tokens (BOS where the tokenizer adds it),
  chat prompts are rendered by the chat template and encoded without them (the template writes its own),
  as transformers' ``apply_chat_template(tokenize=True)`` does.
* Output text skips special tokens and is decoded incrementally: each new token's text is the difference
  between decoding a short window with it and without it, the window starting in the prompt's tail, so a
  SentencePiece word's leading space appears where it belongs and a character split across tokens waits
  until it is whole. Streaming and non-streaming responses use the same decoder, so their texts are equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from devgraph.errors import ConfigError
from devgraph.extras import require_extra
from devgraph.messages import shorten
from devgraph.serve.checkpoint.text import ChatTemplateError

__all__ = ["HFTokenizer", "WindowDecoder"]

#: Prompt tokens the decoder starts from: enough context for any tokenizer's leading-space rule.
PROMPT_TAIL = 6
_REPLACEMENT = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's scheme): printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters from U+0100 on, in byte order. Returned inverted:
    character -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(0x100 + shifted)
            shifted += 1
    return {char: byte for byte, char in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


class WindowDecoder:
    """Incremental detokenization over a sliding window of ids (see the module docstring)."""

    def __init__(self, tokenizer: Any, prompt: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt[-PROMPT_TAIL:])
        self._prefix = 0  # the window starts here
        self._read = len(self._ids)  # text up to here has been returned

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[no-any-return]

    def feed(self, ids: Iterable[int]) -> str:
        pieces = []
        for token in ids:
            self._ids.append(token)
            seen = self._decode(self._ids[self._prefix : self._read])
            text = self._decode(self._ids[self._prefix :])
            if len(text) > len(seen) and not text.endswith(_REPLACEMENT):
                pieces.append(text[len(seen) :])
                self._prefix, self._read = self._read, len(self._ids)
        return "".join(pieces)

    def flush(self) -> str:
        seen = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(seen) :] if len(text) > len(seen) else ""


class HFTokenizer:
    """``AutoTokenizer.from_pretrained(directory)`` behind the server's tokenizer interface.

    ``chat_template``: a template that replaces the checkpoint's own (``--chat-template``).
    """

    def __init__(self, directory: Path, chat_template: str | None = None) -> None:
        transformers = require_extra(
            "transformers", extra="transformers", needed_by="serving a checkpoint's tokenizer (--model DIR)"
        )
        try:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(directory), local_files_only=True
            )
        except Exception as exc:  # a missing or broken tokenizer file: say which directory and why
            raise ConfigError(
                f"cannot load the tokenizer of {directory}: {shorten(str(exc), 300)}; a checkpoint directory "
                "needs its tokenizer files (tokenizer.json and tokenizer_config.json)"
            ) from None
        if chat_template is not None:
            self._tokenizer.chat_template = chat_template
        eos = self._tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (eos,) if isinstance(eos, int) else ()

    @property
    def transformers_tokenizer(self) -> Any:
        """The transformers tokenizer itself (structured output builds its token table from it)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (special tokens included)."""
        return len(self._tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tokenizer.chat_template)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    def decode(self, ids: Iterable[int]) -> str:
        decoder = self.decoder()
        return decoder.feed(ids) + decoder.flush()

    def decoder(self, prompt: Sequence[int] = ()) -> WindowDecoder:
        return WindowDecoder(self._tokenizer, prompt)

    def token_text(self, token: int) -> str:
        return self._tokenizer.decode([token])  # type: ignore[no-any-return]

    def token_bytes(self, token: int) -> bytes:
        """The decoded text's UTF-8, unless it holds U+FFFD: then the token's own bytes, read from its
        vocabulary entry (SentencePiece's ``<0xE2>`` byte tokens, byte-level BPE's printable alphabet)."""
        text = self.token_text(token)
        if _REPLACEMENT not in text:
            return text.encode("utf-8")
        piece = self._tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            decoded = [_BYTE_LEVEL.get(char) for char in piece]
            if piece and None not in decoded:
                return bytes(decoded)  # type: ignore[arg-type]
        return text.encode("utf-8")

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: Mapping[str, Any],
    ) -> list[int]:
        if not self.has_chat_template:
            raise ChatTemplateError(
                "this model has no chat template (its tokenizer_config.json and chat_template.jinja name "
                "none): use /v1/completions, or start the server with --chat-template FILE"
            )
        try:
            text = self._tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **template_kwargs,
            )
        except Exception as exc:  # the template's own raise_exception(...) and rendering errors
            raise ChatTemplateError(
                f"the chat template refused the messages: {shorten(str(exc), 300)}"
            ) from None
        return list(self._tokenizer.encode(text, add_special_tokens=False))
