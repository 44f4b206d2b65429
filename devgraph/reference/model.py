"""A random-weight Llama-style decoder over a paged KV cache (the reference model)."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from devgraph.reference.attention import PagedMetadata, paged_attention, sdpa_attention
from devgraph.reference.config import ReferenceConfig

__all__ = ["ReferenceModel", "RMSNorm", "DecoderLayer", "draw_weight", "rope_tables", "rotate"]


def draw_weight(
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


def rope_tables(config: ReferenceConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[max_seq_len, head_dim / 2]`` in float32 (bf16 angles are too coarse at long
    positions), indexed by positions."""
    half = config.head_dim // 2
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [N, heads, D]`` with ``cos``/``sin [N, 1, D/2]`` (float32); the vision
    encoder's 2-D rotary uses it too (row angles, then column angles, in ``cos``/``sin``)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm block: GQA attention over this layer's paged KV cache, then a SwiGLU MLP."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, config: ReferenceConfig, generator: torch.Generator, device: torch.device) -> None:
        super().__init__()
        c, dt = config, config.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.attention, self.kernels = c.attention, c.kernels
        self.scale = c.head_dim**-0.5
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.head_split = (c.num_heads, c.num_kv_heads, c.num_kv_heads)
        self.input_norm = RMSNorm(c.hidden_size, c.rms_eps, device=device, dtype=dt)
        # Fused q/k/v and gate/up projections: fewer kernels per step, as in production engines.
        self.qkv_proj = draw_weight(
            generator, (q_size + 2 * kv_size, c.hidden_size), c.hidden_size, device, dt
        )
        self.o_proj = draw_weight(generator, (c.hidden_size, q_size), q_size, device, dt)
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_eps, device=device, dtype=dt)
        self.gate_up_proj = draw_weight(
            generator, (2 * c.intermediate_size, c.hidden_size), c.hidden_size, device, dt
        )
        self.down_proj = draw_weight(
            generator, (c.hidden_size, c.intermediate_size), c.intermediate_size, device, dt
        )
        # Zeros, not empty: NaN garbage in never-written slots must not reach a masked-out score.
        # Non-persistent so state_dict() holds only the weights.
        cache_shape = (c.total_blocks, c.block_size, c.num_kv_heads, c.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, device=device, dtype=dt), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, device=device, dtype=dt), persistent=False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        if self.attention == "sdpa":
            return sdpa_attention(
                q,
                k,
                v,
                self.k_cache,
                self.v_cache,
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens,
                meta.cu_seqlens_q,
                self.scale,
            )
        return paged_attention(self.kernels, q, k, v, self.k_cache, self.v_cache, meta, self.scale)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PagedMetadata
    ) -> torch.Tensor:
        n = hidden.shape[0]
        # Heads first, then split: views of the contiguous projection only. (Splitting the flat projection
        # and viewing each part makes inductor's view lowering guard on n > 1: a second compile for n = 1.)
        qkv = F.linear(self.input_norm(hidden), self.qkv_proj).view(n, -1, self.head_dim)
        q, k, v = qkv.split(self.head_split, dim=1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attn = self.attend(q, k, v, meta)
        hidden = hidden + F.linear(attn.reshape(n, -1), self.o_proj)
        gate, up = F.linear(self.post_attention_norm(hidden), self.gate_up_proj).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, self.down_proj)


class ReferenceModel(nn.Module):
    """A small Llama-style decoder with random weights and a paged KV cache held as buffers.

    Built from ``config``, a ``device`` and a ``seed``: the same seed gives the same weights on any
    device. ``k_cache[layer]`` / ``v_cache[layer]`` are ``[total_blocks, block_size, KVH, D]``; block 0 is
    the scratch block (slot :attr:`padding_slot` is where padding tokens write). The LM head is tied to
    the embedding (as in Qwen3-0.6B).

    The steps are pure tensor code whose metadata is device tensors (see :class:`PagedMetadata`):

    * :meth:`decode_step`: one token per request -> logits ``[B, vocab]``;
    * :meth:`prefill_step`: packed tokens of several requests (chunked prefill: a cached prefix is fine)
      -> logits of each request's last token ``[R, vocab]``;
    * :meth:`verify_step`: packed ``1 + k`` tokens per request (speculative decoding) -> logits of every
      token ``[T, vocab]``.

    Positions must be below ``max_seq_len``; they are not checked, since that would need a host sync.
    Every weight is frozen (``requires_grad=False``).
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    layers: nn.ModuleList

    def __init__(
        self, config: ReferenceConfig, device: torch.device | str | None = None, seed: int = 0
    ) -> None:
        super().__init__()
        device = torch.device(device if device is not None else "cpu")
        self.config = config
        generator = torch.Generator().manual_seed(seed)
        # Draw order is fixed (embedding, then layer by layer) so a seed pins every weight.
        self.embed = draw_weight(
            generator, (config.vocab_size, config.hidden_size), config.hidden_size, device, config.dtype
        )
        self.layers = nn.ModuleList(DecoderLayer(config, generator, device) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, device=device, dtype=config.dtype)
        cos, sin = rope_tables(config, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def device(self) -> torch.device:
        """Where the weights and the cache live."""
        return self.embed.device

    @property
    def padding_slot(self) -> int:
        """The cache slot padding tokens write to (in block 0, which no request owns)."""
        return 0

    @property
    def k_cache(self) -> list[torch.Tensor]:
        return [cast(DecoderLayer, layer).k_cache for layer in self.layers]

    @property
    def v_cache(self) -> list[torch.Tensor]:
        return [cast(DecoderLayer, layer).v_cache for layer in self.layers]

    @torch.no_grad()
    def randomize_cache(self, seed: int = 0) -> None:
        """Fill every KV cache (scratch block included) with N(0, 1) values, in place (reproducible per
        device type, drawn on the model's device so multi-GB caches fill fast)."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for cache in (*self.k_cache, *self.v_cache):
            cache.normal_(generator=generator)

    @torch.no_grad()
    def clear_cache(self) -> None:
        for cache in (*self.k_cache, *self.v_cache):
            cache.zero_()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden_size]`` of a step's tokens."""
        hidden = F.embedding(input_ids, self.embed)
        cos = self.rope_cos.index_select(0, positions)[:, None]  # [T, 1, D/2]
        sin = self.rope_sin.index_select(0, positions)[:, None]
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over final-normed hidden states: ``[..., hidden_size] -> [..., vocab_size]``."""
        return F.linear(hidden, self.embed)

    def decode_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One token per request (``[B]`` ids, positions, slots; ``[B, max_blocks]`` tables, ``[B]`` lengths
        including this token) -> logits ``[B, vocab_size]``."""
        meta = PagedMetadata(slot_mapping, block_tables, seq_lens)
        return self.compute_logits(self.hidden_states(input_ids, positions, meta))

    def prefill_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
    ) -> torch.Tensor:
        """Packed tokens of ``R`` requests (``cu_seqlens_q [R + 1]``) -> logits of each request's last
        token, ``[R, vocab_size]`` (a request with no tokens, a padding request, gets a meaningless row)."""
        meta = PagedMetadata(slot_mapping, block_tables, seq_lens, cu_seqlens_q)
        hidden = self.hidden_states(input_ids, positions, meta)
        last = (cu_seqlens_q[1:].long() - 1).clamp(min=0)
        return self.compute_logits(hidden.index_select(0, last))

    def verify_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
    ) -> torch.Tensor:
        """Packed ``1 + k`` tokens per request -> logits of every token, ``[T, vocab_size]``."""
        meta = PagedMetadata(slot_mapping, block_tables, seq_lens, cu_seqlens_q)
        return self.compute_logits(self.hidden_states(input_ids, positions, meta))

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """Same as :meth:`decode_step`."""
        return self.decode_step(*args, **kwargs)
