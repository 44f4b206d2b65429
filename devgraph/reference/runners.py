"""GraphRunners for the reference model's steps (demo, benchmarks, tests, the serving engine)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph import REQUESTS, TOKENS, GraphRunner
from devgraph.reference.inputs import reference_inputs
from devgraph.reference.model import ReferenceModel

__all__ = ["decode_runner", "prefill_runner", "verify_runner"]


def decode_runner(model: ReferenceModel, *, greedy: bool = False, **kwargs: Any) -> GraphRunner:
    """A decode-phase runner over ``model.decode_step`` (sizes are batch sizes). ``greedy=True``: over
    ``model.decode_step_with_greedy`` instead, returning ``(logits, each row's greedy token)``."""
    kwargs.setdefault("device", model.device)
    forward: Callable[..., Any] = model.decode_step
    if greedy:
        kwargs.setdefault("output_axes", [TOKENS, TOKENS])
        forward = model.decode_step_with_greedy
    return GraphRunner(forward, phase="decode", inputs=reference_inputs(model, "decode"), **kwargs)


def prefill_runner(model: ReferenceModel, *, hidden_states: bool = False, **kwargs: Any) -> GraphRunner:
    """A prefill-phase runner over ``model.prefill_step`` (sizes are packed token counts; up to
    ``max_requests`` requests per step, one request bucket per token size). ``hidden_states=True``: over
    ``model.prefill_step_with_hidden`` instead, returning ``(last-token logits, every token's hidden
    state)``."""
    kwargs.setdefault("device", model.device)
    kwargs.setdefault("axes", {REQUESTS: model.config.max_requests})
    forward: Callable[..., Any]
    if hidden_states:
        kwargs.setdefault("output_axes", [REQUESTS, TOKENS])
        forward = model.prefill_step_with_hidden
    else:
        forward = model.prefill_step
    return GraphRunner(forward, phase="prefill", inputs=reference_inputs(model, "prefill"), **kwargs)


def verify_runner(model: ReferenceModel, tokens_per_request: int, **kwargs: Any) -> GraphRunner:
    """A speculative-decoding verify runner over ``model.verify_step`` (``1 + k`` tokens per request)."""
    kwargs.setdefault("device", model.device)
    return GraphRunner(
        model.verify_step,
        phase="verify",
        inputs=reference_inputs(model, "verify"),
        tokens_per_request=tokens_per_request,
        **kwargs,
    )
