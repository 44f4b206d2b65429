"""What ``bench_serve_checkpoint.py`` runs on the GPU and, shrunk, on the CPU (``--smoke``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["GPU", "SMOKE", "Plan", "QWEN3_06B"]

#: Qwen3-0.6B's config (28 layers, hidden 1024, 16 query / 8 KV heads of 128, per-head q/k norms, tied
#: embeddings, vocab 151936); the weights are random.
QWEN3_06B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
TINY = {**QWEN3_06B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
INDUCTOR_DECODE = '{"decode": {"backend": "full", "compiler": "inductor"}}'


@dataclass(frozen=True)
class Plan:
    device: str
    shape: dict[str, Any]
    dtype: str
    #: The oracle: prompts of random token ids (lengths in this range), greedy, this many new tokens each.
    prompts: int
    prompt_len: tuple[int, int]
    new_tokens: int
    #: HF compiled static-cache generate(): batch sizes, prompt length, new tokens, timed calls.
    hf_batches: tuple[int, ...]
    hf_prompt_len: int
    hf_new_tokens: int
    hf_repeats: int
    hf_compile: bool
    #: devgraph serve: the flags every server gets, then one configuration per name (in priority order).
    server: list[str]
    configs: dict[str, list[str]]
    #: Load scenarios per server: name -> (concurrency, requests, trace seed); lengths of the trace.
    scenarios: dict[str, tuple[int, int, int]]
    trace_prompt_len: tuple[int, int]
    trace_output_len: tuple[int, int]
    warmup: int
    start_timeout: float
    #: Seconds each configuration is expected to need (the budget skips what would not fit).
    estimates: dict[str, float] = field(default_factory=dict)
    #: Configurations that only answer the oracle prompts (no load scenarios: their speed is not a target).
    oracle_only: tuple[str, ...] = ()
    time_budget: float = 450.0


GPU = Plan(
    device="cuda",
    shape=QWEN3_06B,
    dtype="bfloat16",
    prompts=8,
    prompt_len=(16, 200),
    new_tokens=64,
    hf_batches=(1, 32),
    hf_prompt_len=128,
    hf_new_tokens=128,
    hf_repeats=2,
    hf_compile=True,
    server=[
        "--device",
        "cuda",
        "--max-running-requests",
        "32",
        "--token-budget",
        "2048",
        "--max-seq-len",
        "1024",
    ],
    configs={
        "deterministic": ["--deterministic"],
        "default": [],
        "deterministic_fp32": ["--deterministic", "--dtype", "float32"],
        "inductor_decode": ["--device-graph-mode", INDUCTOR_DECODE],
    },
    scenarios={"c1": (1, 16, 1), "c32": (32, 64, 0)},
    trace_prompt_len=(32, 256),
    trace_output_len=(64, 128),
    warmup=12,
    start_timeout=300.0,
    estimates={
        "deterministic": 60,
        "default": 60,
        "inductor_decode": 110,
        "deterministic_fp32": 75,
        "hf": 140,
    },
    time_budget=420.0,
)
SMOKE = Plan(
    device="cpu",
    shape=TINY,
    dtype="float32",
    prompts=4,
    prompt_len=(4, 40),
    new_tokens=12,
    hf_batches=(1, 4),
    hf_prompt_len=16,
    hf_new_tokens=12,
    hf_repeats=1,
    hf_compile=False,
    server=["--device", "cpu", "--cpu-threads", "1", "--max-running-requests", "4", "--token-budget", "64"],
    configs={"deterministic": ["--deterministic"], "default": [], "deterministic_fp32": ["--deterministic"]},
    scenarios={"c1": (1, 3, 1), "c4": (4, 8, 0)},
    trace_prompt_len=(4, 40),
    trace_output_len=(4, 12),
    warmup=2,
    start_timeout=180.0,
    estimates={"deterministic": 20, "default": 20, "deterministic_fp32": 15, "hf": 10},
    oracle_only=("deterministic_fp32",),
    time_budget=180.0,
)
