"""What the server needs from a tokenizer, whichever one the model came with.

Two implement it: :class:`~devgraph.serve.checkpoint.byte_tokenizer.ByteTokenizer` (the random-weight
presets: one token per UTF-8 byte, no chat template) and
:class:`~devgraph.serve.checkpoint.hf_tokenizer.HFTokenizer` (a checkpoint's own tokenizer and chat
template, through transformers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from devgraph import InputError

__all__ = ["ChatTemplateError", "IncrementalDecoder", "Tokenizer", "check_unicode"]


class ChatTemplateError(InputError):
    """A chat request the model's template cannot render (no template, a template the request may not send,
    or the template refused it, ran too long or wrote too much)."""


def check_unicode(text: str, what: str) -> str:
    """``text`` if it is valid Unicode; a lone surrogate (JSON's ``"\\ud800"`` decodes to one) is an
    :class:`InputError` naming where it is, as tokenizers cannot encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"{what} is not valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}) at character "
            f"{exc.start}; send text whose \\u escapes pair up"
        ) from None
    return text


class IncrementalDecoder(Protocol):
    """One request's output text, piece by piece: the pieces concatenate to the whole text, and a piece
    never ends inside a character (bytes of a split character wait for the rest)."""

    def feed(self, ids: Iterable[int]) -> str: ...

    def flush(self) -> str:
        """Whatever is held back (an unfinished character becomes U+FFFD)."""
        ...


class Tokenizer(Protocol):
    """Text to token ids and back, and chat messages to a prompt."""

    #: The tokenizer's own end-of-sequence ids (the engine stops on these and the model's).
    eos_token_ids: tuple[int, ...]

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids (with the special tokens the tokenizer adds, such as BOS)."""
        ...

    def decoder(self, prompt: Sequence[int] = ()) -> IncrementalDecoder:
        """A decoder for the text generated after ``prompt`` (its tail decides leading spaces)."""
        ...

    def token_text(self, token: int) -> str:
        """One token's text, as logprobs name it."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes: for a token that holds part of a character, that part (not U+FFFD's)."""

    def start(self) -> None:
        """Start whatever rendering chats needs (worker processes) ahead of the first request."""
        ...

    def close(self) -> None:
        """Stop it (the server shuts down)."""
        ...

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: Mapping[str, Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt ids of a conversation rendered by the chat template (``tools``: the template's own
        ``tools`` variable, as transformers passes it); :class:`ChatTemplateError` when there is no
        template or it refuses the messages."""
        ...
