"""A zoo of decoders and an encoder nobody here wrote, restated from public patterns, for the strategies.

Each entry builds a model at a :class:`Shape` (tiny for the CPU suite, Qwen3-0.6B-like for the GPU
benchmark) and hands back a :class:`ZooModel`: the forward a ``GraphRunner`` captures, its static inputs,
the state it declares, and a function making one step's inputs. The patterns:

* ``plain``: a static KV cache ``[layers, batch, kv_heads, positions, head_dim]`` written in place with
  ``cache[i, rows, :, pos] = k`` (``pos`` a tensor), SDPA with a boolean mask (many engines' first decoder);
* ``gptfast``: gpt-fast's layout, a ``KVCache`` module per layer updated with ``index_copy_`` at
  ``input_pos``, fused ``wqkv``, ``repeat_interleave`` for grouped heads;
* ``paged``: vLLM's layout, a flat paged cache per layer (``slot_mapping``, ``block_tables``, ``seq_lens``)
  and attention as a break op that calls the cache-write break op inside it (nested, as vLLM's are);
* ``hf_*``: Hugging Face Llama, Qwen3, Mistral, Gemma, Phi-3, GPT-2 and Mixtral from their config classes
  (random weights), driven through ``GraphRunner`` with a static cache;
* ``hf_bert``: a Hugging Face BERT encoder (phase ``encode``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zoo.base import CPU_TINY, QWEN3_06B_LIKE, Shape, ZooModel

__all__ = ["CPU_TINY", "MODELS", "QWEN3_06B_LIKE", "Shape", "ZooModel", "build"]


def _plain(shape: Shape, device: str, dtype: Any) -> ZooModel:
    from zoo.plain import build_plain

    return build_plain(shape, device, dtype)


def _gptfast(shape: Shape, device: str, dtype: Any) -> ZooModel:
    from zoo.gptfast import build_gptfast

    return build_gptfast(shape, device, dtype)


def _paged(shape: Shape, device: str, dtype: Any) -> ZooModel:
    from zoo.paged import build_paged

    return build_paged(shape, device, dtype)


def _hf(name: str) -> Callable[[Shape, str, Any], ZooModel]:
    def build_one(shape: Shape, device: str, dtype: Any) -> ZooModel:
        from zoo.hf import build_hf

        return build_hf(name, shape, device, dtype)

    return build_one


def _bert(shape: Shape, device: str, dtype: Any) -> ZooModel:
    from zoo.encoder import build_bert

    return build_bert(shape, device, dtype)


#: Every zoo model by name; the Hugging Face ones need transformers.
MODELS: dict[str, Callable[[Shape, str, Any], ZooModel]] = {
    "plain": _plain,
    "gptfast": _gptfast,
    "paged": _paged,
    **{f"hf_{name}": _hf(name) for name in ("llama", "qwen3", "mistral", "gemma", "phi3", "gpt2", "mixtral")},
    "hf_bert": _bert,
}


def build(name: str, shape: Shape, device: str = "cpu", dtype: Any = None) -> ZooModel:
    """The zoo model ``name`` at ``shape`` (``dtype`` defaults to float32)."""
    import torch

    return MODELS[name](shape, device, dtype or torch.float32)
