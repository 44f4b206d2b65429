"""A checkpoint's ``generation_config.json``: where generation stops, and its sampling defaults.

* **Stop ids**: the generation config's ``eos_token_id`` (an id or a list), else config.json's, plus the
  tokenizer's EOS token: a request ends when it samples any of them (``ignore_eos`` turns that off).
* **Sampling defaults**: ``temperature``, ``top_p`` and ``top_k`` become the defaults of requests that
  do not set them, as vLLM applies a model's generation config. Settings devgraph does not implement
  (``repetition_penalty`` and the like) are reported at start-up as not applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devgraph import ConfigError
from devgraph.jsonfile import read_json_file
from devgraph.messages import shorten
from devgraph.serve.checkpoint.hf_config import token_ids

__all__ = ["GenerationDefaults", "read_generation_config"]

# Generation-config keys that change sampling and have no counterpart here (neutral values are fine).
_NOT_APPLIED = {
    "repetition_penalty": 1.0,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "num_beams": 1,
}


@dataclass(frozen=True)
class GenerationDefaults:
    """Stop ids and request defaults from the checkpoint (``None``: the server's own default)."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def sampling(self) -> dict[str, Any]:
        """The defaults a request inherits, by field name (only those the checkpoint sets)."""
        values = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return {name: value for name, value in values.items() if value is not None}


def read_generation_config(
    directory: Path, config_eos: tuple[int, ...], tokenizer_eos: tuple[int, ...]
) -> GenerationDefaults:
    """Read ``directory/generation_config.json`` (optional); :class:`ConfigError` if it is not JSON."""
    path = directory / "generation_config.json"
    raw: dict[str, Any] = {}
    if path.exists():
        loaded = read_json_file(path, "a generation config")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a JSON object, got {type(loaded).__name__}")
        raw = loaded
    eos = token_ids(raw.get("eos_token_id")) if "eos_token_id" in raw else config_eos
    stop = tuple(dict.fromkeys((*eos, *tokenizer_eos)))  # in order, once each
    notes = [
        f"generation_config.json sets {key} {shorten(raw[key])}, which devgraph does not implement: "
        "not applied"
        for key, neutral in _NOT_APPLIED.items()
        if raw.get(key) is not None and raw[key] != neutral
    ]
    return GenerationDefaults(
        eos_token_ids=stop,
        temperature=_number(raw, "temperature", path),
        top_p=_number(raw, "top_p", path),
        top_k=_top_k(raw, path),
        notes=tuple(notes),
    )


def _number(raw: dict[str, Any], name: str, path: Path) -> float | None:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: {name} must be a number, got {shorten(value)}")
    return float(value)


def _top_k(raw: dict[str, Any], path: Path) -> int | None:
    value = raw.get("top_k")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: top_k must be an integer, got {shorten(value)}")
    return value if value > 0 else None
