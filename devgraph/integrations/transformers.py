"""Hugging Face transformers ``generate()`` with its decode steps on device graphs.

``pip install 'devgraph[transformers]'``; transformers is imported when a decoder is built, not when this
module is imported. See docs/huggingface.md::

    from devgraph.integrations.transformers import DevgraphDecoder

    decoder = DevgraphDecoder(model, max_batch=8, max_cache_len=2048)    # allocates the cache, captures
    out = decoder.generate(**tokenizer(prompts, return_tensors="pt", padding=True).to("cuda"),
                           max_new_tokens=128)                           # what model.generate returns
    decoder.stats()                                                      # graph calls, fallbacks by reason
    decoder.close()

``fast=True`` (or a :class:`FastPath`) adds compiled regions and packed GQA attention inside the captured
decode steps: faster, with a compiled model's rounding instead of HF eager's.

Supported: transformers 5.17 to 5.24 (:data:`SUPPORTED`); every piece the integration uses is found by
signature or attribute, and one that is missing is refused naming the installed version and the piece.
"""

from __future__ import annotations

from devgraph.integrations.hf.cache import SharedStaticCache
from devgraph.integrations.hf.decoder import DevgraphDecoder
from devgraph.integrations.hf.fast import FastPath
from devgraph.integrations.hf.lib import (
    INSTALL_HINT,
    MAX_TESTED_VERSION,
    MIN_VERSION,
    SUPPORTED,
    TESTED_VERSIONS,
)
from devgraph.integrations.hf.support import FALLBACK_REASONS

__all__ = [
    "DevgraphDecoder",
    "FALLBACK_REASONS",
    "FastPath",
    "INSTALL_HINT",
    "MAX_TESTED_VERSION",
    "MIN_VERSION",
    "SUPPORTED",
    "SharedStaticCache",
    "TESTED_VERSIONS",
]
