"""Launchers of the Triton attention kernels, with the contract of ``torch_ref``; imports triton.

Launch shapes (grids, tile sizes, split counts) are computed from tensor shapes and device properties
only, so each function can be captured into a CUDA graph for one padded shape and replayed for any
batch composition. Inputs the kernels do not cover (float32, a query dtype other than the cache's,
head dims over 256, more than 64 query heads per kv head) go to the torch reference, which has the same
contract. The kernels run on CUDA (and ROCm) tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from devgraph import InputError
from devgraph.reference.kernels import torch_ref
from devgraph.reference.kernels.interface import (
    PagedMetadata,
    check_decode,
    check_prefill,
    check_varlen,
    check_write,
)
from devgraph.reference.kernels.launching import launch, on_device
from devgraph.reference.kernels.triton_kernels import (
    decode_reduce_kernel,
    decode_split_kernel,
    varlen_flash_kernel,
    write_kv_kernel,
)

__all__ = [
    "DecodeConfig",
    "PrefillConfig",
    "decode_config",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prefill_config",
    "varlen_attention",
    "write_kv",
]

_LOG2E = 1.4426950408889634
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_MAX_GROUP = 64
_MAX_SPLITS = 32


@dataclass(frozen=True)
class DecodeConfig:
    """How a decode launch is cut: kv splits per (request, kv head), tile length, warps, stages."""

    splits: int
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class PrefillConfig:
    """Query tile (rows per program), kv tile, warps and stages of a prefill/varlen launch."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter on the CPU: any fixed number does
        return 16
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def _require_device(t: torch.Tensor) -> None:
    if not on_device(t) and not _interpreting():
        raise InputError(
            f"the triton attention kernels run on GPU tensors, got tensors on {t.device}; use "
            "attention_backend('torch') or attention_backend('auto') for CPU tensors"
        )


def _kernel_covers(q: torch.Tensor, cache: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether the Triton kernels take these inputs (otherwise the torch reference does)."""
    _require_device(q)
    return (
        q.dtype in _KERNEL_DTYPES
        and cache.dtype == q.dtype
        and q.shape[-1] <= _MAX_HEAD_DIM
        and q.shape[1] // num_kv_heads <= _MAX_GROUP
    )


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim is contiguous (any token/head strides are fine), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


# -- write -------------------------------------------------------------------------------------------
def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton ``write_kv``: one program per token; any cache dtype (values are cast to it)."""
    check_write(k, v, k_cache, v_cache, slot_mapping)
    _require_device(k)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    launch(
        write_kv_kernel,
        (tokens,),
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=_pow2(kv_heads, 1),
        BLOCK_D=_pow2(head_dim, 1),
        PAGE=k_cache.shape[1],
        num_warps=4,
    )


# -- decode ------------------------------------------------------------------------------------------
def decode_config(
    requests: int, num_kv_heads: int, max_blocks: int, block_size: int, device: torch.device
) -> DecodeConfig:
    """Splits from static shapes. With at least one (request, kv head) program per multiprocessor, one
    split (no reduction) and 64-position tiles; with fewer, enough splits for about four programs per
    multiprocessor, at most 32 and no more than the block table has 32-position tiles.

    The real length is then cut into that many equal runs on the device, so a batch of one request
    with a long context still spreads over the GPU. (Chosen from a sweep on an H100 with Qwen3-0.6B
    shapes: benchmarks/bench_kernels.py --sweep.)
    """
    programs = max(requests * num_kv_heads, 1)
    multiprocessors = _multiprocessors(device)
    if programs >= multiprocessors:
        return DecodeConfig(splits=1, block_n=64)
    tiles = max((max_blocks * block_size) // 32, 1)
    splits = min(math.ceil(4 * multiprocessors / programs), tiles, _MAX_SPLITS)
    return DecodeConfig(splits=max(splits, 1), block_n=32)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    *,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Triton ``paged_decode_attention`` (split-K flash decoding); ``config`` overrides the launch."""
    check_decode(q, k_cache, v_cache, meta)
    block_tables, seq_lens = meta.block_tables, meta.seq_lens
    requests, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if not _kernel_covers(q, k_cache, kv_heads):
        return torch_ref.paged_decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty((requests, heads, head_dim), device=q.device, dtype=q.dtype)
    if requests == 0:
        return out
    q = _rows_contiguous(q)
    if config is None:
        config = decode_config(requests, kv_heads, block_tables.shape[1], block_size, q.device)
    splits = config.splits
    direct = splits == 1
    if direct:  # the partial buffers are not touched: pass the output in their place
        part_out, part_lse = out, out
    else:
        part_out = torch.empty((requests, heads, splits, head_dim), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((requests, heads, splits), device=q.device, dtype=torch.float32)
    group = heads // kv_heads
    block_d = _pow2(head_dim)
    launch(
        decode_split_kernel,
        (requests, kv_heads, splits),
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        splits,
        heads,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale * _LOG2E,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_G=_pow2(group),
        BLOCK_N=config.block_n,
        PAGE=block_size,
        DIRECT=direct,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not direct:
        launch(
            decode_reduce_kernel,
            (requests, heads),
            part_out,
            part_lse,
            out,
            splits,
            heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            # One width for every split count (masked past ``splits``): one kernel built at start-up,
            # not one per batch size's split count (each build is a Triton compile on a cold start).
            BLOCK_S=_pow2(max(splits, _MAX_SPLITS), 2),
            num_warps=4,
        )
    return out


# -- prefill and varlen ------------------------------------------------------------------------------
def prefill_config(tokens: int, requests: int, head_dim: int) -> PrefillConfig:
    """Short query runs per request (speculative verify, decode-like steps) get 16-row query tiles so a
    tile is not mostly padding; long ones 64. Both come from shapes only (``T / R`` is static). Head
    dims past 128 take 32-position kv tiles and two stages, to stay within shared memory."""
    if head_dim > 128:
        return PrefillConfig(block_m=64, block_n=32, num_stages=2)
    if requests and tokens <= 16 * requests:
        return PrefillConfig(block_m=16, block_n=32)
    return PrefillConfig(block_m=64, block_n=64)


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    paged: bool,
    causal: bool,
    config: PrefillConfig | None,
) -> torch.Tensor:
    tokens, heads, head_dim = q.shape
    requests = cu_seqlens.shape[0] - 1
    kv_heads = k.shape[-2]
    out = torch.empty((tokens, heads, head_dim), device=q.device, dtype=q.dtype)
    if tokens == 0:
        return out
    q = _rows_contiguous(q)
    if config is None:
        config = prefill_config(tokens, requests, head_dim)
    if paged:  # [blocks, block_size, KVH, D]
        k_strides, v_strides, page = k.stride()[:3], v.stride()[:3], k.shape[1]
    else:  # [T, KVH, D]: no block stride
        k, v = _rows_contiguous(k), _rows_contiguous(v)
        k_strides, v_strides, page = (0, *k.stride()[:2]), (0, *v.stride()[:2]), 16
    grid = (tokens // config.block_m + requests + 1, heads)
    launch(
        varlen_flash_kernel,
        grid,
        q,
        k,
        v,
        out,
        cu_seqlens,
        seq_lens,
        block_tables,
        tokens,
        requests,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_strides,
        *v_strides,
        block_tables.stride(0),
        scale * _LOG2E,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=_pow2(head_dim),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        PAGE=page,
        PAGED=paged,
        CAUSAL=causal,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    *,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Triton ``paged_prefill_attention`` (flash attention over packed queries, causal, cached prefix)."""
    cu_seqlens_q = check_prefill(q, k_cache, v_cache, meta)
    if not _kernel_covers(q, k_cache, k_cache.shape[2]):
        return torch_ref.paged_prefill_attention(q, k_cache, v_cache, meta, scale)
    return _flash(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        meta.seq_lens,
        meta.block_tables,
        scale,
        paged=True,
        causal=True,
        config=config,
    )


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    causal: bool = False,
    *,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Triton ``varlen_attention`` (block-diagonal flash attention over packed segments)."""
    check_varlen(q, k, v, cu_seqlens)
    if not _kernel_covers(q, k, k.shape[1]):
        return torch_ref.varlen_attention(q, k, v, cu_seqlens, scale, causal)
    # The kernel's paged-only arguments are not read: any int tensor stands in for them.
    return _flash(
        q, k, v, cu_seqlens, cu_seqlens, cu_seqlens[None], scale, paged=False, causal=causal, config=config
    )
