"""What the decode benchmark runs: the GPU plan (the Qwen3-0.6B shape) and the ``--smoke`` plan (the tiny
preset on the CPU simulator), and the names of its cases."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GPU", "SMOKE", "Plan", "decode_case", "prefill_case"]


@dataclass(frozen=True)
class Plan:
    preset: str
    decode_batches: tuple[int, ...]  # also the captured decode sizes
    contexts: tuple[int, ...]
    prefill_cases: tuple[tuple[int, ...], ...]
    prefill_sizes: tuple[int, ...]
    verify_batches: tuple[int, ...]
    verify_context: int
    draft_tokens: int
    iters: int
    rounds: int
    warm_steps: int
    host_iters: int
    breaks: int
    probe_layers: int
    layers: int | None  # None: the preset's
    max_requests: int | None  # None: the preset's (also the prefill request bucket)
    warmups: tuple[int, ...]
    private_blocks: int
    bandwidth_bytes: int
    compiler: str  # of the compiled full variant and of the reduce-overhead stand-in
    budget_s: float


GPU = Plan(
    preset="qwen3-0.6b",
    decode_batches=(1, 8, 32, 64),
    contexts=(512, 2048),
    prefill_cases=((32,), (128,), (512,), (128, 128, 128, 128)),
    prefill_sizes=(32, 128, 512),
    verify_batches=(1, 8, 32),
    verify_context=512,
    draft_tokens=3,
    iters=40,
    rounds=4,
    warm_steps=3,
    host_iters=400,
    breaks=28,
    probe_layers=4,
    layers=None,
    max_requests=None,
    warmups=(0, 1, 2),
    private_blocks=512,
    bandwidth_bytes=1 << 30,
    compiler="inductor",
    budget_s=300.0,
)


SMOKE = Plan(
    preset="tiny",
    decode_batches=(1, 4),
    contexts=(40, 200),
    prefill_cases=((8,), (16,), (4, 4, 4, 4)),
    prefill_sizes=(16,),
    verify_batches=(1, 2),
    verify_context=64,
    draft_tokens=3,
    iters=2,
    rounds=1,
    warm_steps=1,
    host_iters=20,
    breaks=4,
    probe_layers=1,
    layers=1,
    max_requests=8,  # the torch reference prefill attention loops over the request bucket
    warmups=(0, 2),
    private_blocks=128,
    bandwidth_bytes=32 << 20,
    compiler="eager",  # inductor's CPU code generation takes minutes on two cores
    budget_s=600.0,
)


def decode_case(batch: int, context: int) -> str:
    return f"b{batch}@{context}"


def prefill_case(lens: Sequence[int]) -> str:
    return f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens))
