"""A random-weight Llama-style decoder over a paged KV cache (the reference model)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from devgraph import ConfigError
from devgraph.reference.attention import PagedMetadata, paged_attention, sdpa_attention
from devgraph.reference.config import ReferenceConfig
from devgraph.reference.fused import (
    add_rms_norm,
    fused_kernels,
    greedy_tokens,
    linear,
    qk_norm_rope,
    rms_norm,
    set_up_triton,
    silu_mul,
)
from devgraph.reference.kernel_builds import DecodeShapes
from devgraph.reference.rope import rope_tables

__all__ = [
    "ReferenceModel",
    "RMSNorm",
    "DecoderLayer",
    "LayerPart",
    "WEIGHT_INITS",
    "decoder_rope_tables",
    "draw_weight",
    "rotate",
    "whole_layer",
]

#: How a model's weights start: ``random`` (drawn from the seed) or ``empty`` (allocated, not written:
#: a checkpoint loader fills them).
WEIGHT_INITS: tuple[str, ...] = ("random", "empty")


def draw_weight(
    generator: torch.Generator | None,
    shape: tuple[int, ...],
    fan_in: int,
    device: torch.device,
    dtype: torch.dtype,
) -> nn.Parameter:
    """A frozen weight ~ N(0, 1/fan_in), drawn on the CPU so a seed gives the same weights on any device;
    with no ``generator``, allocated on ``device`` and left unwritten (a loader fills it).

    The 1/sqrt(fan_in) scale keeps every projection's output at unit scale, so the residual stream
    grows only like sqrt(2 * num_layers) and stays finite in bf16 at 28 layers.
    """
    if generator is None:
        return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)
    weight = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(1.0 / math.sqrt(fan_in))
    return nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)


def _zeros(size: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(size, device=device, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned scale (ones until loaded); statistics in
    float32, the normalised value cast back before the scale multiplies it (transformers' order).

    ``shape`` is the scale's shape: ``size`` for a hidden-state norm, ``(heads, head_dim)`` for per-head
    norms applied to several heads at once (each head its own row of scale)."""

    def __init__(
        self,
        shape: int | tuple[int, ...],
        eps: float,
        *,
        device: torch.device,
        dtype: torch.dtype,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused  # one Triton kernel (devgraph.reference.fused) for [N, H] inputs
        self.weight = nn.Parameter(torch.ones(shape, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.fused and x.dim() == 2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [N, heads, D]`` with ``cos``/``sin [N, 1, D/2]`` in float32 (the vision
    encoder's 2-D rotary: row angles, then column angles, in ``cos``/``sin``). The decoder rotates in its
    own dtype, as transformers does: :func:`devgraph.reference.rope.apply_rope`."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def decoder_rope_tables(config: ReferenceConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[max_seq_len, head_dim / 2]`` in the model's dtype, indexed by positions."""
    return rope_tables(
        config.head_dim, config.rope_theta, config.rope_scaling, config.max_seq_len, device, config.dtype
    )


@dataclass(frozen=True)
class LayerPart:
    """What one process holds of a decoder layer: its query and KV heads and their projections, and its
    slice of the MLP. On one device that is the whole layer (:func:`whole_layer`); under tensor
    parallelism one rank's heads and slice (:class:`~devgraph.reference.tp.TPDecoderLayer`), the only
    difference besides :meth:`DecoderLayer.reduce`."""

    num_heads: int
    num_kv_heads: int
    qkv_proj: nn.Parameter  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    o_proj: nn.Parameter  # [hidden, num_heads * head_dim]
    gate_up_proj: nn.Parameter  # [2 * intermediate, hidden]: gate rows, then up rows
    down_proj: nn.Parameter  # [hidden, intermediate]


def whole_layer(
    config: ReferenceConfig, generator: torch.Generator | None, device: torch.device
) -> LayerPart:
    """A whole layer's projections, drawn from ``generator`` in a fixed order (q/k/v, o, gate/up, down) so
    a seed pins every weight; ``None`` leaves them unwritten for a loader (see :func:`draw_weight`)."""
    c, dt = config, config.dtype
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return LayerPart(
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        qkv_proj=draw_weight(generator, (q_size + 2 * kv_size, c.hidden_size), c.hidden_size, device, dt),
        o_proj=draw_weight(generator, (c.hidden_size, q_size), q_size, device, dt),
        gate_up_proj=draw_weight(
            generator, (2 * c.intermediate_size, c.hidden_size), c.hidden_size, device, dt
        ),
        down_proj=draw_weight(
            generator, (c.hidden_size, c.intermediate_size), c.intermediate_size, device, dt
        ),
    )


class DecoderLayer(nn.Module):
    """Pre-norm block: GQA attention over this layer's paged KV cache, then a SwiGLU MLP.

    Queries and keys are one slice of the fused projection (``[N, H + KVH, D]``), normed per head
    (``qk_norm``) and rotated together: one set of elementwise kernels for both (one Triton kernel on a
    GPU: :mod:`devgraph.reference.fused`). ``generator=None`` leaves the projections unwritten for a
    loader (see :func:`draw_weight`). ``part``: the heads and projections this process holds (default: the
    whole layer, drawn from ``generator``); :meth:`reduce` sums the row-parallel projections' results over
    the processes that hold the layer (nothing to sum on one device).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(
        self,
        config: ReferenceConfig,
        generator: torch.Generator | None,
        device: torch.device,
        part: LayerPart | None = None,
    ) -> None:
        super().__init__()
        c, dt = config, config.dtype
        part = part if part is not None else whole_layer(config, generator, device)
        self.num_heads, self.num_kv_heads, self.head_dim = part.num_heads, part.num_kv_heads, c.head_dim
        self.attention, self.kernels = c.attention, c.kernels
        self.scale = c.head_dim**-0.5
        self.fused = fused_kernels(c.kernels, device)
        self.rms_eps = c.rms_eps
        self.input_norm = RMSNorm(c.hidden_size, c.rms_eps, device=device, dtype=dt, fused=self.fused)
        # Fused q/k/v and gate/up projections: fewer kernels per step, as in production engines.
        self.qkv_proj = part.qkv_proj
        self.qkv_bias = _zeros(part.qkv_proj.shape[0], device, dt) if c.qkv_bias else None
        # Qwen3's q_norm and k_norm as one per-head scale: rows 0..H-1 are q_norm's, the rest k_norm's.
        heads = part.num_heads + part.num_kv_heads
        self.qk_norm = RMSNorm((heads, c.head_dim), c.rms_eps, device=device, dtype=dt) if c.qk_norm else None
        self.o_proj = part.o_proj
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_eps, device=device, dtype=dt)
        self.gate_up_proj = part.gate_up_proj
        self.down_proj = part.down_proj
        # Zeros, not empty: NaN garbage in never-written slots must not reach a masked-out score.
        # Non-persistent so state_dict() holds only the weights.
        cache_shape = (c.total_blocks, c.block_size, part.num_kv_heads, c.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, device=device, dtype=dt), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, device=device, dtype=dt), persistent=False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        if self.attention == "sdpa":
            return sdpa_attention(q, k, v, self.k_cache, self.v_cache, meta.tensors(), self.scale)
        return paged_attention(self.kernels, q, k, v, self.k_cache, self.v_cache, meta, self.scale)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's result summed over the processes holding this layer: on one device
        it is whole already (tensor parallelism all-reduces it)."""
        return partial

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PagedMetadata
    ) -> torch.Tensor:
        n = hidden.shape[0]
        # Heads first, then split: views of the contiguous projection only. (Splitting the flat projection
        # and viewing each part makes inductor's view lowering guard on n > 1: a second compile for n = 1.)
        normed = self.input_norm(hidden)
        qkv = linear(normed, self.qkv_proj, self.qkv_bias, self.fused).view(n, -1, self.head_dim)
        qk, v = qkv.split((self.num_heads + self.num_kv_heads, self.num_kv_heads), dim=1)
        scale = None if self.qk_norm is None else self.qk_norm.weight
        qk = qk_norm_rope(qk, scale, cos, sin, self.rms_eps, self.fused)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        attn = linear(self.attend(q, k, v, meta).reshape(n, -1), self.o_proj, None, self.fused)
        normed, hidden = self.reduce_add_norm(attn, hidden)
        mlp = silu_mul(linear(normed, self.gate_up_proj, None, self.fused), self.fused)
        return self.reduce_add(linear(mlp, self.down_proj, None, self.fused), hidden)

    def reduce_add_norm(
        self, partial: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After attention: ``(post_attention_norm(residual + reduced), residual + reduced)`` where
        ``reduced`` is :meth:`reduce` of ``partial`` (tensor parallelism may do all three in one kernel)."""
        weight = self.post_attention_norm.weight
        return add_rms_norm(self.reduce(partial), residual, weight, self.rms_eps, self.fused)

    def reduce_add(self, partial: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """After the MLP: ``residual + reduce(partial)`` (tensor parallelism may do both in one kernel)."""
        return residual + self.reduce(partial)


class ReferenceModel(nn.Module):
    """A small Llama-style decoder with random weights and a paged KV cache held as buffers.

    Built from ``config``, a ``device`` and a ``seed``: the same seed gives the same weights on any
    device; ``weights="empty"`` allocates them unwritten for a checkpoint loader instead (norm scales
    start at one, biases at zero). ``k_cache[layer]`` / ``v_cache[layer]`` are
    ``[total_blocks, block_size, KVH, D]``; block 0 is the scratch block (slot :attr:`padding_slot` is where
    padding tokens write). The LM head is the embedding when ``config.tie_embeddings`` (as in
    Qwen3-0.6B), else :attr:`lm_head`, drawn after every other weight.

    The steps are pure tensor code whose metadata is device tensors (see :class:`PagedMetadata`):

    * :meth:`decode_step`: one token per request -> logits ``[B, vocab]``;
    * :meth:`prefill_step`: packed tokens of several requests (chunked prefill: a cached prefix is fine)
      -> logits of each request's last token ``[R, vocab]`` (:meth:`prefill_step_with_hidden`: and every
      token's final hidden state);
    * :meth:`verify_step`: packed ``1 + k`` tokens per request (speculative decoding) -> logits of every
      token ``[T, vocab]``.

    Positions must be below ``max_seq_len``; they are not checked, since that would need a host sync.
    Every weight is frozen (``requires_grad=False``).
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    layers: nn.ModuleList

    def __init__(
        self,
        config: ReferenceConfig,
        device: torch.device | str | None = None,
        seed: int = 0,
        *,
        weights: str = "random",
    ) -> None:
        super().__init__()
        if weights not in WEIGHT_INITS:
            raise ConfigError(f"weights={weights!r} is unknown; accepted: {', '.join(WEIGHT_INITS)}")
        device = torch.device(device if device is not None else "cpu")
        self.config = config
        # While the weights load:
        set_up_triton(
            config.kernels,
            device,
            config.intermediate_size,
            config.dtype,
            bias=config.qkv_bias,
            decode=DecodeShapes.of(config),
        )
        generator = torch.Generator().manual_seed(seed) if weights == "random" else None
        # Draw order is fixed (embedding, then layer by layer) so a seed pins every weight.
        shape, dtype = (config.vocab_size, config.hidden_size), config.dtype
        self.embed = draw_weight(generator, shape, config.hidden_size, device, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, generator, device) for _ in range(config.num_layers))
        self.fused = fused_kernels(config.kernels, device)
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, device=device, dtype=dtype, fused=self.fused)
        self.lm_head = (
            None
            if config.tie_embeddings
            else draw_weight(generator, shape, config.hidden_size, device, dtype)
        )
        cos, sin = decoder_rope_tables(config, device)
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
        cos = self.rope_cos.index_select(0, positions)  # [T, D/2], the model's dtype
        sin = self.rope_sin.index_select(0, positions)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over final-normed hidden states: ``[..., hidden_size] -> [..., vocab_size]``."""
        return linear(hidden, self.embed if self.lm_head is None else self.lm_head, None, self.fused)

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

    def decode_step_with_greedy(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`decode_step`'s logits ``[B, vocab_size]`` and each row's greedy token (int64 ``[B]``,
        ``argmax``: the lowest id among equal maxima). In a graph of it, a server's greedy rows are sampled
        inside the replay: on a GPU by two Triton kernels (:func:`~devgraph.reference.fused.greedy_tokens`,
        ``torch.argmax``'s tokens bit for bit) instead of a launch of ``torch.argmax`` after it. A step run
        eagerly launches the kernels from Python, several times ``torch.argmax``'s host time
        (``benchmarks/results/h200-argmax.json``); the warm-ups before a capture do so too, so the capture
        finds them built and loaded."""
        logits = self.decode_step(input_ids, positions, slot_mapping, block_tables, seq_lens)
        return logits, greedy_tokens(logits, self.fused)

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
        inputs = (input_ids, positions, slot_mapping, block_tables, seq_lens, cu_seqlens_q)
        return self.prefill_step_with_hidden(*inputs)[0]

    def prefill_step_with_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`prefill_step`'s logits ``[R, vocab_size]`` and the final-normed hidden states of every
        token ``[T, hidden_size]``: a server that needs other rows' logits (a prompt's log probabilities)
        applies :meth:`compute_logits` to just those rows, so a step without such a request pays nothing."""
        meta = PagedMetadata(slot_mapping, block_tables, seq_lens, cu_seqlens_q)
        hidden = self.hidden_states(input_ids, positions, meta)
        last = (cu_seqlens_q[1:].long() - 1).clamp(min=0)
        return self.compute_logits(hidden.index_select(0, last)), hidden

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
