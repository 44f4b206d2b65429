"""Shape and dtype of the reference model, with named presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from devgraph import ConfigError
from devgraph.reference.config_rules import check_kernels, check_positive_ints, preset_values
from devgraph.reference.rope import RopeScaling

__all__ = ["ReferenceConfig", "PRESET_NAMES", "ATTENTION_MODES", "DTYPE_NAMES", "parse_dtype"]

#: ``paged``: kernels over device metadata (capturable whole); ``sdpa``: a break op with host metadata.
ATTENTION_MODES: tuple[str, ...] = ("paged", "sdpa")

# Shapes only; dtype and limits that a caller commonly overrides are plain fields too.
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_requests=64,
        max_seq_len=256,
        block_size=16,
        dtype=torch.float32,
    ),
    # Qwen3-0.6B's shapes (without its per-head q/k norms); hidden_size != num_heads * head_dim there.
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        max_requests=64,
        max_seq_len=2048,
        block_size=16,
        dtype=torch.bfloat16,
    ),
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)

# Spellings accepted for ``dtype`` in :meth:`ReferenceConfig.preset` overrides (a command-line argument's).
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "max_requests",
    "max_seq_len",
    "block_size",
)


@dataclass(frozen=True)
class ReferenceConfig:
    """Shape of a :class:`~devgraph.reference.ReferenceModel`.

    The KV cache is paged: ``num_blocks`` blocks of ``block_size`` positions per layer (default: enough
    for ``max_requests`` requests of ``max_seq_len`` tokens, plus block 0, the scratch block padding rows
    write to). ``hidden_size`` need not equal ``num_heads * head_dim`` (it does not in Qwen3).
    ``attention``: ``paged`` (kernels that read block tables and lengths from device tensors, so a full
    graph replays any batch) or ``sdpa`` (a break op fed host-side lengths through the forward context).
    ``kernels``: ``auto`` (Triton on a GPU when it imports, else the torch reference), ``triton``, ``torch``.

    Features of the decoder families a checkpoint may come from: ``qkv_bias`` (Qwen2: biases on the q, k
    and v projections), ``qk_norm`` (Qwen3: an RMSNorm over each query and key head before RoPE),
    ``tie_embeddings`` (the LM head is the embedding; otherwise a weight of its own) and ``rope_scaling``
    (see :mod:`devgraph.reference.rope`).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_requests: int
    max_seq_len: int
    block_size: int = 16
    num_blocks: int | None = None
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    attention: str = "paged"
    kernels: str = "auto"
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = True
    rope_scaling: RopeScaling = RopeScaling()

    def __post_init__(self) -> None:
        check_positive_ints(self, _POSITIVE_INTS)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ReferenceConfig.num_heads ({self.num_heads}) must be divisible by "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.block_size & (self.block_size - 1) or self.block_size < 16:
            raise ConfigError(
                f"ReferenceConfig.block_size must be a power of two >= 16, got {self.block_size}"
            )
        if self.num_blocks is not None and (
            isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 2
        ):
            raise ConfigError(f"ReferenceConfig.num_blocks must be an int >= 2, got {self.num_blocks!r}")
        if self.attention not in ATTENTION_MODES:
            raise ConfigError(
                f"ReferenceConfig.attention {self.attention!r} is unknown; "
                f"accepted: {', '.join(ATTENTION_MODES)}"
            )
        check_kernels(self, self.kernels)
        if self.head_dim % 2:
            raise ConfigError(f"ReferenceConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_eps > 0:
            raise ConfigError(
                "ReferenceConfig.rope_theta and rms_eps must be > 0, "
                f"got {self.rope_theta!r} and {self.rms_eps!r}"
            )
        switches = {"qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm, "tie_embeddings": self.tie_embeddings}
        for name, value in switches.items():
            if not isinstance(value, bool):
                raise ConfigError(f"ReferenceConfig.{name} must be True or False, got {value!r}")
        if not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(
                f"ReferenceConfig.rope_scaling must be a RopeScaling, got {type(self.rope_scaling).__name__}"
            )
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError(
                f"ReferenceConfig.dtype must be a floating torch.dtype, got {self.dtype!r}; "
                f"accepted names in presets: {', '.join(DTYPE_NAMES)}"
            )

    @property
    def max_blocks_per_request(self) -> int:
        """Block-table width: blocks one request of ``max_seq_len`` tokens needs."""
        return -(-self.max_seq_len // self.block_size)

    @property
    def total_blocks(self) -> int:
        """Blocks per layer cache, the scratch block 0 included."""
        if self.num_blocks is not None:
            return self.num_blocks
        return 1 + self.max_requests * self.max_blocks_per_request

    @property
    def kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ReferenceConfig:
        """A named preset (``"tiny"`` or ``"qwen3-0.6b"``) with any field overridden.

        ``dtype`` may be given as a torch.dtype or a name such as ``"bf16"``.
        """
        values = preset_values(cls, "reference", _PRESETS, name, overrides)
        if isinstance(values.get("dtype"), str):
            values["dtype"] = parse_dtype(values["dtype"])
        return cls(**values)


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype a name such as ``"bf16"`` or ``"bfloat16"`` spells; :class:`ConfigError` otherwise."""
    if name not in DTYPE_NAMES:
        raise ConfigError(f"unknown dtype {name!r}; accepted: {', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]
