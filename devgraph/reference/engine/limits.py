"""Capping the ``--device-graph-mode`` flag's ``sizes`` / ``max_size`` to what the engine can run.

The flag's sizes win over the engine's own (``GraphRunner`` takes the flag's ``max_size`` before the
``max_size`` argument), so a flag asking for decode graphs up to 4096 requests on an engine that runs at
most 8 would capture graphs that no step ever replays: memory and start-up time for nothing. The engine
knows its limits (decode: ``max_running_requests``; prefill: ``token_budget``), so it cuts the flag down
to them, with a warning.
"""

from __future__ import annotations

import dataclasses
import logging

from devgraph.config import DeviceGraphConfig

__all__ = ["cap_phase_sizes"]

logger = logging.getLogger("devgraph.serve.engine")


def cap_phase_sizes(config: DeviceGraphConfig, phase: str, limit: int, why: str) -> DeviceGraphConfig:
    """``config`` with ``phase``'s ``max_size`` at most ``limit`` and its ``sizes`` above ``limit`` replaced
    by ``limit`` (the largest step the engine runs still gets its graph); warns when it changes anything.
    ``why`` names the limit for the warning (e.g. ``"max_running_requests"``)."""
    current = config.for_phase(phase)
    changes: dict[str, object] = {}
    if current.max_size is not None and current.max_size > limit:
        changes["max_size"] = limit
    if current.sizes is not None and max(current.sizes) > limit:
        changes["sizes"] = tuple(sorted({min(size, limit) for size in current.sizes}))
    if not changes:
        return config
    logger.warning(
        "devgraph: %s graphs are capped at %d (the engine's %s): the flag asked for %s, and larger "
        "steps never run",
        phase,
        limit,
        why,
        ", ".join(f"{key} {getattr(current, key)!r}" for key in changes),
    )
    phases = {**config.phases, phase: dataclasses.replace(current, **changes)}  # type: ignore[arg-type]
    return DeviceGraphConfig(phases, config.source)
