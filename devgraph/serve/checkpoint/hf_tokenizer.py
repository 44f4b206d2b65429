"""A checkpoint's own tokenizer and chat template, through transformers' ``AutoTokenizer``.

transformers is optional in the serving path (the ``serve`` extra does not pull it in): serving a
checkpoint without it stops at start-up with one line naming the extra to install. A tokenizer that does
not load names the file at fault (a tokenizer file that is not JSON, a config.json field transformers'
checks refuse); a directory without tokenizer files, from which transformers 5.24 builds an empty
tokenizer instead of failing, is refused too.

* Completion prompts are encoded with the tokenizer's special tokens (BOS where the tokenizer adds it),
  chat prompts are rendered by the chat template and encoded without them (the template writes its own),
  as transformers' ``apply_chat_template(tokenize=True)`` does. Text that is not valid Unicode (a lone
  surrogate from a JSON ``\\ud800`` escape) is an :class:`InputError` (400), not a tokenizer crash.
* Chat templates render in worker processes, bounded (:mod:`template_render`). A template from the request
  (``chat_template``) is refused unless the server trusts them (``--trust-request-chat-template``);
  ``chat_template_kwargs`` are the template's variables and may not set the renderer's own arguments.
* Output text skips special tokens and is decoded incrementally: each new token's text is the difference
  between decoding a short window with it and without it, the window starting in the prompt's tail, so a
  SentencePiece word's leading space appears where it belongs and a character split across tokens waits
  until it is whole. Streaming and non-streaming responses use the same decoder, so their texts are equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from devgraph import ConfigError
from devgraph.extras import require_extra
from devgraph.jsonfile import read_json_file
from devgraph.messages import shorten
from devgraph.serve.checkpoint.template_render import RenderLimits, TemplateRenderer
from devgraph.serve.checkpoint.text import ChatTemplateError, check_unicode

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

    ``chat_template``: a template that replaces the checkpoint's own (``--chat-template``);
    ``trust_request_template``: render templates sent in requests (``--trust-request-chat-template``);
    ``render_limits``: what one chat-template render may take.
    """

    def __init__(
        self,
        directory: Path,
        chat_template: str | None = None,
        *,
        trust_request_template: bool = False,
        render_limits: RenderLimits | None = None,
    ) -> None:
        transformers = require_extra(
            "transformers", extra="transformers", needed_by="serving a checkpoint's tokenizer (--model DIR)"
        )
        try:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(directory), local_files_only=True
            )
        except Exception as exc:  # a missing or broken tokenizer file: say which file and why
            raise ConfigError(_why_not_loaded(directory, exc, transformers)) from None
        if not self._tokenizer.encode("hello world", add_special_tokens=False):
            raise ConfigError(
                f"{directory} has no usable tokenizer: transformers built an empty one "
                f"({len(self._tokenizer)} tokens; text encodes to no ids): the directory holds none of its "
                f"files ({', '.join(TOKENIZER_FILES)}); copy the model's tokenizer files into it"
            )
        if chat_template is not None:
            self._tokenizer.chat_template = chat_template
        eos = self._tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (eos,) if isinstance(eos, int) else ()
        self.trust_request_template = trust_request_template
        self.renderer = TemplateRenderer(render_limits)

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
        return list(self._tokenizer.encode(check_unicode(text, "the prompt"), add_special_tokens=True))

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

    def start(self) -> None:
        """Start the chat-template workers ahead of the first chat request."""
        if self.has_chat_template or self.trust_request_template:
            self.renderer.start()

    def close(self) -> None:
        self.renderer.close()

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: Mapping[str, Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        variables = dict(template_kwargs)
        requested = variables.pop("chat_template", None)
        _check_variables(variables)
        if requested is not None and not self.trust_request_template:
            raise ChatTemplateError(
                "a chat template sent in the request (chat_template) is not rendered: this server renders "
                "only its own; its operator can allow request templates with --trust-request-chat-template"
            )
        if requested is not None and (not isinstance(requested, str) or not requested.strip()):
            raise ChatTemplateError(
                f"chat_template must be the text of a Jinja template, got {shorten(requested)}"
            )
        if requested is None and not self.has_chat_template:
            raise ChatTemplateError(
                "this model has no chat template (its tokenizer_config.json and chat_template.jinja name "
                "none): use /v1/completions, or start the server with --chat-template FILE"
            )
        template = self._tokenizer.get_chat_template(requested)
        conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as transformers
        text = self.renderer.render(
            template,
            conversation,
            {**self._tokenizer.special_tokens_map, **variables},
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
        )
        return list(
            self._tokenizer.encode(check_unicode(text, "the rendered chat"), add_special_tokens=False)
        )


#: Names ``chat_template_kwargs`` may not set: ``apply_chat_template``'s own arguments and what the renderer
#: passes the template itself (vLLM filters the same class of keys out of chat_template_kwargs).
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "conversation", "conversations", "messages", "tools", "documents", "add_generation_prompt",
        "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
        "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def _check_variables(variables: Mapping[str, Any]) -> None:
    reserved = sorted(set(variables) & RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise ChatTemplateError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: those are the renderer's own "
            "arguments, not template variables (messages and the generation prompt have request fields)"
        )
    odd = [name for name in variables if not name.isidentifier()]
    if odd:
        raise ChatTemplateError(
            f"chat_template_kwargs keys are template variable names; {shorten(odd[0])} is not one"
        )


#: Files a tokenizer is built from (one is enough): tokenizers' JSON, SentencePiece, BPE vocabularies.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt", "tekken.json",
)  # fmt: skip


def _why_not_loaded(directory: Path, exc: Exception, transformers: Any) -> str:
    """Which file stopped transformers loading the tokenizer, and what is wrong with it."""
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return (
            f"{directory} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): copy the model's "
            "tokenizer files into it"
        )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        path = directory / name
        if path.is_file():
            try:
                read_json_file(path, "a tokenizer file")
            except ConfigError as bad:
                return str(bad)
    try:  # transformers reads config.json too, with its own type checks on fields devgraph does not read
        transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as config_exc:
        return (
            f"{directory / 'config.json'} does not pass transformers' checks (it reads it to load the "
            f"tokenizer): {shorten(' '.join(str(config_exc).split()), 300)}"
        )
    return (
        f"cannot load the tokenizer of {directory}: {shorten(' '.join(str(exc).split()), 300)}; a checkpoint "
        "directory needs its tokenizer files (tokenizer.json and tokenizer_config.json)"
    )
