"""``POST /v1/completions``: the request body, checked, and the ``text_completion`` responses.

Fields beyond the shared ones (``fields.py``): ``prompt`` (required: a string, encoded by the model's
tokenizer with its special tokens, or a list of token ids), ``max_tokens`` (default 16), ``logprobs``
(an int from 0 to 20: the sampled token's log probability and that many alternatives per token),
``echo`` (the prompt's text before the completion; not with ``logprobs``, which would need the prompt's
log probabilities); the structured-output fields (``structured.py``: ``response_format``,
``structured_outputs``, ``guided_*``).

Each choice also carries ``token_ids`` (devgraph's addition): the generated ids, stop tokens left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from devgraph.messages import shorten
from devgraph.serve.api.fields import (
    COMMON_FIELDS,
    Generation,
    as_bool,
    as_int,
    check_fields,
    include_usage,
    sampling,
)
from devgraph.serve.api.protocol import ApiError, check_model
from devgraph.serve.api.structured import STRUCTURED_FIELDS, parse_structured
from devgraph.serve.checkpoint.text import Tokenizer
from devgraph.serve.engine.request import MAX_LOGPROBS, TokenLogprob

__all__ = ["CompletionShape", "parse_completion"]

FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo"} | STRUCTURED_FIELDS
DEFAULT_MAX_TOKENS = 16


def parse_completion(
    body: Any,
    tokenizer: Tokenizer,
    served: str,
    *,
    defaults: Mapping[str, Any],
    eos_token_ids: tuple[int, ...],
) -> tuple[Generation, CompletionShape]:
    """The checked request and how to shape its responses; :class:`ApiError` (400, 404) naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_model(body.get("model"), served)
    check_fields(body, FIELDS, "POST /v1/completions")
    if "prompt" not in body:
        raise ApiError(400, "missing field 'prompt' (a string or a list of token ids)", param="prompt")
    prompt, text = _prompt(body["prompt"], tokenizer)
    logprobs = as_int(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be an integer from 0 to {MAX_LOGPROBS}", param="logprobs")
    echo = as_bool(body, "echo", False)
    if echo and logprobs is not None:
        raise ApiError(
            400,
            "echo with logprobs needs the prompt's log probabilities, which devgraph serve does not "
            "compute; drop one of them",
            param="echo",
        )
    stream = as_bool(body, "stream", False)
    max_tokens = as_int(body, "max_tokens", DEFAULT_MAX_TOKENS)
    params, stops, include_stop = sampling(
        body,
        max_tokens=max_tokens,  # type: ignore[arg-type]
        defaults=defaults,
        eos_token_ids=eos_token_ids,
        logprobs=logprobs,
    )
    generation = Generation(
        prompt,
        params,
        stream,
        include_usage(body, stream),
        stops,
        include_stop,
        served,
        grammar=parse_structured(body),
    )
    echoed = (text if text is not None else tokenizer.decoder().feed(prompt)) if echo else ""
    return generation, CompletionShape(tokenizer, echoed)


def _prompt(value: Any, tokenizer: Tokenizer) -> tuple[list[int], str | None]:
    if isinstance(value, str):
        try:
            tokens = tokenizer.encode(value)
        except UnicodeEncodeError:  # a lone surrogate ("\ud800") has no UTF-8 bytes
            raise ApiError(
                400, "the prompt is not valid Unicode text (it holds a lone surrogate)", param="prompt"
            ) from None
        text: str | None = value
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        raise ApiError(400, "one prompt per request: send a string or a list of token ids", param="prompt")
    elif isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        tokens, text = list(value), None
    else:
        raise ApiError(
            400,
            f"prompt must be a string or a list of token ids (ints), got {shorten(value)}",
            param="prompt",
        )
    if not tokens:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return tokens, text


class CompletionShape:
    """``text_completion`` bodies: the whole response, stream chunks, and the usage chunk."""

    object = "text_completion"

    def __init__(self, tokenizer: Tokenizer, echo: str = "") -> None:
        self.tokenizer = tokenizer
        self.echo = echo
        self._offset = len(echo)  # text_offset of the next token

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        text = self.tokenizer.token_text
        tokens = [text(e.token) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(i): lp for i, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _choice(
        self, text: str, ids: list[int], logprobs: Sequence[TokenLogprob] | None, finish: str | None
    ) -> dict[str, Any]:
        return {
            "index": 0,
            "text": text,
            "token_ids": ids,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish,
        }

    def first(self) -> dict[str, Any] | None:
        """The stream's opening chunk: the echoed prompt, if any."""
        return {"choices": [self._choice(self.echo, [], None, None)]} if self.echo else None

    def chunk(
        self, text: str, ids: list[int], logprobs: Sequence[TokenLogprob] | None, finish: str | None
    ) -> dict[str, Any]:
        return {"choices": [self._choice(text, ids, logprobs, finish)]}

    def whole(
        self, text: str, ids: list[int], logprobs: Sequence[TokenLogprob] | None, finish: str | None
    ) -> dict[str, Any]:
        return {"choices": [self._choice(self.echo + text, ids, logprobs, finish)]}
