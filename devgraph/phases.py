"""The phases an engine runs, each with its own runner, sizes and backend choice."""

from __future__ import annotations

__all__ = ["PHASES", "check_phase"]

from devgraph.errors import ConfigError

#: decode: one token per request (sizes are batch sizes);
#: prefill / encode: packed tokens (sizes are token counts).
PHASES: tuple[str, ...] = ("decode", "prefill", "encode")


def check_phase(phase: str) -> str:
    """Return ``phase`` if known, else raise :class:`ConfigError` listing the accepted phases."""
    if phase not in PHASES:
        raise ConfigError(f"unknown phase {phase!r}; accepted: {', '.join(PHASES)}")
    return phase
