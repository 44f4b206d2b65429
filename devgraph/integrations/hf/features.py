"""What the integration needs from the installed transformers, found by signature and attribute.

transformers renames pieces between minor releases: 5.24 renamed the decoder forward's ``past_key_values``
to ``cache`` (also generate()'s model keyword and ``GenerateDecoderOnlyOutput``'s field). Each piece is
looked up here by feature, never by version string. A piece that is missing is refused by
:func:`unsupported`, which names the installed transformers, the piece, and what devgraph supports.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from devgraph import ConfigError
from devgraph.integrations.hf.lib import SUPPORTED, installed_version, transformers

__all__ = ["CACHE_ARGUMENTS", "ModelFeatures", "check_cache_layer", "find_features", "unsupported"]

#: The decoder forward's keyword for its cache, newest name first (5.24 renamed ``past_key_values``).
CACHE_ARGUMENTS = ("cache", "past_key_values")


@dataclass(frozen=True)
class ModelFeatures:
    """How the decode step and the loop talk to one model under the installed transformers."""

    #: The forward's keyword for the cache; also generate()'s (its model kwargs carry the forward's names).
    cache_argument: str
    #: ``GenerateDecoderOnlyOutput``'s field for the cache.
    output_cache_field: str
    #: The forward takes ``logits_to_keep`` (the decode step then projects only the last position).
    logits_to_keep: bool


def unsupported(model_name: str, missing: str) -> ConfigError:
    """The refusal for a piece the installed transformers (or this model's code) does not have."""
    return ConfigError(
        f"DevgraphDecoder cannot drive {model_name} under transformers {installed_version()}: {missing}. "
        f"devgraph supports {SUPPORTED}; install a tested transformers, or call model.generate() for "
        "this model"
    )


def _parameters(function: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(function).parameters)  # follows functools.wraps (deprecation shims)
    except (TypeError, ValueError):
        return {}


def _named(names: list[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def _forward_features(model: Any, name: str) -> tuple[str, bool]:
    parameters = _parameters(model.forward)
    missing = [p for p in ("attention_mask", "position_ids") if p not in parameters]
    if missing:
        raise unsupported(
            name,
            f"{name}.forward takes no {_named(missing)} (a graph-captured decode step passes the padding "
            "mask and the positions explicitly)",
        )
    cache = next((p for p in CACHE_ARGUMENTS if p in parameters), None)
    if cache is None:
        raise unsupported(
            name,
            f"{name}.forward takes neither {' nor '.join(f'`{p}`' for p in CACHE_ARGUMENTS)} (the decode "
            "step hands the model its static cache by that keyword)",
        )
    if "cache_position" in parameters:
        raise unsupported(
            name,
            f"{name}.forward takes `cache_position` (a write position built on the host, which a captured "
            "graph would bake in; devgraph needs the cache's own device-side write position)",
        )
    return cache, "logits_to_keep" in parameters


def _generation_features(model: Any, name: str) -> str:
    tf = transformers()
    if "custom_generate" not in _parameters(model.generate):
        raise unsupported(
            name, "generate() takes no `custom_generate` (devgraph hands its decode loop to generate() by it)"
        )
    prepare = _parameters(tf.GenerationMixin.prepare_inputs_for_generation)
    if "is_first_iteration" not in prepare:
        raise unsupported(
            name,
            "GenerationMixin.prepare_inputs_for_generation takes no `is_first_iteration` (the decode loop "
            "prepares its prefill through it)",
        )
    output = getattr(getattr(tf.generation, "utils", None), "GenerateDecoderOnlyOutput", None)
    fields = {f.name for f in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else set()
    field = next((f for f in CACHE_ARGUMENTS if f in fields), None)
    if field is None:
        raise unsupported(
            name,
            "transformers.generation.utils.GenerateDecoderOnlyOutput has no "
            f"{' or '.join(f'`{f}`' for f in CACHE_ARGUMENTS)} field (generate() returns the cache in it)",
        )
    cache_utils = getattr(tf, "cache_utils", None)
    for piece in ("StaticCache", "StaticLayer"):
        if not isinstance(getattr(cache_utils, piece, None), type):
            raise unsupported(
                name, f"transformers.cache_utils has no `{piece}` (devgraph's shared cache is one)"
            )
    return field


def find_features(model: Any) -> ModelFeatures:
    """Every transformers piece the decoder uses for ``model``, or :func:`unsupported` naming what is
    missing (the cache layers themselves are checked by :func:`check_cache_layer`)."""
    name = type(model).__name__
    cache, logits_to_keep = _forward_features(model, name)
    field = _generation_features(model, name)
    return ModelFeatures(cache_argument=cache, output_cache_field=field, logits_to_keep=logits_to_keep)


def check_cache_layer(model_name: str, layer: Any, index: int, *, initialized: bool) -> None:
    """:func:`unsupported` unless a full-attention static cache layer has what the views and the captured
    steps use: a 0-d tensor ``cumulative_length`` (the write position each forward advances on the
    device), and once initialised, ``keys`` and ``values`` tensors ``[batch, heads, positions, dim]``."""
    kind = type(layer).__name__
    position = getattr(layer, "cumulative_length", None)
    if not isinstance(position, torch.Tensor) or position.dim() != 0:
        raise unsupported(
            model_name,
            f"cache layer {index} ({kind}) has no 0-d tensor `cumulative_length` (found "
            f"{type(position).__name__}; devgraph's captured decode steps advance that device-side write "
            "position, and the runner saves and restores it as declared state)",
        )
    if not initialized:
        return
    for attribute in ("keys", "values"):
        tensor = getattr(layer, attribute, None)
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise unsupported(
                model_name,
                f"cache layer {index} ({kind}) holds no 4-D `{attribute}` tensor after early_initialization "
                "(devgraph's per-batch-size views slice its first rows)",
            )
