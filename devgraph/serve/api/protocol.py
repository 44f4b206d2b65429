"""The OpenAI-style completions protocol: checking a request body, shaping responses and errors.

Accepted fields of ``POST /v1/completions`` (others are ignored, as OpenAI clients send extras):

``prompt`` (required): a string (byte-level tokenized) or a list of token ids. ``max_tokens`` (default
16, >= 1). ``temperature`` (default 1.0; 0 is greedy, else from 1e-4 to 100). ``top_p`` (default 1.0;
from 1e-4 to 1). ``seed`` (an int >= 0, or null). ``stop`` / ``stop_token_ids``: a token id or a list of
them, at most 64 in all (stop strings are not supported). ``stream`` (default false). ``model``
(optional; must name the served model). ``n`` (only 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from devgraph.errors import InputError
from devgraph.messages import shorten
from devgraph.serve.api.tokenizer import ByteTokenizer
from devgraph.serve.engine.request import MAX_STOP_TOKEN_IDS, RequestOutput, SamplingParams

__all__ = [
    "ApiError",
    "CompletionRequest",
    "ModelCard",
    "completion_chunk",
    "completion_response",
    "error_body",
    "model_list",
    "parse",
    "parse_model_card",
]


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


def error_body(error: ApiError) -> dict[str, Any]:
    return {
        "error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}
    }


@dataclass(frozen=True)
class ModelCard:
    """The served model as ``GET /v1/models`` describes it; ``devgraph bench serve`` reads it back."""

    id: str
    vocab_size: int
    max_seq_len: int


def model_list(card: ModelCard) -> dict[str, Any]:
    """The body of ``GET /v1/models``: OpenAI's list of models, plus the fields a load generator needs."""
    return {
        "object": "list",
        "data": [
            {
                "id": card.id,
                "object": "model",
                "owned_by": "devgraph",
                "vocab_size": card.vocab_size,
                "max_seq_len": card.max_seq_len,
            }
        ],
    }


def parse_model_card(payload: Any) -> ModelCard:
    """The first model of a ``GET /v1/models`` body; :class:`ValueError` saying what is missing or wrong."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise ValueError(f"expected {{'data': [{{model card}}, ...]}}, got {shorten(payload)}")
    card = data[0]
    name = card.get("id")
    if not isinstance(name, str) or not name:
        raise ValueError(f"the model card's 'id' must be a non-empty string, got {shorten(name)}")
    sizes = {}
    for field_name, low in (("vocab_size", 1), ("max_seq_len", 2)):
        value = card.get(field_name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(
                f"the model card's {field_name!r} must be an integer >= {low}, got {shorten(value)}"
            )
        sizes[field_name] = value
    return ModelCard(name, sizes["vocab_size"], sizes["max_seq_len"])


@dataclass(frozen=True)
class CompletionRequest:
    prompt: list[int]
    params: SamplingParams
    stream: bool
    model: str


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {shorten(value)}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{name} must be a number, got {shorten(value)}", param=name)
    return float(value)


def _token_ids(value: Any, name: str) -> list[int]:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise ApiError(400, f"{name} must be a list of token ids (ints), got {shorten(value)}", param=name)


def _stop(body: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for name in ("stop", "stop_token_ids"):
        value = body.get(name)
        if value is None:
            continue
        count = len(ids) + (len(value) if isinstance(value, list) else 1)
        if count > MAX_STOP_TOKEN_IDS:  # each one is checked against every sampled token
            raise ApiError(
                400,
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids (stop and stop_token_ids together) are "
                f"accepted, got {count}",
                param=name,
            )
        if isinstance(value, str) or (isinstance(value, list) and any(isinstance(v, str) for v in value)):
            raise ApiError(400, f"{name}: stop strings are not supported; give token ids (ints)", param=name)
        ids += [value] if isinstance(value, int) and not isinstance(value, bool) else _token_ids(value, name)
    return tuple(ids)


def parse(body: Any, tokenizer: ByteTokenizer, model_name: str) -> CompletionRequest:
    """The checked request; :class:`ApiError` (400 or 404) saying which field is wrong and why."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404,
            f"model {shorten(model)} is not served here; this server serves {model_name!r}",
            param="model",
            kind="not_found_error",
        )
    if "prompt" not in body:
        raise ApiError(400, "missing field 'prompt' (a string or a list of token ids)", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        try:
            tokens = tokenizer.encode(prompt)
        except UnicodeEncodeError:  # a lone surrogate ("\ud800") has no UTF-8 bytes
            raise ApiError(
                400, "the prompt is not valid Unicode text (it holds a lone surrogate)", param="prompt"
            ) from None
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise ApiError(400, "one prompt per request: send a string or a list of token ids", param="prompt")
    else:
        tokens = _token_ids(prompt, "prompt")
    if not tokens:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if _int(body, "n", 1) != 1:
        raise ApiError(400, "n must be 1: send one request per completion", param="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {shorten(stream)}", param="stream")
    try:
        params = SamplingParams(
            max_tokens=_int(body, "max_tokens", 16),  # type: ignore[arg-type]
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            seed=_int(body, "seed", None),
            stop_token_ids=_stop(body),
        )
    except InputError as exc:
        raise ApiError(400, str(exc), param=_field_named(str(exc))) from None
    return CompletionRequest(tokens, params, stream, model_name)


def _field_named(message: str) -> str | None:
    """The request field a :class:`SamplingParams` error is about (its messages start with the name)."""
    first = message.split(" ", 1)[0]
    return first if first in ("max_tokens", "temperature", "top_p", "seed") else None


def completion_chunk(
    request_id: str, model: str, created: int, text: str, output: RequestOutput
) -> dict[str, Any]:
    """One server-sent event of a streamed completion: this step's text and tokens; the finish reason
    and usage on the last."""
    return _completion(request_id, model, created, text, output.token_ids, output)


def completion_response(
    request_id: str, model: str, created: int, text: str, token_ids: list[int], last: RequestOutput
) -> dict[str, Any]:
    """The whole completion of a finished request (``last``: its final output)."""
    return _completion(request_id, model, created, text, token_ids, last)


def _completion(
    request_id: str, model: str, created: int, text: str, token_ids: list[int], output: RequestOutput
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "token_ids": token_ids,
                "logprobs": None,
                "finish_reason": str(output.finish_reason) if output.finished else None,
            }
        ],
    }
    if output.finished:
        body["usage"] = _usage(output)
    return body


def _usage(output: RequestOutput) -> dict[str, int]:
    return {
        "prompt_tokens": output.num_prompt_tokens,
        "completion_tokens": output.num_output_tokens,
        "total_tokens": output.num_prompt_tokens + output.num_output_tokens,
    }


def now() -> int:
    return int(time.time())
