"""The torch reference of the attention-kernel contract: the CPU path and the correctness reference.

Every function obeys the device-graph capture rules: shapes depend only on input shapes, metadata is
read on the device only (no ``.item()``, no ``nonzero``, no boolean-mask indexing, no Python branch on a
tensor value), so one capture replays correctly for any batch composition with the same shapes. The
price is that the reference reads whole block tables and masks by length: its cost follows the padded
shapes, not the real lengths (the Triton kernels are the fast path).

The math runs in float32. Masked scores take a large negative finite value, and the probabilities are
multiplied by the mask afterwards, so a row with nothing to attend to (a padding request or token)
comes out as zeros rather than NaN. Value rows outside a request are zeroed before use (with
``masked_fill``: a multiply would keep NaN, since NaN * 0 is NaN), so garbage, even NaN, in unused
cache blocks or padding tokens never reaches a real row.
"""

from __future__ import annotations

import torch

from devgraph.reference.kernels.interface import (
    PagedMetadata,
    check_decode,
    check_prefill,
    check_varlen,
    check_write,
)

__all__ = ["paged_decode_attention", "paged_prefill_attention", "varlen_attention", "write_kv"]

_MASKED = -1.0e30  # finite: a fully masked row softmaxes to uniform weights, then the mask zeroes it
# varlen_attention builds [queries, heads, T] scores; cutting the queries into chunks of this many tokens
# bounds that to [chunk, heads, T] (a static loop: the chunking depends on T only).
_VARLEN_QUERY_CHUNK = 1024


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write token ``i`` of ``k``/``v [T, KVH, D]`` at flat slot ``slot_mapping[i]`` of the paged caches.

    A negative slot writes nothing. Without reading values on the host that is done by pointing it at
    a slot another token of the same call writes, with that token's values (the token with the largest
    slot, valid whenever any is), so the duplicate write stores the same bytes; when every slot is
    negative they all rewrite slot 0 with its own current contents.
    """
    check_write(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    valid = slots >= 0
    # The token with the largest slot (a valid one whenever any is); index_select keeps it on the device
    # (indexing with a 0-d tensor would read it on the host).
    anchor = torch.argmax(slots).view(1)
    anchor_slot = slots.index_select(0, anchor)  # [1]
    any_valid = anchor_slot >= 0
    target = torch.where(valid, slots, torch.where(any_valid, anchor_slot, torch.zeros_like(anchor_slot)))
    index = (target // block_size, target % block_size)
    for source, cache in ((k, k_cache), (v, v_cache)):
        values = source.to(cache.dtype)
        fallback = torch.where(any_valid[:, None, None], values.index_select(0, anchor), cache[0, 0][None])
        cache.index_put_(index, torch.where(valid[:, None, None], values, fallback))


def _gather_pages(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """``[R, max_blocks * block_size, KVH, D]`` float32: every request's whole block table, in order.

    Table entries past a request's length may hold anything (engines leave them stale): they are
    clamped to a valid block, and what they fetch is masked away by the caller.
    """
    ids = block_tables.long().clamp(0, cache.shape[0] - 1)
    return cache[ids].flatten(1, 2).float()


def _attend(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax of ``scores`` over the last dim where ``mask`` holds; rows with no True give zeros."""
    probs = torch.softmax(scores.masked_fill(~mask, _MASKED), dim=-1)
    return probs * mask


def _token_segments(
    cu_seqlens: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each packed token: its segment (request) index, whether it is real, and its index in the segment.

    ``searchsorted(right=True) - 1`` skips empty segments (padding requests repeat the last offset);
    tokens at or past ``cu_seqlens[-1]`` are padding and get segment 0 with ``real`` False.
    """
    tokens = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    segment = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
    real = tokens < cu_seqlens[-1]
    segment = segment.clamp(0, max(cu_seqlens.shape[0] - 2, 0)).long()
    index = tokens.long() - cu_seqlens.long()[segment]
    return segment, real, index


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, scale: float
) -> torch.Tensor:
    """One query token per request over its paged cache, positions ``0 .. seq_lens[r] - 1``.

    ``q [R, H, D]``, ``meta.block_tables [R, max_blocks]``, ``meta.seq_lens [R]``; returns ``[R, H, D]`` in
    q's dtype. A request with ``seq_lens[r] == 0`` gives a zero row. GQA: head ``h`` reads kv head
    ``h // (H // KVH)``.
    """
    check_decode(q, k_cache, v_cache, meta)
    block_tables, seq_lens = meta.block_tables, meta.seq_lens
    requests, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    keys = _gather_pages(k_cache, block_tables)  # [R, P, KVH, D]
    values = _gather_pages(v_cache, block_tables)
    positions = torch.arange(keys.shape[1], device=q.device)
    visible = positions[None, :] < seq_lens.long()[:, None]  # [R, P]
    values = values.masked_fill(~visible[:, :, None, None], 0.0)
    query = q.float().reshape(requests, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("rkgd,rpkd->rkgp", query, keys) * scale
    probs = _attend(scores, visible[:, None, None, :])
    out = torch.einsum("rkgp,rpkd->rkgd", probs, values)
    return out.reshape(requests, heads, dim).to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, scale: float
) -> torch.Tensor:
    """Packed variable-length queries over a paged cache with a cached prefix (chunked prefill, verify).

    ``q [T, H, D]``; request ``r`` owns packed tokens ``cu_seqlens_q[r] .. cu_seqlens_q[r+1] - 1``;
    ``seq_lens[r]`` is its kv length including those tokens (already in the cache). Query ``i`` of
    request ``r`` sits at position ``seq_lens[r] - q_len_r + i`` and attends to kv positions up to and
    including it. Tokens at or past ``cu_seqlens_q[-1]`` give zero rows. Returns ``[T, H, D]``.

    Requests are taken one at a time in a loop over ``R`` (a shape, so the loop is static): each step
    scores all ``T`` queries against one request's keys and keeps the rows of that request, which bounds
    memory to ``[T, H, max_blocks * block_size]``.
    """
    cu_seqlens_q = check_prefill(q, k_cache, v_cache, meta)
    block_tables, seq_lens = meta.block_tables, meta.seq_lens
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    requests = block_tables.shape[0]
    keys = _gather_pages(k_cache, block_tables)  # [R, P, KVH, D]
    values = _gather_pages(v_cache, block_tables)
    if requests == 0:
        return torch.zeros_like(q)
    request, real, index = _token_segments(cu_seqlens_q, tokens)
    lengths = seq_lens.long()
    query_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    query_pos = lengths[request] - query_lens[request] + index  # [T] absolute position of each query
    positions = torch.arange(keys.shape[1], device=q.device)
    causal = positions[None, :] <= query_pos[:, None]  # [T, P]
    query = q.float().reshape(tokens, kv_heads, heads // kv_heads, dim)
    out = torch.zeros_like(query)
    for r in range(requests):
        in_cache = positions < lengths[r]  # [P]
        rows = real & (request == r)  # [T]
        mask = causal & in_cache[None, :] & rows[:, None]  # [T, P]
        scores = torch.einsum("tkgd,pkd->tkgp", query, keys[r]) * scale
        probs = _attend(scores, mask[:, None, None, :])
        out = out + torch.einsum(
            "tkgp,pkd->tkgd", probs, values[r].masked_fill(~in_cache[:, None, None], 0.0)
        )
    return out.reshape(tokens, heads, dim).to(q.dtype)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    causal: bool = False,
) -> torch.Tensor:
    """Block-diagonal attention over packed segments (a vision encoder's images), no cache.

    ``q [T, H, D]``, ``k``/``v [T, KVH, D]``; token ``i`` of segment ``s`` attends to every token of
    ``s`` (``causal=False``) or to those at or before it (``causal=True``). Tokens at or past
    ``cu_seqlens[-1]`` give zero rows. Returns ``[T, H, D]`` in q's dtype.
    """
    check_varlen(q, k, v, cu_seqlens)
    tokens, heads, dim = q.shape
    if tokens == 0:
        return torch.empty_like(q)
    kv_heads = k.shape[1]
    segment, real, _ = _token_segments(cu_seqlens, tokens)
    keys = k.float()
    values = v.float().masked_fill(~real[:, None, None], 0.0)
    query = q.float().reshape(tokens, kv_heads, heads // kv_heads, dim)
    key_ok = real[None, :] & (segment[None, :] == segment[:, None]) & real[:, None]  # [T, T]
    if causal:
        order = torch.arange(tokens, device=q.device)
        key_ok = key_ok & (order[None, :] <= order[:, None])
    chunks = []
    for start in range(0, tokens, _VARLEN_QUERY_CHUNK):
        stop = min(start + _VARLEN_QUERY_CHUNK, tokens)
        scores = torch.einsum("tkgd,ukd->tkgu", query[start:stop], keys) * scale
        probs = _attend(scores, key_ok[start:stop, None, None, :])
        chunks.append(torch.einsum("tkgu,ukd->tkgd", probs, values))
    out = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
    return out.reshape(tokens, heads, dim).to(q.dtype)
