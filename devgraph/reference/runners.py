"""GraphRunners for the reference model's decode and prefill steps (demo, benchmarks, tests)."""

from __future__ import annotations

from typing import Any

import torch

from devgraph.reference.inputs import padding_fill
from devgraph.reference.model import ReferenceModel
from devgraph.runner import GraphRunner, StaticInput

__all__ = ["reference_inputs", "decode_runner", "prefill_runner"]


def reference_inputs(model: ReferenceModel) -> dict[str, StaticInput]:
    """The static inputs of both steps; padding rows write to the model's scratch KV slot."""
    fill = padding_fill(model)
    return {
        name: StaticInput(torch.int64, fill=fill[name]) for name in ("input_ids", "positions", "req_slots")
    }


def decode_runner(model: ReferenceModel, **kwargs: Any) -> GraphRunner:
    """A decode-phase runner over ``model.decode_step`` (sizes are batch sizes)."""
    kwargs.setdefault("device", model.device)
    return GraphRunner(model.decode_step, phase="decode", inputs=reference_inputs(model), **kwargs)


def prefill_runner(model: ReferenceModel, **kwargs: Any) -> GraphRunner:
    """A prefill-phase runner over ``model.prefill_step`` (sizes are packed token counts)."""
    kwargs.setdefault("device", model.device)
    return GraphRunner(model.prefill_step, phase="prefill", inputs=reference_inputs(model), **kwargs)
