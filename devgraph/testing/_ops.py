"""The break op the conformance kit captures: it reads the live forward context and logs what it saw.

Kept in its own module, registered once per process under ``devgraph_kit::context_scale``.
"""

# No ``from __future__ import annotations``: torch derives the operator schema from the annotations.

import threading
from dataclasses import dataclass

import torch

from devgraph import get_forward_context, graph_break, is_capturing, is_replaying

__all__ = ["OpCall", "context_scale", "op_calls", "clear_op_calls"]


@dataclass(frozen=True)
class OpCall:
    """One Python-level call of :func:`context_scale`: whether it ran capturing or replaying, and the
    context factor it saw."""

    replaying: bool
    capturing: bool
    factor: float


_lock = threading.Lock()
_calls: list[OpCall] = []


def op_calls() -> list[OpCall]:
    """The calls logged since :func:`clear_op_calls`."""
    with _lock:
        return list(_calls)


def clear_op_calls() -> None:
    with _lock:
        _calls.clear()


def _factor() -> float:
    context = get_forward_context()
    factor = getattr(context, "factor", None) if context is not None else None
    return float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else 1.0


@graph_break("devgraph_kit::context_scale")
def context_scale(x: torch.Tensor) -> torch.Tensor:
    """``x * factor`` where ``factor`` is the live forward context's ``factor`` (host-side, 1.0 if none).

    A break op that runs eagerly at replay must see the context of the step being replayed; one captured
    into a whole graph has its capture-time factor baked in.
    """
    factor = _factor()
    with _lock:
        _calls.append(OpCall(replaying=is_replaying(), capturing=is_capturing(), factor=factor))
    return x * factor
