"""Learning which outputs of a runner are row-major when the captured keys alone cannot tell: one more eager
run of the forward at sizes that differ on every axis."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch

from devgraph.contract.context import forward_context
from devgraph.contract.keys import REQUESTS, TOKENS, GraphKey
from devgraph.messages import shorten
from devgraph.runner.options import RunnerPlan
from devgraph.runner.outputs.layout import OutputLayout

__all__ = ["probe_layout"]

logger = logging.getLogger(__name__)


def _probe_sizes(tpr: int | None, key: GraphKey) -> dict[str, int]:
    """A size per axis that differs from ``key``'s on that axis and from every other axis's probe size
    (so a leaf following one axis cannot be taken for another), smaller than ``key`` where possible;
    ``tpr``: the phase's tokens per request (requests follow from tokens)."""
    step = tpr or 1
    tokens = key.tokens - step if key.tokens > step else key.tokens + step
    sizes = {TOKENS: tokens}
    for axis in key.axis_names:
        if tpr is not None and axis == REQUESTS:
            sizes[axis] = tokens // tpr  # uniform phases: requests follow from tokens
            continue
        current = key.size(axis)
        used = set(sizes.values())
        below = range(current - 1, 0, -1)
        sizes[axis] = next(p for p in itertools.chain(below, itertools.count(current + 1)) if p not in used)
    return sizes


def probe_layout(plan: RunnerPlan, forward: Callable[..., Any], layout: OutputLayout, key: GraphKey) -> None:
    """When the captured keys cannot tell which axis an output leaf follows (every key had one size on an
    axis, or two axes always had the same size), run the forward once more, eagerly, at sizes that differ,
    so a leaf that only happens to match a size is not taken for a row-major output.

    The probe's inputs hold each input's fill (harmless by the fill's contract); declared state is
    restored by the caller. Pass ``output_axes=`` to skip it.
    """
    if not layout.ambiguous_axes():
        return
    sizes = _probe_sizes(plan.tokens_per_request, key)
    inputs = {}
    for name, spec in plan.inputs.items():
        device = torch.device("cpu") if spec.host else plan.device
        fill = 0 if isinstance(spec.fill, str) else spec.fill  # EDGE: no row to repeat
        inputs[name] = torch.full(
            (spec.rows(sizes[spec.axis]), *spec.shape), fill, dtype=spec.dtype, device=device
        )
    probe = GraphKey.of(sizes[TOKENS], {a: sizes[a] for a in key.axis_names}, key.variant_dict)
    logger.debug("devgraph: probing output layout of the %s runner at %s", plan.phase, probe)
    try:
        context = plan.capture.context(probe) if plan.capture.context is not None else None
        with forward_context(context), torch.no_grad():
            outputs = forward(**inputs, **key.variant_dict)
    except Exception as exc:  # a forward that only takes certain sizes: learn from the captured keys alone
        logger.warning(
            "devgraph: the %s runner could not run its forward at %s to learn which outputs are row-major "
            "(%s: %s); outputs whose first dimension equals the token count are cut to it. Pass "
            "output_axes= to declare them",
            plan.phase,
            probe,
            type(exc).__name__,
            shorten(str(exc), 160),
        )
        return
    layout.observe(probe, outputs)
