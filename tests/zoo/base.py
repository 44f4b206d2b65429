"""What every zoo model hands back, the shapes it is built at, and the layers the hand-written ones share."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from devgraph import StaticInput


@dataclass(frozen=True)
class Shape:
    """A model's size; ``max_batch`` rows of cache, ``max_len`` positions per row."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_batch: int
    max_len: int
    experts: int = 4  # Mixtral only

    def with_(self, **changes: Any) -> Shape:
        return replace(self, **changes)


#: The CPU suite's size: compiles and captures in a second or two.
CPU_TINY = Shape(
    layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, vocab=96, max_batch=4, max_len=32
)
#: Qwen3-0.6B's widths: 28 layers, hidden 1024, 16 query / 8 key-value heads of 128, MLP 3072, vocab 151936.
QWEN3_06B_LIKE = Shape(
    layers=28,
    hidden=1024,
    heads=16,
    kv_heads=8,
    head_dim=128,
    intermediate=3072,
    vocab=151936,
    max_batch=64,
    max_len=1024,
)


@dataclass
class ZooModel:
    """A model ready for ``GraphRunner(forward, phase=phase, inputs=inputs, state=state, ...)``.

    ``make_step(n, seed)`` returns one step's inputs for ``n`` rows (tokens of decode, sequences of encode);
    ``capture_context`` (optional) is the runner's per-key hook; ``module`` is the ``nn.Module`` holding the
    weights (for byte counts); ``bytes_per_row`` the KV bytes one row reads at ``context`` positions.
    """

    name: str
    forward: Callable[..., Any]
    inputs: Mapping[str, StaticInput]
    make_step: Callable[[int, int], dict[str, torch.Tensor]]
    module: torch.nn.Module
    phase: str = "decode"
    state: Any = None
    capture_context: Callable[[Any], Any] | None = None
    kv_bytes: Callable[[int], int] = lambda rows: 0
    notes: Sequence[str] = field(default_factory=tuple)

    def runner_kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"phase": self.phase, "inputs": dict(self.inputs), "state": self.state}
        if self.capture_context is not None:
            out["capture_context"] = self.capture_context
        return out

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


# -- layers of the hand-written decoders --------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope_tables(
    max_len: int, head_dim: int, device: Any, base: float = 1e6
) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv)
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, heads, head_dim]``; ``cos``/``sin`` ``[rows, head_dim]`` (each row's position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos[:, None] + rotated.float() * sin[:, None]).to(x.dtype)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def init_(module: torch.nn.Module, seed: int = 0) -> None:
    """Random weights with a scale that keeps activations near 1 (a real model's order of magnitude)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("norm") or "norm" in name.split(".")[-1]:
                p.fill_(1.0)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                values = torch.randn(p.shape, generator=generator) / max(fan_in, 1) ** 0.5
                p.copy_(values.to(p.dtype))


def row_positions(n: int, max_len: int) -> torch.Tensor:
    """Each row's position, the same for a row in every step: rows at different lengths (continuous
    batching), and a step writes only where every step writing that row writes, so no step reads what
    another step wrote (each step's output is a function of its own inputs, whatever ran before)."""
    return 1 + (7 + 13 * torch.arange(n)) % (max_len - 1)


def decode_step(shape: Shape, vocab: int, device: Any) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """Token ids (seeded) and per-row positions."""

    def make(n: int, seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (n,), generator=generator)
        return {"input_ids": ids.to(device), "positions": row_positions(n, shape.max_len).to(device)}

    return make
