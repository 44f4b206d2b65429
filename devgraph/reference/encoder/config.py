"""Shape and dtype of the reference vision encoder, with named presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from devgraph import ConfigError
from devgraph.messages import shorten
from devgraph.reference.config_rules import check_kernels, check_positive_ints, preset_values

__all__ = ["ENCODER_ATTENTION", "ENCODER_PRESETS", "VisionConfig"]

#: ``varlen``: block-diagonal attention reading ``cu_seqlens`` from a device tensor (one graph serves every
#: split of a token count); ``sdpa``: a break op running SDPA per image from host lengths in the context.
ENCODER_ATTENTION: tuple[str, ...] = ("varlen", "sdpa")

_PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for CPU tests: two blocks, hidden 64.
    "tiny": dict(
        patch_dim=48,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        out_hidden_size=96,
        dtype=torch.float32,
    ),
    # Qwen2-VL's vision tower (2B/7B share it): 14x14 patches of 2 frames x 3 channels = 1176 values,
    # 32 blocks of hidden 1280 (16 heads of 80), MLP 5120, merged into Qwen2-VL-2B's hidden size 1536.
    "qwen2-vl": dict(
        patch_dim=1176,
        hidden_size=1280,
        num_layers=32,
        num_heads=16,
        intermediate_size=5120,
        out_hidden_size=1536,
        dtype=torch.bfloat16,
    ),
}

ENCODER_PRESETS: tuple[str, ...] = tuple(_PRESETS)

_POSITIVE_INTS = (
    "patch_dim",
    "hidden_size",
    "num_layers",
    "num_heads",
    "intermediate_size",
    "out_hidden_size",
    "spatial_merge",
)


@dataclass(frozen=True)
class VisionConfig:
    """Shape of a :class:`~devgraph.reference.encoder.VisionEncoder` (a Qwen2-VL-style ViT).

    ``patch_dim``: values of one flattened patch (the patch embedding is one linear layer over them).
    ``spatial_merge``: the merger joins ``spatial_merge x spatial_merge`` neighbouring patches into one
    output token, so an image grid's height and width must be multiples of it.
    ``window_size``: 0 (every block attends within each image, as in Qwen2-VL) or the side, in merged
    tokens, of the square windows the blocks not in ``full_attention_blocks`` attend within (Qwen2.5-VL:
    4 merged tokens = 112 pixels, full attention in blocks 7, 15, 23, 31).
    ``attention``: ``varlen`` or ``sdpa`` (see :data:`ENCODER_ATTENTION`); ``kernels``: ``auto`` (Triton
    on a GPU when it imports, else the torch reference), ``triton`` or ``torch``.
    """

    patch_dim: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    spatial_merge: int = 2
    window_size: int = 0
    full_attention_blocks: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    attention: str = "varlen"
    kernels: str = "auto"

    def __post_init__(self) -> None:
        check_positive_ints(self, _POSITIVE_INTS)
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"VisionConfig.hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_heads})"
            )
        if self.head_dim % 4:
            raise ConfigError(
                f"VisionConfig head_dim (hidden_size / num_heads = {self.head_dim}) must be a multiple of 4: "
                "the 2-D rotary embedding gives a quarter of it to each of the row and column angles"
            )
        if (
            isinstance(self.window_size, bool)
            or not isinstance(self.window_size, int)
            or self.window_size < 0
        ):
            raise ConfigError(
                f"VisionConfig.window_size must be an int >= 0, got {shorten(self.window_size)}"
            )
        blocks = self.full_attention_blocks
        if not isinstance(blocks, tuple) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < self.num_layers for b in blocks
        ):
            raise ConfigError(
                "VisionConfig.full_attention_blocks must be a tuple of block indices in "
                f"[0, {self.num_layers}), got {shorten(blocks)}"
            )
        if blocks and not self.window_size:
            raise ConfigError(
                "VisionConfig.full_attention_blocks only applies with windowed attention; "
                "set window_size > 0 or leave it empty"
            )
        if self.attention not in ENCODER_ATTENTION:
            raise ConfigError(
                f"VisionConfig.attention {shorten(self.attention)} is unknown; "
                f"accepted: {', '.join(ENCODER_ATTENTION)}"
            )
        check_kernels(self, self.kernels)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError(f"VisionConfig.dtype must be a floating torch.dtype, got {shorten(self.dtype)}")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ConfigError(
                "VisionConfig.rope_theta and norm_eps must be > 0, "
                f"got {self.rope_theta!r} and {self.norm_eps!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per merged output token (``spatial_merge ** 2``)."""
        return self.spatial_merge**2

    @property
    def windowed(self) -> bool:
        return self.window_size > 0

    def attends_per_image(self, block: int) -> bool:
        """Whether ``block`` attends within whole images (else within windows)."""
        return not self.windowed or block in self.full_attention_blocks

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> VisionConfig:
        """A named preset (``"tiny"`` or ``"qwen2-vl"``) with any field overridden."""
        return cls(**preset_values(cls, "vision encoder", _PRESETS, name, overrides))
