"""``POST /v1/completions``: the request body, checked, and the ``text_completion`` responses.

Fields beyond the shared ones (``fields.py``): ``prompt`` (required: a string, encoded by the model's
tokenizer with its special tokens, a list of token ids, or a list of either: one choice per prompt and
copy, indexed ``prompt * n + copy`` as the OpenAI API does), ``max_tokens`` (default 16; 0 computes only
the prompt, for ``echo``), ``logprobs`` (an int from 0 to 20: the chosen token's log probability and the
that many most likely tokens'), ``echo`` (the prompt before the completion; with ``logprobs``, the
prompt's tokens and their log probabilities too, the first token's ``null``), ``best_of`` (copies
sampled per prompt, the ``n`` of highest cumulative log probability returned; not with ``stream``), and
vLLM's ``prompt_logprobs`` (an int from 0 to 20: each choice's ``prompt_logprobs`` lists, per prompt
token, ``{token id: {logprob, rank, decoded_token}}`` for the token itself and the most likely ones);
the structured-output fields (``structured.py``: ``response_format``, ``structured_outputs``, ``guided_*``).

The prompt's log probabilities are computed in the prefill: the prefill graphs return every token's hidden
state beside the last tokens' logits, and the LM head runs on the rows asked for (see the engine).
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
    choices,
    include_usage,
    sampling,
)
from devgraph.serve.api.generate import Choice
from devgraph.serve.api.logprobs import TokenNames, finite, merge_completion_logprobs
from devgraph.serve.api.protocol import ApiError, check_model
from devgraph.serve.api.structured import STRUCTURED_FIELDS, parse_structured
from devgraph.serve.checkpoint.text import Tokenizer
from devgraph.serve.engine.request import MAX_COPIES, MAX_LOGPROBS, TokenLogprob

__all__ = ["MAX_PROMPTS", "CompletionShape", "parse_completion"]

FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "prompt_logprobs"} | STRUCTURED_FIELDS
DEFAULT_MAX_TOKENS = 16
#: Prompts one request may hold (lm-eval batches a handful; each is one engine request).
MAX_PROMPTS = 256


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
    prompts = _prompts(body["prompt"], tokenizer)
    logprobs = _logprob_count(body, "logprobs")
    prompt_logprobs = _logprob_count(body, "prompt_logprobs")
    echo = as_bool(body, "echo", False)
    stream = as_bool(body, "stream", False)
    n = choices(body)
    best_of = as_int(body, "best_of", None)
    if best_of is not None and not n <= best_of <= MAX_COPIES:
        raise ApiError(400, f"best_of must be an integer from n ({n}) to {MAX_COPIES}", param="best_of")
    copies = best_of or n
    if stream and copies > n:
        raise ApiError(
            400, "best_of > n cannot stream: the best copies are known only at the end", param="best_of"
        )
    max_tokens = as_int(body, "max_tokens", DEFAULT_MAX_TOKENS)
    # The prompt's log probabilities: for prompt_logprobs, and for echo with logprobs.
    counts = [c for c in (prompt_logprobs, logprobs if echo else None) if c is not None]
    ranked = copies > n and logprobs is None  # best_of ranks copies by their log probabilities
    params, stops, include_stop = sampling(
        body,
        max_tokens=max_tokens,  # type: ignore[arg-type]
        defaults=defaults,
        eos_token_ids=eos_token_ids,
        logprobs=0 if ranked else logprobs,
        prompt_logprobs=max(counts) if counts else None,
        copies=copies,
    )
    usage, continuous = include_usage(body, stream)
    generation = Generation(
        [p for p, _ in prompts],
        params,
        stream,
        usage,
        stops,
        include_stop,
        served,
        n=n,
        continuous_usage=continuous,
        client_logprobs=not ranked,
        grammar=parse_structured(body),
    )
    echoed = [(text if text is not None else _text(tokenizer, p)) if echo else "" for p, text in prompts]
    shape = CompletionShape(
        tokenizer,
        echoed,
        [p for p, _ in prompts],
        logprobs=logprobs is not None,
        echo_logprobs=echo and logprobs is not None,
        prompt_logprobs=prompt_logprobs is not None,
    )
    return generation, shape


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    decoder = tokenizer.decoder()
    return decoder.feed(ids) + decoder.flush()


def _logprob_count(body: Mapping[str, Any], name: str) -> int | None:
    value = as_int(body, name, None)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(400, f"{name} must be an integer from 0 to {MAX_LOGPROBS}", param=name)
    return value


def _prompts(value: Any, tokenizer: Tokenizer) -> list[tuple[list[int], str | None]]:
    """Each prompt's ids and, for a text prompt, its text."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > MAX_PROMPTS:
            message = f"at most {MAX_PROMPTS} prompts per request, got {len(value)}"
            raise ApiError(400, message, param="prompt")
        return [_prompt(p, tokenizer, f"prompt[{i}]") for i, p in enumerate(value)]
    return [_prompt(value, tokenizer, "prompt")]


def _prompt(value: Any, tokenizer: Tokenizer, where: str) -> tuple[list[int], str | None]:
    if isinstance(value, str):
        try:
            tokens = tokenizer.encode(value)
        except UnicodeEncodeError:  # a lone surrogate ("\ud800") has no UTF-8 bytes
            raise ApiError(
                400, f"{where} is not valid Unicode text (it holds a lone surrogate)", param="prompt"
            ) from None
        text: str | None = value
    elif isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        tokens, text = list(value), None
    else:
        raise ApiError(
            400,
            f"{where} must be a string or a list of token ids (ints), or a list of those; got "
            f"{shorten(value)}",
            param="prompt",
        )
    if not tokens:
        raise ApiError(400, f"{where}: the prompt is empty", param="prompt")
    return tokens, text


class CompletionShape:
    """``text_completion`` choices: whole, and as stream chunks (see :class:`~.generate.Shape`)."""

    object = "text_completion"

    def __init__(
        self,
        tokenizer: Tokenizer,
        echoes: Sequence[str],
        prompts: Sequence[Sequence[int]],
        *,
        logprobs: bool,
        echo_logprobs: bool,
        prompt_logprobs: bool,
    ) -> None:
        self.names = TokenNames(tokenizer)
        self.echoes = list(echoes)
        self.prompts = [list(p) for p in prompts]
        self.logprobs = logprobs
        self.echo_logprobs = echo_logprobs
        self.prompt_logprobs = prompt_logprobs
        self._offsets: dict[int, int] = {}  # choice index -> text_offset of its next token

    def opening(self, choice: Choice) -> dict[str, Any] | None:
        return None

    def _body(
        self, choice: Choice, text: str, ids: list[int], logprobs: Sequence[TokenLogprob] | None, first: bool
    ) -> dict[str, Any]:
        echo = self.echoes[choice.prompt] if first else ""
        parts: list[dict[str, Any] | None] = []
        if self.logprobs:
            offset = self._offsets.get(choice.index, 0)
            if first and self.echo_logprobs:  # every prompt token, even where its text is empty (a BOS)
                prompt = self.prompts[choice.prompt]
                entries = choice.prompt_logprobs or [None] * len(prompt)
                parts.append(self.names.completion_logprobs(prompt, entries, offset))
                offset += len(echo)
            entries_out = list(logprobs or ())
            parts.append(self.names.completion_logprobs([e.token for e in entries_out], entries_out, offset))
            self._offsets[choice.index] = offset + sum(
                len(self.names.tokenizer.token_text(e.token)) for e in entries_out
            )
        body: dict[str, Any] = {
            "index": choice.index,
            "text": echo + text,
            "token_ids": ids,
            "logprobs": merge_completion_logprobs(parts),
            "finish_reason": choice.finish,
        }
        if self.prompt_logprobs and first:
            body["prompt_logprobs"] = self._prompt_logprobs(choice)
        return body

    def _prompt_logprobs(self, choice: Choice) -> list[dict[str, Any] | None]:
        """vLLM's shape: per prompt token ``{id: {logprob, rank, decoded_token}}`` (the first ``null``)."""
        shown: list[dict[str, Any] | None] = []
        for entry in choice.prompt_logprobs or [None]:
            if entry is None:
                shown.append(None)
                continue
            item = {str(entry.token): self._scored(entry.token, entry.logprob, entry.rank)}
            for rank, (token, logprob) in enumerate(entry.top, start=1):
                item.setdefault(str(token), self._scored(token, logprob, rank))
            shown.append(item)
        return shown

    def _scored(self, token: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": finite(logprob), "rank": rank, "decoded_token": self.names.name(token)}

    def piece(
        self, choice: Choice, text: str, ids: list[int], logprobs: Sequence[TokenLogprob] | None
    ) -> dict[str, Any]:
        return self._body(choice, text, ids, logprobs, first=not choice.sent_first)

    def whole(self, choice: Choice, logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        return self._body(choice, choice.text, choice.ids, logprobs, first=True)
