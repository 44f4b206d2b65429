"""Field checks and preset lookup shared by the reference model's and the vision encoder's configs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from devgraph import ConfigError
from devgraph.messages import shorten
from devgraph.reference.kernels.backends import BACKEND_NAMES

__all__ = ["check_kernels", "check_positive_ints", "preset_values"]


def check_positive_ints(config: object, names: Iterable[str]) -> None:
    """Raise :class:`ConfigError` for the first of ``names`` on ``config`` that is not an int > 0."""
    owner = type(config).__name__
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{owner}.{name} must be a positive int, got {shorten(value)}")


def check_kernels(config: object, kernels: object) -> None:
    """Raise :class:`ConfigError` unless ``kernels`` names an attention backend (``attention_backend``)."""
    if kernels not in BACKEND_NAMES:
        raise ConfigError(
            f"{type(config).__name__}.kernels {shorten(kernels)} is unknown; "
            f"accepted: {', '.join(BACKEND_NAMES)}"
        )


def preset_values(
    cls: type, what: str, presets: Mapping[str, Mapping[str, Any]], name: str, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """Preset ``name``'s fields with ``overrides`` on top; an unknown preset or field is a ConfigError.

    ``what`` names the kind of preset in the error (``"reference"``, ``"vision encoder"``).
    """
    if name not in presets:
        raise ConfigError(f"unknown {what} preset {shorten(name)}; accepted: {', '.join(presets)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} field(s) {', '.join(unknown)}; accepted: {', '.join(sorted(fields))}"
        )
    return {**presets[name], **overrides}
