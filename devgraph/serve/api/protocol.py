"""The OpenAI protocol's shared pieces: errors and the model card.

The routes' own request checks and response shapes are in ``completions.py`` and ``chat.py``; the fields
both take, and the rule for every other field, in ``fields.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from devgraph.messages import shorten

__all__ = [
    "ApiError",
    "ModelCard",
    "check_model",
    "error_body",
    "model_list",
    "model_object",
    "now",
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
    root: str | None = None  # where the weights came from (a checkpoint directory), when not the id
    created: int = 0


def model_object(card: ModelCard) -> dict[str, Any]:
    """One model as OpenAI describes it (``GET /v1/models/{id}``), plus its vocabulary and context
    (``max_model_len`` as vLLM names it; ``max_seq_len`` as devgraph's load generator reads it)."""
    return {
        "id": card.id,
        "object": "model",
        "created": card.created,
        "owned_by": "devgraph",
        "root": card.root or card.id,
        "vocab_size": card.vocab_size,
        "max_seq_len": card.max_seq_len,
        "max_model_len": card.max_seq_len,
    }


def model_list(card: ModelCard) -> dict[str, Any]:
    """The body of ``GET /v1/models``: OpenAI's list of models (the one served)."""
    return {"object": "list", "data": [model_object(card)]}


def check_model(model: Any, served: str) -> None:
    """:class:`ApiError` 404 unless ``model`` is absent or names the served model."""
    if model is not None and model != served:
        raise ApiError(
            404,
            f"model {shorten(model)} is not served here; this server serves {served!r}",
            param="model",
            kind="not_found_error",
        )


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


def now() -> int:
    return int(time.time())
