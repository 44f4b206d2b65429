"""A plain decoder with a static KV cache written in place: ``cache[i, rows, :, pos] = k`` with ``pos`` a
tensor, SDPA with a boolean mask. The pattern of many engines' first decoder (and of the issue that found
compiled ``full`` failing on it)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from devgraph import StaticInput
from zoo.base import Shape, ZooModel, apply_rope, decode_step, init_, rms_norm, rope_tables, swiglu


class PlainDecoder(nn.Module):
    def __init__(self, shape: Shape, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        s = shape
        self.shape = s
        kw = {"device": device, "dtype": dtype}
        self.embed = nn.Parameter(torch.empty(s.vocab, s.hidden, **kw))
        self.wq = nn.ParameterList(
            nn.Parameter(torch.empty(s.heads * s.head_dim, s.hidden, **kw)) for _ in range(s.layers)
        )
        self.wk = nn.ParameterList(
            nn.Parameter(torch.empty(s.kv_heads * s.head_dim, s.hidden, **kw)) for _ in range(s.layers)
        )
        self.wv = nn.ParameterList(
            nn.Parameter(torch.empty(s.kv_heads * s.head_dim, s.hidden, **kw)) for _ in range(s.layers)
        )
        self.wo = nn.ParameterList(
            nn.Parameter(torch.empty(s.hidden, s.heads * s.head_dim, **kw)) for _ in range(s.layers)
        )
        self.gate = nn.ParameterList(
            nn.Parameter(torch.empty(s.intermediate, s.hidden, **kw)) for _ in range(s.layers)
        )
        self.up = nn.ParameterList(
            nn.Parameter(torch.empty(s.intermediate, s.hidden, **kw)) for _ in range(s.layers)
        )
        self.down = nn.ParameterList(
            nn.Parameter(torch.empty(s.hidden, s.intermediate, **kw)) for _ in range(s.layers)
        )
        self.attn_norm = nn.ParameterList(nn.Parameter(torch.empty(s.hidden, **kw)) for _ in range(s.layers))
        self.mlp_norm = nn.ParameterList(nn.Parameter(torch.empty(s.hidden, **kw)) for _ in range(s.layers))
        self.final_norm = nn.Parameter(torch.empty(s.hidden, **kw))
        self.lm_head = nn.Parameter(torch.empty(s.vocab, s.hidden, **kw))
        init_(self)
        cache_shape = (s.layers, s.max_batch, s.kv_heads, s.max_len, s.head_dim)
        self.register_buffer("k_cache", torch.randn(cache_shape, **kw) * 0.5)
        self.register_buffer("v_cache", torch.randn(cache_shape, **kw) * 0.5)
        cos, sin = rope_tables(s.max_len, s.head_dim, device)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        s = self.shape
        b = input_ids.shape[0]
        rows = torch.arange(b, device=input_ids.device)
        x = self.embed[input_ids]
        cos, sin = self.cos[positions], self.sin[positions]
        mask = torch.arange(s.max_len, device=x.device)[None, :] <= positions[:, None]  # [b, positions]
        for i in range(s.layers):
            h = rms_norm(x, self.attn_norm[i])
            q = apply_rope(F.linear(h, self.wq[i]).view(b, s.heads, s.head_dim), cos, sin)
            k = apply_rope(F.linear(h, self.wk[i]).view(b, s.kv_heads, s.head_dim), cos, sin)
            v = F.linear(h, self.wv[i]).view(b, s.kv_heads, s.head_dim)
            self.k_cache[i, rows, :, positions] = k  # written in place at each row's position
            self.v_cache[i, rows, :, positions] = v
            attn = F.scaled_dot_product_attention(
                q[:, :, None],
                self.k_cache[i, :b],
                self.v_cache[i, :b],
                attn_mask=mask[:, None, None],
                enable_gqa=True,
            )
            x = x + F.linear(attn.reshape(b, s.heads * s.head_dim), self.wo[i])
            x = x + swiglu(rms_norm(x, self.mlp_norm[i]), self.gate[i], self.up[i], self.down[i])
        return F.linear(rms_norm(x, self.final_norm), self.lm_head)


def build_plain(shape: Shape, device: str, dtype: torch.dtype) -> ZooModel:
    torch.manual_seed(0)
    model = PlainDecoder(shape, device, dtype)
    return ZooModel(
        name="plain",
        forward=model.forward,
        inputs={
            "input_ids": StaticInput(torch.long, fill=0),
            "positions": StaticInput(torch.long, fill=0),
        },
        make_step=decode_step(shape, shape.vocab, device),
        module=model,
        kv_bytes=lambda rows: (
            2
            * rows
            * shape.layers
            * shape.kv_heads
            * shape.max_len
            * shape.head_dim
            * model.k_cache.element_size()
        ),
    )
