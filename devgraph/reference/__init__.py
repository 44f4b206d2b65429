"""The reference model: a small random-weight Llama-style decoder whose attention is a break op.

Used by ``devgraph demo``, the benchmarks and the conformance kit::

    config = ReferenceConfig.preset("tiny")
    model = ReferenceModel(config, device="cpu", seed=0)
    model.randomize_cache(seed=0)
    batch = make_decode_batch(model, 8)
    with forward_context(decode_context(batch)):
        logits = model.decode_step(**batch)
"""

from devgraph.reference.attention import ATTENTION_OP_NAME, attention
from devgraph.reference.config import PRESET_NAMES, ReferenceConfig
from devgraph.reference.inputs import (
    StepContext,
    decode_context,
    make_decode_batch,
    make_prefill_batch,
    padding_fill,
    prefill_context,
)
from devgraph.reference.model import ReferenceModel
from devgraph.reference.runners import decode_runner, prefill_runner, reference_inputs

__all__ = [
    "ATTENTION_OP_NAME",
    "PRESET_NAMES",
    "ReferenceConfig",
    "ReferenceModel",
    "StepContext",
    "attention",
    "decode_context",
    "make_decode_batch",
    "make_prefill_batch",
    "padding_fill",
    "prefill_context",
    "decode_runner",
    "prefill_runner",
    "reference_inputs",
]
