"""What ``serve_tp_check.py`` runs: two checkpoints, each served on one device and under ``--tp 2``.

``small``: the Llama shape earlier rounds measured (hidden 1024, 8 layers): where tensor parallelism
cannot pay, ``--tp 2`` should cost little (ITL at most 1.1x one GPU's). ``8b``: Llama-3-8B's shape, random
bf16 weights (16 GB): where it must pay (ITL at c=1 at most 0.6x one GPU's, tokens/s at c=64 at least
1.6x). ``--smoke`` runs the same sections on the CPU with tiny shapes (it checks the script, not speed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from checkpoints import LLAMA3_8B

__all__ = ["GPU", "SMOKE", "Load", "Model", "Plan"]


@dataclass(frozen=True)
class Load:
    """One load phase: ``requests`` streamed requests, ``concurrency`` in flight, prompts of ``prompt``
    random ids (bounds), ``output`` new tokens each (``ignore_eos``)."""

    name: str
    concurrency: int
    requests: int
    prompt: tuple[int, int]
    output: int


@dataclass(frozen=True)
class Model:
    name: str
    shape: dict[str, Any]
    flags: tuple[str, ...]  # server flags besides --model, --device and --tp
    loads: tuple[Load, ...]
    start_s: float  # what one server's start-up may take (checked against the budget)
    prompts: int = 8  # greedy prompts compared between one device and --tp 2
    new_tokens: int = 32


@dataclass(frozen=True)
class Plan:
    device: str
    models: tuple[Model, ...]
    time_budget: float
    #: float32 greedy agreement on the small checkpoint, when the budget allows (bf16 rounds differently
    #: on two ranks: their tokens part after a while; float32 ones should not).
    fp32_check: bool = True


_SMALL_SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=2048,
    vocab_size=32000,
)
_LIMITS = ("--max-running-requests", "64", "--token-budget", "1024", "--max-seq-len", "1024")

GPU = Plan(
    device="cuda",
    models=(
        Model(
            "small",
            _SMALL_SHAPE,
            _LIMITS,
            (
                Load("c1", 1, 12, (32, 128), 64),
                Load("c32", 32, 96, (32, 256), 64),
            ),
            start_s=45,
        ),
        Model(
            "8b",
            LLAMA3_8B,
            _LIMITS,
            (
                Load("c1", 1, 6, (128, 128), 128),
                Load("c32", 32, 64, (64, 256), 128),
                Load("c64", 64, 128, (64, 256), 128),
            ),
            start_s=100,
        ),
    ),
    time_budget=400,
)

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
SMOKE = Plan(
    device="cpu",
    models=(
        Model(
            "small",
            {**_TINY, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256},
            ("--max-running-requests", "8", "--token-budget", "64", "--cpu-threads", "1"),
            (Load("c1", 1, 2, (8, 16), 8), Load("c32", 4, 8, (8, 32), 8)),
            start_s=60,
            prompts=4,
            new_tokens=8,
        ),
        Model(
            "8b",
            {**_TINY, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3, "vocab_size": 1024},
            (
                "--max-running-requests",
                "8",
                "--token-budget",
                "64",
                "--max-seq-len",
                "256",
                "--cpu-threads",
                "1",
            ),
            (Load("c1", 1, 2, (8, 16), 8), Load("c32", 4, 8, (8, 32), 8), Load("c64", 8, 8, (8, 32), 8)),
            start_s=60,
            prompts=4,
            new_tokens=8,
        ),
    ),
    time_budget=600,
    fp32_check=False,
)
