"""Capping the ``--device-graph-mode`` flag's ``sizes`` / ``max_size`` to what the engine can run.

The flag's sizes win over the engine's own (``GraphRunner`` takes the flag's ``max_size`` before the
``max_size`` argument), so a flag asking for decode graphs up to 4096 requests on an engine that runs at
most 8 would capture graphs that no step ever replays: memory and start-up time for nothing. The engine
knows its limits (decode: ``max_running_requests``; prefill: ``token_budget``), so it cuts the flag down
to them, with a warning.
"""

from __future__ import annotations

import logging

from devgraph import DeviceGraphConfig

__all__ = ["cap_phase_sizes"]

logger = logging.getLogger(__name__)


def cap_phase_sizes(config: DeviceGraphConfig, phase: str, limit: int, why: str) -> DeviceGraphConfig:
    """``config`` with ``phase``'s graph sizes cut to ``limit`` (see :meth:`DeviceGraphConfig.capped`);
    warns when it changes anything. ``why`` names the limit for the warning (``"token_budget"``)."""
    capped, asked = config.capped(phase, limit)
    if asked:
        logger.warning(
            "devgraph: %s graphs are capped at %d (the engine's %s): the flag asked for %s, and larger "
            "steps never run",
            phase,
            limit,
            why,
            asked,
        )
    return capped
