"""The reference model: a small random-weight Llama-style decoder over a paged KV cache.

Used by ``devgraph demo``, the benchmarks, the conformance kit and the reference serving engine::

    config = ReferenceConfig.preset("tiny")
    model = ReferenceModel(config, device="cpu", seed=0)
    batch = make_decode_batch(model, 8)
    runner = decode_runner(model, mode="full")
    runner.capture()
    logits = runner.run(context=batch_context(batch), **batch)
"""

from devgraph.reference.attention import ATTENTION_OP_NAME, PagedMetadata, sdpa_attention
from devgraph.reference.config import ATTENTION_MODES, PRESET_NAMES, ReferenceConfig
from devgraph.reference.inputs import (
    StepContext,
    batch_context,
    decode_context,
    make_decode_batch,
    make_prefill_batch,
    make_verify_batch,
    padding_fill,
    prefill_context,
    reference_inputs,
)
from devgraph.reference.model import ReferenceModel
from devgraph.reference.runners import decode_runner, prefill_runner, verify_runner

__all__ = [
    "ATTENTION_MODES",
    "ATTENTION_OP_NAME",
    "PRESET_NAMES",
    "PagedMetadata",
    "ReferenceConfig",
    "ReferenceModel",
    "StepContext",
    "batch_context",
    "decode_context",
    "decode_runner",
    "make_decode_batch",
    "make_prefill_batch",
    "make_verify_batch",
    "padding_fill",
    "prefill_context",
    "prefill_runner",
    "reference_inputs",
    "sdpa_attention",
    "verify_runner",
]
