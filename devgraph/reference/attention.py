"""Attention of the reference model over a paged KV cache, in two forms.

* ``paged``: :mod:`devgraph.reference.kernels` (Triton on a GPU, the torch reference elsewhere) read the
  block tables, lengths and ``cu_seqlens`` from device tensors, so a ``full`` graph replays any batch
  composition of its key, decode and packed prefill alike.
* ``sdpa``: a ``graph_break`` op. It writes the new keys and values, then attends with PyTorch's
  ``scaled_dot_product_attention`` using host-side lengths from the forward context (what engines feed
  flash-attention's varlen API), so its cost follows the batch's real lengths. ``breakable`` and
  ``tc_piecewise`` run it eagerly between graph segments with the live context; without host lengths in
  the context (``full`` captures it with none) it uses the device-metadata reference instead.
"""

# No ``from __future__ import annotations`` here: torch derives the operator schema from the annotations,
# and it reads ``list[Optional[Tensor]]``.

from typing import Optional

import torch
import torch.nn.functional as F

from devgraph import get_forward_context, graph_break
from devgraph.reference.kernels import attention_backend, torch_ref
from devgraph.reference.kernels.interface import PagedMetadata, attention_fake

__all__ = ["PagedMetadata", "ATTENTION_OP_NAME", "sdpa_attention", "paged_attention"]

ATTENTION_OP_NAME = "devgraph_ref::paged_sdpa"

# The kernels as torch custom ops: opaque to dynamo and inductor (the compiling strategies keep them as
# one call each, as engines do with their attention kernels), captured whole by device graphs, and traced
# op by op by the CPU simulator (it traces Python custom-op bodies). ``kernels`` picks the implementation.
# An operator takes tensors, not a dataclass: the metadata travels as ``PagedMetadata.tensors()``, one
# ``Tensor?[]`` argument, so a new field of the metadata changes no operator's signature.


@torch.library.custom_op("devgraph_ref::write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kernels: str,
) -> None:
    attention_backend(kernels).write_kv(k, v, k_cache, v_cache, slot_mapping)


@_write_kv_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, kernels):  # type: ignore[no-untyped-def]
    return None


@torch.library.custom_op("devgraph_ref::paged_attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: list[Optional[torch.Tensor]],  # noqa: UP045 - torch derives the op schema from it
    scale: float,
    kernels: str,
) -> torch.Tensor:
    meta = PagedMetadata.of(metadata)
    ops = attention_backend(kernels)
    attend = ops.paged_decode_attention if meta.cu_seqlens_q is None else ops.paged_prefill_attention
    return attend(q, k_cache, v_cache, meta, scale)


_attention_op.register_fake(attention_fake)


def paged_attention(
    kernels: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's keys/values, then attend through the device-metadata kernels (decode without
    ``meta.cu_seqlens_q``, packed prefill with it)."""
    _write_kv_op(k, v, k_cache, v_cache, meta.slot_mapping, kernels)
    return _attention_op(q, k_cache, v_cache, meta.tensors(), scale, kernels)


def _host_lengths(name: str) -> list | None:
    context = get_forward_context()
    value = getattr(context, name, None) if context is not None else None
    return value if isinstance(value, list) else None


@graph_break(ATTENTION_OP_NAME, mutates_args=("k_cache", "v_cache"), fake=attention_fake)
def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: list[Optional[torch.Tensor]],  # noqa: UP045 - torch derives the op schema from it
    scale: float,
) -> torch.Tensor:
    """The ``sdpa`` attention break op: write K/V, then SDPA sized by the context's host lengths.

    ``metadata``: the step's :class:`PagedMetadata` as ``meta.tensors()``. Host lengths:
    ``context.seq_lens`` (kv length of each real request) and, for packed steps, ``context.cu_seqlens_q``
    (cumulative query lengths). Rows past the real requests and tokens are zero.
    """
    meta = PagedMetadata.of(metadata)
    torch_ref.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    host_lens = _host_lengths("seq_lens")
    if host_lens is None:
        # No host lengths (captured whole under `full`): the device-metadata reference, valid for any batch.
        if meta.cu_seqlens_q is None:
            return torch_ref.paged_decode_attention(q, k_cache, v_cache, meta, scale)
        return torch_ref.paged_prefill_attention(q, k_cache, v_cache, meta, scale)
    if meta.cu_seqlens_q is None:
        longest = max(host_lens, default=0)
        return _decode_sdpa(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, longest, scale)
    host_cu = _host_lengths("cu_seqlens_q")
    if host_cu is None:
        raise ValueError("the sdpa attention op needs context.cu_seqlens_q (a list) for packed steps")
    return _packed_sdpa(q, k_cache, v_cache, meta.block_tables, host_lens, host_cu, scale)


def _gather(cache: torch.Tensor, table: torch.Tensor, blocks: int) -> torch.Tensor:
    """``[R, blocks * block_size, KVH, D]``: the first ``blocks`` pages of every request, in order."""
    pages = cache.index_select(0, table[:, :blocks].reshape(-1).long())
    return pages.reshape(table.shape[0], blocks * cache.shape[1], cache.shape[2], cache.shape[3])


def _decode_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    longest: int,
    scale: float,
) -> torch.Tensor:
    requests, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    blocks = max(1, -(-longest // k_cache.shape[1]))
    keys = _gather(k_cache, block_tables, blocks).permute(0, 2, 1, 3)  # [R, KVH, W, D]
    values = _gather(v_cache, block_tables, blocks).permute(0, 2, 1, 3)
    window = keys.shape[2]
    visible = torch.arange(window, device=q.device)[None, :] < seq_lens[:, None]  # [R, W]
    visible[:, 0] |= seq_lens == 0  # a padding row sees one (ignored) position instead of none: no NaN
    # Positions past a request's length may hold anything (a freed block's stale values, the scratch block
    # padding rows write): zero them, since a masked score still multiplies its value (0 * NaN is NaN).
    hidden = ~visible[:, None, :, None]
    keys = keys.masked_fill(hidden, 0)
    values = values.masked_fill(hidden, 0)
    # GQA without copying the window once per query head: the heads sharing a KV head become query rows.
    out = F.scaled_dot_product_attention(
        q.reshape(requests, kv_heads, heads // kv_heads, dim),
        keys,
        values,
        attn_mask=visible[:, None, None, :],
        scale=scale,
    )
    out = out.reshape(requests, heads, dim)
    return torch.where((seq_lens > 0)[:, None, None], out, torch.zeros_like(out))


def _packed_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    host_lens: list,
    host_cu: list,
    scale: float,
) -> torch.Tensor:
    out = torch.zeros_like(q)
    heads = q.shape[1]
    kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    for r, length in enumerate(host_lens):
        start, stop = host_cu[r], host_cu[r + 1]
        if stop <= start or length <= 0:
            continue
        blocks = -(-length // block_size)
        table = block_tables[r : r + 1]
        keys = _gather(k_cache, table, blocks)[0, :length].transpose(0, 1)  # [KVH, L, D]
        values = _gather(v_cache, table, blocks)[0, :length].transpose(0, 1)
        query = q[start:stop].transpose(0, 1)  # [H, Q, D]
        first = length - (stop - start)  # absolute position of the first query
        causal = torch.arange(length, device=q.device)[None, :] <= (
            first + torch.arange(stop - start, device=q.device)[:, None]
        )
        groups = heads // kv_heads
        attn = F.scaled_dot_product_attention(
            query.reshape(kv_heads, groups, stop - start, -1),
            keys[:, None],
            values[:, None],
            attn_mask=causal,
            scale=scale,
        )
        out[start:stop] = attn.reshape(heads, stop - start, -1).transpose(0, 1)
    return out
