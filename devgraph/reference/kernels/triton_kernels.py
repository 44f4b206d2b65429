"""Triton kernels of the attention contract. Imports triton: only ``triton_ops`` imports this module.

Every kernel reads its metadata (slots, block tables, lengths, cumulative offsets) from device memory
and takes its grid from tensor shapes, so a CUDA graph captured once replays for any batch composition.
Softmax runs in base 2 (``scale_log2 = scale * log2(e)``) in float32; masked scores are ``-inf`` and
every subtraction of a running maximum goes through a finite stand-in, so rows with nothing to attend
to give zeros, never NaN. Block ids and token offsets are widened to int64 before they are multiplied
by strides (large caches pass 2**31 elements).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["decode_reduce_kernel", "decode_split_kernel", "varlen_flash_kernel", "write_kv_kernel"]


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
):
    """One program per token: copy its ``[KVH, D]`` keys and values to its slot; skip a negative slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE
        offset = slot % PAGE
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads[:, None] * stride_kch
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads[:, None] * stride_vch
        tl.store(k_dst + dims[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_splits", "num_heads"])
def decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_splits,
    num_heads,
    stride_qr,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,
    stride_or,
    stride_oh,
    scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """Flash-decoding, grid ``(R, KVH, num_splits)``: split ``s`` of request ``r`` reads its share of
    ``0 .. seq_lens[r] - 1`` (the length is cut into ``num_splits`` equal runs of whole ``BLOCK_N``
    tiles) for the ``GROUP`` query heads of one kv head, as ``BLOCK_G`` (>= 16) rows of one ``tl.dot``.

    ``DIRECT`` (one split): write the normalised output. Otherwise write the split's normalised partial
    output and its base-2 log-sum-exp (``-inf`` when it saw nothing) for ``decode_reduce_kernel``.
    Splits past the length run no iteration: cost follows the real length.
    """
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + req * stride_qr + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        pos_ok = pos < end
        block = tl.load(table + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        offset = (pos % PAGE).to(tl.int64)
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k_rows = block * stride_kb + offset * stride_ko + kv_head * stride_kh
        k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k)) * scale_log2
        qk = tl.where(pos_ok[None, :], qk, float("-inf"))
        # Every tile iterated holds at least one position < end, so the new maximum is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = block * stride_vb + offset * stride_vo + kv_head * stride_vh
        v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if DIRECT:
        o_ptr = out_ptr + req * stride_or + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (req * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=q_mask)
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits", "num_heads"])
def decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    num_heads,
    stride_or,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Grid ``(R, H)``: merge the splits' partial outputs, weighted by their log-sum-exps."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    base = (req * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + splits, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.math.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # exp2(-inf) = 0
    total = tl.sum(weight, 0)
    parts = tl.load(
        part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + req * stride_or + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok
    )


# Counts are not specialised: a value of 1 would become a compile-time constant (another kernel per count,
# and a loop-carried constant in the request search).
@triton.jit(do_not_specialize=["num_tokens", "num_requests"])
def varlen_flash_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_tokens,
    num_requests,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Flash attention over packed queries, grid ``(T // BLOCK_M + R + 1, H)``.

    Request ``r``'s query tiles are numbered from ``cu_q[r] // BLOCK_M + r`` (strictly increasing in
    ``r``, and leaving room for ``ceil(q_len / BLOCK_M)`` tiles); a program finds its request by binary
    search over ``cu_q`` on the device. Index ``R`` stands for the padding tail ``cu_q[R] .. T - 1``,
    whose tiles write zero rows. Tiles past a request's queries exit at once.

    ``PAGED``: keys live in a paged cache (``stride_kb`` per block, ``stride_kt`` per offset) at
    positions ``0 .. seq_lens[r] - 1``, and query ``i`` sits at ``seq_lens[r] - q_len + i``.
    Otherwise keys are the packed tokens of the same segment (``stride_kt`` per token) and query ``i``
    sits at ``i``. ``CAUSAL``: a query sees positions up to its own.
    """
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    lo = 0
    hi = num_requests
    while lo < hi:  # the last r in [0, R] whose first tile is <= this one
        mid = (lo + hi + 1) // 2
        first = tl.load(cu_q_ptr + mid).to(tl.int32) // BLOCK_M + mid
        if first <= tile:
            lo = mid
        else:
            hi = mid - 1
    req = lo
    q_start = tl.load(cu_q_ptr + req).to(tl.int32)
    local = tile - (q_start // BLOCK_M + req)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_index = local * BLOCK_M + rows
    tokens = (q_start + q_index).to(tl.int64)
    if req == num_requests:
        tail = (tokens < num_tokens)[:, None] & dim_ok[None, :]
        zeros = tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :], zeros, mask=tail)
        return
    q_len = tl.load(cu_q_ptr + req + 1).to(tl.int32) - q_start
    if local * BLOCK_M >= q_len:
        return
    if PAGED:  # noqa: SIM108 - an if statement on a constexpr is what the triton JIT compiles away
        kv_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    else:
        kv_len = q_len
    q_pos = kv_len - q_len + q_index
    row_ok = q_index < q_len
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=q_mask, other=0.0
    )
    if CAUSAL:  # the last query of the tile bounds what the tile reads
        kv_end = tl.minimum(kv_len, kv_len - q_len + tl.minimum(q_len, (local + 1) * BLOCK_M))
    else:
        kv_end = kv_len

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + req * stride_bt  # R * max_blocks entries: int32 is enough
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    # Tiles before `full_end` are visible to every query of this tile (positions up to the first query's,
    # or the whole segment without CAUSAL): no masks there. The rest (the diagonal, the ragged end) masks.
    if CAUSAL:
        full_end = ((kv_len - q_len + local * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    else:
        full_end = (kv_len // BLOCK_N) * BLOCK_N
    full_end = tl.maximum(full_end, 0)
    for start in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _flash_step(
            q, acc, l_i, m_i, k_base, v_base, table, q_start, q_pos, start, kv_end, dims, dim_ok,
            stride_kb, stride_kt, stride_vb, stride_vt, scale_log2,
            BLOCK_N, PAGE, PAGED, CAUSAL, False,
        )  # fmt: skip
    for start in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _flash_step(
            q, acc, l_i, m_i, k_base, v_base, table, q_start, q_pos, start, kv_end, dims, dim_ok,
            stride_kb, stride_kt, stride_vb, stride_vt, scale_log2,
            BLOCK_N, PAGE, PAGED, CAUSAL, True,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptr = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _flash_step(
    q,
    acc,
    l_i,
    m_i,
    k_base,
    v_base,
    table,
    q_start,
    q_pos,
    start,
    kv_end,
    dims,
    dim_ok,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    scale_log2,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One kv tile of ``varlen_flash_kernel``'s online softmax; ``MASKED`` for tiles some query must not
    see in full (past ``kv_end``, or past a query's position under ``CAUSAL``)."""
    pos = start + tl.arange(0, BLOCK_N)
    pos_ok = pos < kv_end
    kv_mask = dim_ok[None, :]
    if MASKED:
        kv_mask = pos_ok[:, None] & kv_mask
    if PAGED:
        block = tl.load(table + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        offset = (pos % PAGE).to(tl.int64)
        k_rows = block * stride_kb + offset * stride_kt
        v_rows = block * stride_vb + offset * stride_vt
    else:
        token = (q_start + pos).to(tl.int64)
        k_rows = token * stride_kt
        v_rows = token * stride_vt
    k = tl.load(k_base + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k)) * scale_log2
    if MASKED:
        visible = pos_ok[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new
