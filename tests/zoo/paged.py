"""vLLM's decoder layout: one flat paged KV cache per layer (``[2, blocks * block_size, kv_heads, dim]``),
``slot_mapping`` / ``block_tables`` / ``seq_lens`` as step inputs, and attention as a custom op (a devgraph
break op) that calls the cache-write op inside it, as vLLM's ``unified_attention`` wraps
``reshape_and_cache``: break ops nest. Block 0 is scratch: padding rows write there and read only it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from devgraph import StaticInput, graph_break
from zoo.base import Shape, ZooModel, apply_rope, init_, rms_norm, rope_tables, row_positions

BLOCK = 16


@graph_break("zoo::reshape_and_cache", mutates_args=("kv_cache",))
def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    kv_cache[0].index_copy_(0, slot_mapping, key)
    kv_cache[1].index_copy_(0, slot_mapping, value)


@graph_break("zoo::paged_attention", mutates_args=("kv_cache",))
def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    reshape_and_cache(key, value, kv_cache, slot_mapping)  # a break op inside a break op
    rows, width = block_tables.shape
    offsets = torch.arange(BLOCK, device=query.device)
    slots = (block_tables[:, :, None] * BLOCK + offsets).reshape(rows, width * BLOCK)
    keys, values = kv_cache[0][slots], kv_cache[1][slots]  # [rows, positions, kv_heads, dim]
    mask = torch.arange(width * BLOCK, device=query.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        query[:, :, None],
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None, None],
        enable_gqa=True,
    )
    return out[:, :, 0]


class PagedDecoder(nn.Module):
    def __init__(self, shape: Shape, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        s = self.shape = shape
        kw = {"device": device, "dtype": dtype}
        self.embed = nn.Embedding(s.vocab, s.hidden, **kw)
        self.qkv = nn.ModuleList(
            nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False, **kw)
            for _ in range(s.layers)
        )
        self.o = nn.ModuleList(
            nn.Linear(s.heads * s.head_dim, s.hidden, bias=False, **kw) for _ in range(s.layers)
        )
        self.gate_up = nn.ModuleList(
            nn.Linear(s.hidden, 2 * s.intermediate, bias=False, **kw) for _ in range(s.layers)
        )
        self.down = nn.ModuleList(
            nn.Linear(s.intermediate, s.hidden, bias=False, **kw) for _ in range(s.layers)
        )
        self.input_norm = nn.ParameterList(nn.Parameter(torch.ones(s.hidden, **kw)) for _ in range(s.layers))
        self.post_norm = nn.ParameterList(nn.Parameter(torch.ones(s.hidden, **kw)) for _ in range(s.layers))
        self.norm = nn.Parameter(torch.ones(s.hidden, **kw))
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False, **kw)
        init_(self)
        self.blocks_per_row = -(-s.max_len // BLOCK)
        slots = (1 + s.max_batch * self.blocks_per_row) * BLOCK
        self.kv_caches = [torch.randn(2, slots, s.kv_heads, s.head_dim, **kw) * 0.5 for _ in range(s.layers)]
        cos, sin = rope_tables(s.max_len, s.head_dim, device)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        s = self.shape
        b = input_ids.shape[0]
        x = self.embed(input_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        for i in range(s.layers):
            h = rms_norm(x, self.input_norm[i])
            q, k, v = self.qkv[i](h).split(
                [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1
            )
            q = apply_rope(q.view(b, s.heads, s.head_dim), cos, sin)
            k = apply_rope(k.view(b, s.kv_heads, s.head_dim), cos, sin)
            v = v.view(b, s.kv_heads, s.head_dim)
            attn = paged_attention(q, k, v, self.kv_caches[i], slot_mapping, block_tables, seq_lens)
            x = x + self.o[i](attn.reshape(b, s.heads * s.head_dim))
            gate, up = self.gate_up[i](rms_norm(x, self.post_norm[i])).chunk(2, -1)
            x = x + self.down[i](F.silu(gate) * up)
        return self.lm_head(rms_norm(x, self.norm))


def build_paged(shape: Shape, device: str, dtype: torch.dtype) -> ZooModel:
    torch.manual_seed(0)
    model = PagedDecoder(shape, device, dtype)
    per_row = model.blocks_per_row

    def make_step(n: int, seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        positions = row_positions(n, shape.max_len)
        tables = 1 + torch.arange(n)[:, None] * per_row + torch.arange(per_row)[None, :]
        slots = tables[torch.arange(n), positions // BLOCK] * BLOCK + positions % BLOCK
        step = {
            "input_ids": torch.randint(0, shape.vocab, (n,), generator=generator),
            "positions": positions,
            "slot_mapping": slots,
            "block_tables": tables,
            "seq_lens": positions + 1,
        }
        return {k: v.to(device) for k, v in step.items()}

    element = torch.empty((), dtype=dtype).element_size()
    return ZooModel(
        name="paged",
        forward=model.forward,
        inputs={
            "input_ids": StaticInput(torch.long, fill=0),
            "positions": StaticInput(torch.long, fill=0),
            "slot_mapping": StaticInput(torch.long, fill=0),  # the scratch block's first slot
            "block_tables": StaticInput(torch.long, (per_row,), fill=0),
            "seq_lens": StaticInput(torch.long, fill=1),
        },
        make_step=make_step,
        module=model,
        kv_bytes=lambda rows: (
            2 * rows * shape.layers * shape.kv_heads * per_row * BLOCK * shape.head_dim * element
        ),
    )
