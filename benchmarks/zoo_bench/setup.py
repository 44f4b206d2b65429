"""The zoo at the benchmark's shape: which models, their cases (one seeded step per batch size), and the
reset a step needs before it is timed (a Hugging Face cache's write position goes back to where every
variant starts, so each variant computes the same step)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TESTS = Path(__file__).resolve().parents[2] / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import zoo  # noqa: E402  (tests/zoo: the models the CPU suite checks)

DECODERS = [name for name in zoo.MODELS if name != "hf_bert"]
#: Where a Hugging Face cache writes during the benchmark (all rows at one position).
HF_POSITION = 256


@dataclass
class Plan:
    shape: zoo.Shape
    dtype: torch.dtype
    device: str
    batches: list[int]
    iters: int
    rounds: int
    budget_s: float
    per_model_s: float  # a model's estimated cost (half here, half in the reduce-overhead process)


def plan_for(smoke: bool, layers: int | None, batches: list[int] | None) -> Plan:
    if smoke:
        shape = zoo.CPU_TINY.with_(max_batch=8)
        return Plan(shape, torch.float32, "cpu", batches or [1, 2, 8], 6, 2, 240.0, 20.0)
    shape = zoo.QWEN3_06B_LIKE.with_(layers=layers or 8)
    return Plan(shape, torch.bfloat16, "cuda", batches or [1, 8, 32, 64], 45, 3, 450.0, 110.0)


@dataclass
class Built:
    """A zoo model built for the benchmark, its cases and the reset run before every timed step."""

    name: str
    model: zoo.ZooModel
    cases: dict[str, dict[str, torch.Tensor]]
    reset: Callable[[], None]
    out_row_bytes: int  # bytes of one row of output (a row of logits)

    def bytes_floor(self, batch: int) -> dict[str, int]:
        """What one step must move at least: every weight once, the KV it reads, its output."""
        return {
            "weights": self.model.weight_bytes(),
            "kv_read": self.model.kv_bytes(batch),
            "output": batch * self.out_row_bytes,
        }


def build(name: str, plan: Plan) -> Built:
    model = zoo.build(name, plan.shape, plan.device, plan.dtype)
    reset = _hf_reset(model) if name.startswith("hf_") and model.phase == "decode" else (lambda: None)
    reset()
    cases = {f"bs{b}": model.make_step(b, seed=b) for b in plan.batches}
    elem = torch.empty((), dtype=plan.dtype).element_size()
    width = plan.shape.hidden * 16 if model.phase == "encode" else plan.shape.vocab  # BERT: 16 hidden rows
    return Built(name, model, cases, reset, width * elem)


def _hf_reset(model: zoo.ZooModel) -> Callable[[], None]:
    positions: list[torch.Tensor] = list(model.state or [])
    length = model.module.config.max_position_embeddings
    start = [torch.full_like(p, min(HF_POSITION, length // 4)) for p in positions]

    def reset() -> None:
        for position, value in zip(positions, start, strict=True):
            position.copy_(value)

    return reset


def release(built: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
