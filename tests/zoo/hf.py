"""Hugging Face decoders (Llama, Qwen3, Mistral, Gemma, Phi-3, GPT-2, Mixtral) from their config classes with
random weights, decoding through ``GraphRunner`` directly with a static cache (devgraph's
``SharedStaticCache``: one ``StaticCache`` for the largest batch, a view of its first rows per size).

A Hugging Face static cache writes every row at one position, kept in a 0-d tensor per layer that each
forward advances (``cumulative_length``): the runner declares those as state, and each key's warm-ups
start from position 0 (``capture_context``). Mixtral routes tokens with ``experts_implementation=
"batched_mm"``: the default ``eager`` experts loop over ``nonzero()``, a host sync no graph can hold
(``mixtral_eager_experts`` in the zoo test shows the refusal)."""

from __future__ import annotations

from typing import Any

import torch

from devgraph import StaticInput
from zoo.base import Shape, ZooModel


def _config(name: str, shape: Shape) -> Any:
    import transformers as tf

    s = shape
    common = {
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "max_position_embeddings": max(s.max_len, 64),
        "pad_token_id": 0,
    }
    if name == "llama":
        return tf.LlamaConfig(**common, head_dim=s.head_dim)
    if name == "qwen3":
        return tf.Qwen3Config(**common, head_dim=s.head_dim, tie_word_embeddings=True)
    if name == "mistral":
        return tf.MistralConfig(**common, head_dim=s.head_dim, sliding_window=None)
    if name == "gemma":
        return tf.GemmaConfig(**common, head_dim=s.head_dim)
    if name == "phi3":
        # Phi-3 derives head_dim from hidden / heads; its default pad token (32000) lies past a small vocab.
        return tf.Phi3Config(**common, sliding_window=None)
    if name == "mixtral":
        return tf.MixtralConfig(
            **common,
            head_dim=s.head_dim,
            sliding_window=None,
            num_local_experts=s.experts,
            num_experts_per_tok=2,
        )
    if name == "gpt2":
        return tf.GPT2Config(
            vocab_size=s.vocab,
            n_positions=max(s.max_len, 64),
            n_embd=s.hidden,
            n_layer=s.layers,
            n_head=s.heads,
            n_inner=s.intermediate,
            pad_token_id=0,
        )
    raise KeyError(name)


def batched_experts() -> bool:
    """Whether this transformers routes Mixtral's experts without a host sync (``batched_mm``)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return False
    return "batched_mm" in getattr(getattr(moe, "ExpertsInterface", None), "_global_mapping", {})


def build_hf(
    name: str, shape: Shape, device: str, dtype: torch.dtype, experts: str = "batched_mm"
) -> ZooModel:
    import transformers as tf

    from devgraph.integrations.hf.cache import SharedStaticCache
    from devgraph.integrations.hf.features import find_features

    config = _config(name, shape)
    config._attn_implementation = "sdpa"
    if name == "mixtral":
        config._experts_implementation = experts
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a real-size vocabulary is slow to fill on a CPU
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    cache = SharedStaticCache(model, shape.max_batch, shape.max_len)
    # Every view built here, outside any compile: building one inside the forward that tc_piecewise and
    # compiled `full` trace fails on torch 2.11 (dynamo cannot trace StaticLayer.__dict__.update).
    for rows in range(1, shape.max_batch + 1):
        cache.view(rows)
    argument = find_features(model).cache_argument
    mask = torch.ones(shape.max_batch, shape.max_len, dtype=torch.bool, device=device)

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        rows = input_ids.shape[0]
        out = model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask[:rows],
            use_cache=True,
            **{argument: cache.view(rows)},
        )
        return out.logits

    def make_step(n: int, seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, shape.vocab, (n, 1), generator=generator)
        position = cache.position()  # every row writes where the cache's write position is
        return {"input_ids": ids.to(device), "position_ids": torch.full((n, 1), position, device=device)}

    def rewind(key: Any) -> None:
        cache.rewind()  # each key's warm-ups start at position 0 (the runner restores it after capture)

    heads, head_dim = cache.full.layers[0].keys.shape[1], cache.full.layers[0].keys.shape[3]
    element = torch.empty((), dtype=dtype).element_size()
    return ZooModel(
        name=f"hf_{name}",
        forward=forward,
        inputs={
            "input_ids": StaticInput(torch.long, (1,), fill=0),
            "position_ids": StaticInput(torch.long, (1,), fill=0),
        },
        make_step=make_step,
        module=model,
        state=list(cache.write_positions),
        capture_context=rewind,
        kv_bytes=lambda rows: 2 * rows * shape.layers * heads * shape.max_len * head_dim * element,
        notes=(f"transformers {tf.__version__}",),
    )
