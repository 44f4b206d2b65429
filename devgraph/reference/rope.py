"""Rotary position embeddings of the reference decoder: frequencies, scaling, tables, rotation.

The arithmetic follows Hugging Face transformers' Llama-family rotary embedding step for step, so a
checkpoint served by the reference model rotates queries and keys to the same bits as transformers on the
same device: inverse frequencies in float32 (``1 / theta ** (arange(0, D, 2) / D)``), angles
``position * inv_freq`` in float32, ``cos``/``sin`` in float32 cast to the model's dtype, and the rotation
``x * cos + rotate_half(x) * sin`` in the model's dtype, one rounding per elementwise op.

Scalings (:class:`RopeScaling`) are the ones a fixed table can express exactly:

* ``default``: none;
* ``linear``: every frequency divided by ``factor`` (positions interpolated);
* ``llama3``: Llama 3.1's frequency-dependent scaling (low frequencies divided by ``factor``, high ones
  kept, a smooth blend between ``low_freq_factor`` and ``high_freq_factor`` of the original context).

Scalings whose frequencies depend on the running sequence length (``dynamic`` past the original context,
``longrope``) or that rescale attention (``yarn``) are not expressed here; the checkpoint loader refuses
them or, where the context never reaches the point at which they differ from ``default``, maps them to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from devgraph import ConfigError

__all__ = ["ROPE_KINDS", "RopeScaling", "apply_rope", "inverse_frequencies", "rope_tables"]

#: The scalings :class:`RopeScaling` expresses.
ROPE_KINDS: tuple[str, ...] = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are scaled (see the module docstring). ``factor`` is used by ``linear`` and
    ``llama3``; ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings`` by
    ``llama3`` only."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ConfigError(f"RopeScaling.kind {self.kind!r} is unknown; accepted: {', '.join(ROPE_KINDS)}")
        numbers = {
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
        }
        for name, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"RopeScaling.{name} must be a finite number > 0, got {value!r}")
        if self.kind == "llama3":
            if self.high_freq_factor <= self.low_freq_factor:
                raise ConfigError(
                    "RopeScaling: llama3 needs high_freq_factor > low_freq_factor, got "
                    f"{self.high_freq_factor} and {self.low_freq_factor}"
                )
            context = self.original_max_position_embeddings
            if isinstance(context, bool) or not isinstance(context, int) or context < 1:
                raise ConfigError(
                    f"RopeScaling.original_max_position_embeddings must be an int >= 1, got {context!r}"
                )


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """``[head_dim / 2]`` float32 inverse frequencies on the CPU, computed as transformers computes them
    (at model construction, on the CPU, before the model moves to its device)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    context = s.original_max_position_embeddings
    low_freq_wavelen = context / s.low_freq_factor
    high_freq_wavelen = context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    head_dim: int,
    theta: float,
    scaling: RopeScaling,
    positions: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[positions, head_dim / 2]`` in ``dtype``, indexed by position.

    The angles and their cosines are computed in float32 on ``device`` (where transformers computes them
    for a model on that device) and then cast, as transformers casts them before rotating.
    """
    inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
    angles = torch.arange(positions, device=device, dtype=torch.float)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [N, heads, D]`` with ``cos``/``sin [N, 1, D/2]`` in ``x``'s dtype.

    ``x1 * cos - x2 * sin`` equals transformers' ``x * cos + rotate_half(x) * sin`` on the first half bit for
    bit (negation is exact), and ``x2 * cos + x1 * sin`` on the second.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
