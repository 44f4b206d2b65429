"""What the integration refuses (models, ``generate()`` arguments) and which calls it hands back to Hugging
Face's own loop (counted by reason, never silently)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from devgraph import ConfigError
from devgraph.integrations.hf.features import CACHE_ARGUMENTS, ModelFeatures, find_features
from devgraph.messages import shorten

__all__ = ["FALLBACK_REASONS", "Route", "check_model", "check_generate_kwargs", "route_generate"]

#: Attention implementations whose decode step builds its mask from the 2-D mask and the cache's device-side
#: write position (checked on the CPU simulator and on CUDA).
SUPPORTED_ATTENTION = ("sdpa", "eager")
#: Generation modes the devgraph loop runs (``GenerationMode`` values); others run HF's own loop.
GRAPH_MODES = ("greedy_search", "sample")
#: generate() keywords that hand it a cache (``cache_params``: older state-space models' name).
USER_CACHE_ARGUMENTS = (*CACHE_ARGUMENTS, "cache_params")

FALLBACK_REASONS = (
    "past_largest",  # more rows (batch x num_return_sequences) than the shared cache holds
    "generation_mode",  # beam search, assisted, contrastive, DoLa, ...: HF's loop
    "longer_than_cache",  # prompt + new tokens past max_cache_len
    "inputs_embeds",  # no input_ids to decode from
    "extra_outputs",  # output_attentions / output_hidden_states: per-step tensors the graph does not keep
    "prefill_chunking",  # prefill_chunk_size
    "no_cache",  # use_cache=False
)


def check_model(model: Any) -> ModelFeatures:
    """How to drive ``model`` under the installed transformers, or :class:`ConfigError` for models the
    integration cannot decode (the cache layers are checked by
    :class:`~devgraph.integrations.hf.cache.SharedStaticCache`)."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "generate", None)):
        raise ConfigError(
            "DevgraphDecoder needs a transformers causal LM with generate() (a GenerationMixin model such "
            f"as LlamaForCausalLM), got {shorten(model)}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"{name} is an encoder-decoder model; DevgraphDecoder decodes decoder-only causal LMs "
            "(Llama, Qwen3, ...). Use model.generate() for it"
        )
    attention = getattr(config, "_attn_implementation", None)
    if attention not in SUPPORTED_ATTENTION:
        raise ConfigError(
            f"{name} uses attn_implementation={attention!r}; DevgraphDecoder supports {SUPPORTED_ATTENTION} "
            "(their decode mask is built on the device from the cache's write position). Load the model "
            "with attn_implementation='sdpa'"
        )
    if model.training:
        raise ConfigError(f"{name} is in training mode (dropout would be captured): call model.eval() first")
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        raise ConfigError(
            f"{name} has parameters on {sorted(map(str, devices))}; DevgraphDecoder needs the whole model on "
            "one device (no device_map sharding, no meta tensors)"
        )
    return find_features(model)


def check_generate_kwargs(kwargs: dict[str, Any]) -> None:
    """:class:`ConfigError` for ``generate()`` arguments that cannot work with the decoder's own cache."""
    if kwargs.get("synced_gpus"):
        raise ConfigError(
            "DevgraphDecoder.generate() does not support synced_gpus=True (DeepSpeed ZeRO-3 / FSDP lock-step "
            "decoding): every rank would need the same number of graph replays. Call model.generate() instead"
        )
    for name, why in (
        ("custom_generate", "it supplies its own decode loop"),
        *((cache, "it owns the static cache its graphs read") for cache in USER_CACHE_ARGUMENTS),
        ("cache_implementation", "it owns the static cache its graphs read (sized by max_cache_len=)"),
    ):
        if kwargs.get(name) is not None:
            raise ConfigError(f"DevgraphDecoder.generate() takes no {name}=: {why}")


@dataclass(frozen=True)
class Route:
    """How a ``generate()`` call runs: on the graphs (``reason`` None) with ``rows`` rows, or in HF's loop."""

    rows: int
    reason: str | None
    detail: str = ""


def _merged_config(model: Any, generation_config: Any, kwargs: dict[str, Any]) -> Any:
    """The generation config ``generate()`` will use (HF's own merge where it exists)."""
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is not None:
        try:
            return prepare(generation_config, **copy.copy(kwargs))[0]
        except Exception:  # a transformers release changed the private helper: merge the public way
            pass
    merged = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    merged.update(**kwargs)
    return merged


def _has_default_max_length(model: Any, generation_config: Any, kwargs: dict[str, Any]) -> bool:
    """HF's rule: no max_length in the call, the given config or the model's config -> 20 new tokens."""
    return (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )


def _positions_needed(model: Any, generation_config: Any, config: Any, width: int, kwargs: dict) -> int:
    """Cache positions the call needs: prompt + new tokens, as ``generate()`` sizes ``max_length``."""
    if config.max_new_tokens is not None:
        return width + int(config.max_new_tokens)
    if _has_default_max_length(model, generation_config, kwargs):
        return width + int(config.max_length or 20)
    return int(config.max_length)


def route_generate(
    model: Any,
    input_ids: torch.Tensor | None,
    generation_config: Any,
    kwargs: dict[str, Any],
    *,
    max_batch: int,
    max_cache_len: int,
) -> Route:
    """Whether a ``generate()`` call runs on the graphs, and with how many rows."""
    if input_ids is None:
        return Route(0, "inputs_embeds", "no input_ids")
    config = _merged_config(model, generation_config, kwargs)
    returns = max(1, int(getattr(config, "num_return_sequences", 1) or 1))
    rows = int(input_ids.shape[0]) * returns
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    mode_name = getattr(mode, "value", str(mode))
    if mode_name not in GRAPH_MODES:
        return Route(rows, "generation_mode", mode_name)
    if config.use_cache is False:
        return Route(rows, "no_cache", "use_cache=False")
    if getattr(config, "prefill_chunk_size", None) is not None:
        return Route(rows, "prefill_chunking", f"prefill_chunk_size={config.prefill_chunk_size}")
    if config.output_attentions or config.output_hidden_states:
        return Route(rows, "extra_outputs", "output_attentions / output_hidden_states")
    if rows > max_batch:
        return Route(rows, "past_largest", f"{rows} rows > max_batch {max_batch}")
    needed = _positions_needed(model, generation_config, config, int(input_ids.shape[1]), kwargs)
    if needed > max_cache_len:
        return Route(rows, "longer_than_cache", f"{needed} positions > max_cache_len {max_cache_len}")
    return Route(rows, None)
