"""gpt-fast's decoder layout: a ``KVCache`` module per layer whose ``update`` writes with ``index_copy_`` at
``input_pos``, fused ``wqkv``, ``repeat_interleave`` for grouped key/value heads, SDPA with a mask. gpt-fast
decodes a batch at one shared position; here each row has its own (continuous batching), so the cache is
laid out ``[batch * positions, heads, head_dim]`` and a row writes slot ``row * positions + input_pos``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from devgraph import StaticInput
from zoo.base import Shape, ZooModel, apply_rope, init_, rms_norm, rope_tables, row_positions


class KVCache(nn.Module):
    def __init__(self, shape: Shape, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        slots = (shape.max_batch * shape.max_len, shape.kv_heads, shape.head_dim)
        self.max_len = shape.max_len
        self.register_buffer("k_cache", torch.randn(slots, device=device, dtype=dtype) * 0.5)
        self.register_buffer("v_cache", torch.randn(slots, device=device, dtype=dtype) * 0.5)

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = input_pos.shape[0]
        slots = torch.arange(b, device=input_pos.device) * self.max_len + input_pos
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)
        rows = b * self.max_len
        view = (b, self.max_len, *k.shape[1:])
        return self.k_cache[:rows].view(view), self.v_cache[:rows].view(view)


class FeedForward(nn.Module):
    def __init__(self, shape: Shape, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = nn.Linear(shape.hidden, shape.intermediate, bias=False, device=device, dtype=dtype)
        self.w3 = nn.Linear(shape.hidden, shape.intermediate, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(shape.intermediate, shape.hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    def __init__(self, shape: Shape, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = shape
        total = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
        self.wqkv = nn.Linear(shape.hidden, total, bias=False, device=device, dtype=dtype)
        self.wo = nn.Linear(
            shape.heads * shape.head_dim, shape.hidden, bias=False, device=device, dtype=dtype
        )
        self.kv_cache = KVCache(shape, device, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        input_pos: torch.Tensor,
    ) -> torch.Tensor:
        s = self.shape
        b = x.shape[0]
        q, k, v = self.wqkv(x).split(
            [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1
        )
        q = apply_rope(q.view(b, s.heads, s.head_dim), cos, sin)
        k = apply_rope(k.view(b, s.kv_heads, s.head_dim), cos, sin)
        keys, values = self.kv_cache.update(input_pos, k, v.view(b, s.kv_heads, s.head_dim))
        groups = s.heads // s.kv_heads
        keys = keys.transpose(1, 2).repeat_interleave(groups, dim=1)  # [b, heads, positions, dim]
        values = values.transpose(1, 2).repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask[:, None, None])
        return self.wo(y.reshape(b, s.heads * s.head_dim))


class Block(nn.Module):
    def __init__(self, shape: Shape, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = Attention(shape, device, dtype)
        self.feed_forward = FeedForward(shape, device, dtype)
        self.attention_norm = nn.Parameter(torch.ones(shape.hidden, device=device, dtype=dtype))
        self.ffn_norm = nn.Parameter(torch.ones(shape.hidden, device=device, dtype=dtype))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        input_pos: torch.Tensor,
    ) -> torch.Tensor:
        h = x + self.attention(rms_norm(x, self.attention_norm), cos, sin, mask, input_pos)
        return h + self.feed_forward(rms_norm(h, self.ffn_norm))


class Transformer(nn.Module):
    def __init__(self, shape: Shape, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.hidden, device=device, dtype=dtype)
        self.layers = nn.ModuleList(Block(shape, device, dtype) for _ in range(shape.layers))
        self.norm = nn.Parameter(torch.ones(shape.hidden, device=device, dtype=dtype))
        self.output = nn.Linear(shape.hidden, shape.vocab, bias=False, device=device, dtype=dtype)
        init_(self)
        cos, sin = rope_tables(shape.max_len, shape.head_dim, device)
        self.register_buffer("freqs_cos", cos)
        self.register_buffer("freqs_sin", sin)
        self.register_buffer(
            "causal", torch.tril(torch.ones(shape.max_len, shape.max_len, dtype=torch.bool, device=device))
        )

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        mask = self.causal[input_pos]  # [b, positions]: each row sees its own prefix
        cos, sin = self.freqs_cos[input_pos], self.freqs_sin[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(rms_norm(x, self.norm))


def build_gptfast(shape: Shape, device: str, dtype: torch.dtype) -> ZooModel:
    torch.manual_seed(0)
    model = Transformer(shape, device, dtype)

    def make_step(n: int, seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return {
            "idx": torch.randint(0, shape.vocab, (n,), generator=generator).to(device),
            "input_pos": row_positions(n, shape.max_len).to(device),
        }

    element = torch.empty((), dtype=dtype).element_size()
    return ZooModel(
        name="gptfast",
        forward=model.forward,
        inputs={"idx": StaticInput(torch.long, fill=0), "input_pos": StaticInput(torch.long, fill=0)},
        make_step=make_step,
        module=model,
        kv_bytes=lambda rows: (
            2 * rows * shape.layers * shape.kv_heads * shape.max_len * shape.head_dim * element
        ),
    )
