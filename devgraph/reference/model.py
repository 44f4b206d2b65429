"""A random-weight Llama-style decoder whose attention is a graph-break op."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from devgraph.reference.attention import attention
from devgraph.reference.config import ReferenceConfig

__all__ = ["ReferenceModel", "RMSNorm", "DecoderLayer"]


def _draw(
    generator: torch.Generator, shape: tuple[int, ...], fan_in: int, device: torch.device, dtype: torch.dtype
) -> nn.Parameter:
    """A frozen weight ~ N(0, 1/fan_in), drawn on the CPU so a seed gives the same weights on any device.

    The 1/sqrt(fan_in) scale keeps every projection's output at unit scale, so the residual stream
    grows only like sqrt(2 * num_layers) and stays finite in bf16 at 28 layers.
    """
    weight = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(1.0 / math.sqrt(fan_in))
    return nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned (here: ones) scale; statistics in float32."""

    def __init__(self, size: int, eps: float, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [N, heads, D]`` with ``cos``/``sin [N, 1, D/2]`` (float32)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm block: GQA attention over this layer's KV cache, then a SwiGLU MLP."""

    def __init__(self, config: ReferenceConfig, generator: torch.Generator, device: torch.device) -> None:
        super().__init__()
        c, dt = config, config.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.input_norm = RMSNorm(c.hidden_size, c.rms_eps, device=device, dtype=dt)
        # Fused q/k/v and gate/up projections: fewer kernels per step, as in production engines.
        self.qkv_proj = _draw(generator, (q_size + 2 * kv_size, c.hidden_size), c.hidden_size, device, dt)
        self.o_proj = _draw(generator, (c.hidden_size, q_size), q_size, device, dt)
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_eps, device=device, dtype=dt)
        self.gate_up_proj = _draw(
            generator, (2 * c.intermediate_size, c.hidden_size), c.hidden_size, device, dt
        )
        self.down_proj = _draw(
            generator, (c.hidden_size, c.intermediate_size), c.intermediate_size, device, dt
        )
        # Zeros, not empty: masked-out cache entries still enter q @ k^T, and NaN garbage there would
        # survive the mask. Non-persistent so state_dict() holds only the weights.
        cache_shape = (c.max_requests + 1, c.max_seq_len, c.num_kv_heads, c.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, device=device, dtype=dt), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, device=device, dtype=dt), persistent=False)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        req_slots: torch.Tensor,
        is_prefill: bool,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = F.linear(self.input_norm(hidden), self.qkv_proj).split(self.split_sizes, dim=-1)
        q = _rotate(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = _rotate(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        attn = attention(q, k, v, self.k_cache, self.v_cache, req_slots, positions, is_prefill)
        hidden = hidden + F.linear(attn.view(n, -1), self.o_proj)
        gate, up = F.linear(self.post_attention_norm(hidden), self.gate_up_proj).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, self.down_proj)


class ReferenceModel(nn.Module):
    """A small Llama-style decoder with random weights and a KV cache held as buffers.

    Built from ``config``, a ``device`` and a ``seed``: the same seed gives the same weights on any
    device. ``k_cache[layer]`` / ``v_cache[layer]`` are ``[max_requests + 1, max_seq_len, KVH, D]``;
    row ``max_requests`` is :attr:`padding_slot`, where padded rows write harmlessly. The LM head is
    tied to the embedding (as in Qwen3-0.6B).

    :meth:`decode_step` and :meth:`prefill_step` are pure tensor code (capturable) and take keyword
    arguments ``input_ids``, ``positions``, ``req_slots`` (all int64, one entry per token). Positions
    must be below ``max_seq_len``; they are not checked, since that would need a host sync. Every
    weight is frozen (``requires_grad=False``), so no autograd state is recorded without ``no_grad``.
    """

    def __init__(
        self, config: ReferenceConfig, device: torch.device | str | None = None, seed: int = 0
    ) -> None:
        super().__init__()
        device = torch.device(device if device is not None else "cpu")
        self.config = config
        generator = torch.Generator().manual_seed(seed)
        # Draw order is fixed (embedding, then layer by layer) so a seed pins every weight.
        self.embed = _draw(
            generator, (config.vocab_size, config.hidden_size), config.hidden_size, device, config.dtype
        )
        self.layers = nn.ModuleList(DecoderLayer(config, generator, device) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, device=device, dtype=config.dtype)
        # RoPE tables in float32 (bf16 angles are too coarse at long positions), indexed by positions.
        half = config.head_dim // 2
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64), inv_freq)
        self.register_buffer("rope_cos", angles.cos().float().to(device), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float().to(device), persistent=False)

    @property
    def device(self) -> torch.device:
        """Where the weights and the cache live."""
        return self.embed.device

    @property
    def padding_slot(self) -> int:
        """The extra cache row that padded rows point at (never a live request)."""
        return self.config.max_requests

    @property
    def k_cache(self) -> list[torch.Tensor]:
        """Per-layer key caches, ``[max_requests + 1, max_seq_len, KVH, D]`` each."""
        return [layer.k_cache for layer in self.layers]

    @property
    def v_cache(self) -> list[torch.Tensor]:
        """Per-layer value caches, ``[max_requests + 1, max_seq_len, KVH, D]`` each."""
        return [layer.v_cache for layer in self.layers]

    @torch.no_grad()
    def randomize_cache(self, seed: int = 0) -> None:
        """Fill every KV cache (padding slot included) with N(0, 1) values, in place.

        Drawn on the model's device (fast even for multi-GB caches), so the values are reproducible
        per device type, not across devices.
        """
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for cache in (*self.k_cache, *self.v_cache):
            cache.normal_(generator=generator)

    @torch.no_grad()
    def clear_cache(self) -> None:
        """Zero every KV cache."""
        for cache in (*self.k_cache, *self.v_cache):
            cache.zero_()

    def _hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, req_slots: torch.Tensor, is_prefill: bool
    ) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed)
        cos = self.rope_cos.index_select(0, positions)[:, None]  # [N, 1, D/2]
        sin = self.rope_sin.index_select(0, positions)[:, None]
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, positions, req_slots, is_prefill)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over final-normed hidden states: ``[..., hidden_size] -> [..., vocab_size]``."""
        return F.linear(hidden, self.embed)

    def decode_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, req_slots: torch.Tensor
    ) -> torch.Tensor:
        """One token per request: ``[B]`` int64 inputs -> logits ``[B, vocab_size]``.

        Writes each token's K/V at ``cache[req_slots, positions]`` and attends to that request's cache
        row up to and including its position.
        """
        return self.compute_logits(self._hidden(input_ids, positions, req_slots, is_prefill=False))

    def prefill_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, req_slots: torch.Tensor
    ) -> torch.Tensor:
        """Packed tokens of new requests: ``[T]`` int64 inputs -> final-normed hidden ``[T, hidden_size]``.

        Each request's tokens share a slot and carry positions ``0..L-1``; tokens attend causally within
        their request only. Run :meth:`compute_logits` on the last tokens outside the graph.
        """
        return self._hidden(input_ids, positions, req_slots, is_prefill=True)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, req_slots: torch.Tensor
    ) -> torch.Tensor:
        """Same as :meth:`decode_step`."""
        return self.decode_step(input_ids=input_ids, positions=positions, req_slots=req_slots)
