"""Paged-free KV-cache attention of the reference model, declared as a break op.

The op is pure tensor code, so it can be captured inside a device graph (``full``), and it is a
``graph_break`` op, so ``breakable`` and ``tc_piecewise`` run it eagerly between graph segments.
"""

# No ``from __future__ import annotations`` here: torch derives the operator schema from the annotations.

import torch
import torch.nn.functional as F

from devgraph.breaks import graph_break
from devgraph.context import get_forward_context

__all__ = ["attention", "ATTENTION_OP_NAME"]

ATTENTION_OP_NAME = "devgraph_ref::attention"


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, KVH, S, D] -> [B, KVH * groups, S, D]``; query head ``h`` reads KV head ``h // groups``.

    Used in prefill, where the keys are only this step's tokens, so the copy is small.
    """
    if groups == 1:
        return x
    b, kvh, s, d = x.shape
    return x[:, :, None].expand(b, kvh, groups, s, d).reshape(b, kvh * groups, s, d)


def _decode_window(cache_len: int) -> int:
    """How many cache positions decode must read: the context's ``max_seq_len`` if it gives one."""
    context = get_forward_context()
    window = getattr(context, "max_seq_len", None) if context is not None else None
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        return min(window, cache_len)
    return cache_len


def _attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_slots: torch.Tensor,
    positions: torch.Tensor,
    is_prefill: bool,
) -> torch.Tensor:
    return torch.empty_like(q)


@graph_break(ATTENTION_OP_NAME, mutates_args=("k_cache", "v_cache"), fake=_attention_fake)
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_slots: torch.Tensor,
    positions: torch.Tensor,
    is_prefill: bool,
) -> torch.Tensor:
    """Write this step's keys/values into the cache, then attend; returns a new ``[N, H, D]`` tensor.

    Shapes: ``q [N, H, D]``, ``k``/``v [N, KVH, D]``, ``k_cache``/``v_cache [R + 1, S, KVH, D]``
    (row ``R`` is the padding slot), ``req_slots``/``positions [N]`` int64. Token ``i`` is written at
    ``cache[req_slots[i], positions[i]]``.

    * Decode (``is_prefill=False``): row ``i`` attends to its request's cache row, positions
      ``0..positions[i]`` (the token just written included).
    * Prefill (``is_prefill=True``): ``N`` packed tokens of new requests (no cached prefix); token ``i``
      attends to packed token ``j`` iff they share a slot and ``positions[j] <= positions[i]``.

    Everything is tensor ops with shapes fixed by the inputs' shapes (no ``.item()``, no ``nonzero``, no
    boolean indexing), so the op can be captured into a device graph.

    Host-side lengths: a break op replays with its capture-time tensors, but it runs as Python at every
    replay, so it may read per-batch host state. In decode, if :func:`devgraph.context.get_forward_context`
    returns an object whose ``max_seq_len`` is an int, only ``cache[:, :max_seq_len]`` is read; the
    result is the same as over the full window as long as every position is below ``max_seq_len``, and
    far cheaper for short sequences. This is how real engines feed attention kernels host-side
    sequence lengths. Leave the context ``None`` (or without ``max_seq_len``) while this op is captured
    *into* a graph (``full``): a window read at capture would be baked into every replay.
    """
    # Tensor-indexed index_put_ has a fixed launch shape, unlike slicing by a position read on the host.
    k_cache.index_put_((req_slots, positions), k)
    v_cache.index_put_((req_slots, positions), v)
    groups = q.shape[1] // k.shape[1]

    if is_prefill:
        # One batch of N packed tokens; the mask keeps requests apart and causal within each.
        same_request = req_slots[:, None] == req_slots[None, :]
        causal = positions[None, :] <= positions[:, None]
        mask = (same_request & causal)[None, None]  # [1, 1, N, N]
        q_b = q.transpose(0, 1)[None]  # [1, H, N, D]
        k_b = _repeat_kv(k.transpose(0, 1)[None], groups)
        v_b = _repeat_kv(v.transpose(0, 1)[None], groups)
        out = F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=mask)  # [1, H, N, D]
        return out[0].transpose(0, 1).contiguous()

    window = _decode_window(k_cache.shape[1])
    n, kvh, d = k.shape
    # Slice (a view) before gathering so only the window is copied.
    keys = k_cache[:, :window].index_select(0, req_slots).permute(0, 2, 1, 3)  # [N, KVH, W, D]
    values = v_cache[:, :window].index_select(0, req_slots).permute(0, 2, 1, 3)
    visible = torch.arange(window, device=q.device) <= positions[:, None]  # [N, W]
    # GQA without copying the cache window once per query head: the `groups` query heads that share a
    # KV head become `groups` query rows against it (same mask for each), as decode kernels do.
    out = F.scaled_dot_product_attention(
        q.reshape(n, kvh, groups, d), keys, values, attn_mask=visible[:, None, None, :]
    )  # [N, KVH, groups, D]
    return out.reshape(n, kvh * groups, d).contiguous()
