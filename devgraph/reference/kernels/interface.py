"""The interface every attention backend implements: the paged metadata, the functions' signatures, and
the checks each backend runs on its arguments.

A step's paged metadata is one value, :class:`PagedMetadata`: every backend function over a paged cache
takes it whole, so a new piece of metadata is a field here and a read in the kernels that use it, not an
argument threaded through every signature. The checks read tensor *metadata* only (shapes, dtypes,
devices, strides), never tensor values, so they are safe inside a device-graph capture and cost a few
attribute reads per call.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch

from devgraph import InputError
from devgraph.messages import shorten

__all__ = [
    "PagedAttention",
    "PagedMetadata",
    "VarlenAttention",
    "WriteKV",
    "attention_fake",
    "check_decode",
    "check_prefill",
    "check_varlen",
    "check_write",
]


@dataclass
class PagedMetadata:
    """A step's attention metadata, all device tensors (shapes fixed by the step's key).

    ``slot_mapping [T]`` int64: the cache slot each token's key/value goes to (padding: the scratch slot).
    ``block_tables [R, max_blocks]`` int32, ``seq_lens [R]`` int32 (kv length, new tokens included).
    ``cu_seqlens_q [R + 1]`` int32 for packed steps (prefill, verify); ``None`` in decode.

    A torch operator takes tensors, not a dataclass: an op passes :meth:`tensors` (one ``Tensor?[]``
    argument, in field order) and its body rebuilds the value with :meth:`of`.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor | None]:
        """The fields in order: the form a torch operator's ``Tensor?[]`` argument takes."""
        return [getattr(self, name) for name in _FIELDS]

    @classmethod
    def of(cls, tensors: list[torch.Tensor | None]) -> PagedMetadata:
        """The metadata an operator received as :meth:`tensors`."""
        return cls(*tensors)  # type: ignore[arg-type]


_FIELDS = tuple(field.name for field in fields(PagedMetadata))


def attention_fake(q: torch.Tensor, *_arguments: object) -> torch.Tensor:
    """The shape function (``register_fake``) of every attention operator: a result like its queries, what
    every attention function here returns."""
    return torch.empty_like(q)


class WriteKV(Protocol):
    """``write_kv(k, v, k_cache, v_cache, slot_mapping)``: token ``i`` of ``k``/``v [T, KVH, D]`` goes to
    slot ``slot_mapping[i]``; a negative slot writes nothing."""

    def __call__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...


class PagedAttention(Protocol):
    """``paged_decode_attention`` and ``paged_prefill_attention``: queries ``q`` over the paged caches as
    ``meta`` describes them (decode: one query per request, ``meta.cu_seqlens_q`` unused; prefill: packed
    queries, ``meta.cu_seqlens_q`` required), scaled by ``scale``."""

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, scale: float
    ) -> torch.Tensor: ...


class VarlenAttention(Protocol):
    """``varlen_attention``: block-diagonal attention over packed segments, no cache."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float,
        causal: bool = False,
    ) -> torch.Tensor: ...


_INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(function: str, problem: str, advice: str) -> InputError:
    return InputError(f"{function}: {problem}; {advice}")


def _shape(t: torch.Tensor) -> str:
    return shorten(tuple(t.shape))


def _check_index(function: str, name: str, t: torch.Tensor, ndim: int, device: torch.device) -> None:
    if t.dim() != ndim:
        raise _fail(function, f"{name} has shape {_shape(t)}", f"pass a {ndim}-d integer tensor")
    if t.dtype not in _INDEX_DTYPES:
        raise _fail(function, f"{name} has dtype {t.dtype}", "pass it as torch.int32 (or torch.int64)")
    if t.device != device:
        raise _fail(function, f"{name} is on {t.device} but the cache is on {device}", "move it there")


def _check_cache(function: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """``(block_size, num_kv_heads, head_dim)`` of a paged cache pair, after checking it."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise _fail(
            function,
            f"k_cache {_shape(k_cache)} and v_cache {_shape(v_cache)}",
            "both must be [num_blocks, block_size, num_kv_heads, head_dim] of one shape",
        )
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise _fail(function, "k_cache and v_cache differ in dtype or device", "allocate them alike")
    block_size = k_cache.shape[1]
    if block_size < 16 or block_size & (block_size - 1):
        raise _fail(function, f"block_size is {block_size}", "use a power of two >= 16")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise _fail(function, "the caches' last dimension is strided", "allocate them contiguous")
    return block_size, k_cache.shape[2], k_cache.shape[3]


def _check_heads(function: str, q: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise _fail(function, f"q has shape {_shape(q)}", f"pass [tokens, num_heads, {head_dim}]")
    if q.shape[1] % num_kv_heads:
        raise _fail(
            function,
            f"{q.shape[1]} query heads over {num_kv_heads} kv heads",
            "the number of query heads must be a multiple of the number of kv heads (GQA)",
        )


def check_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Checks for ``write_kv``."""
    function = "write_kv"
    _, num_kv_heads, head_dim = _check_cache(function, k_cache, v_cache)
    expected = (k.shape[0], num_kv_heads, head_dim)
    if k.dim() != 3 or tuple(k.shape) != expected or k.shape != v.shape:
        raise _fail(
            function, f"k {_shape(k)}, v {_shape(v)}", f"both must be [tokens, {num_kv_heads}, {head_dim}]"
        )
    _check_index(function, "slot_mapping", slot_mapping, 1, k_cache.device)
    if slot_mapping.shape[0] != k.shape[0]:
        raise _fail(
            function,
            f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens",
            "pass one each",
        )
    if k.device != k_cache.device or v.device != k_cache.device:
        raise _fail(function, f"k/v are on {k.device}, the cache on {k_cache.device}", "move them there")


def check_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata) -> None:
    """Checks for ``paged_decode_attention``."""
    function = "paged_decode_attention"
    block_tables, seq_lens = meta.block_tables, meta.seq_lens
    _, num_kv_heads, head_dim = _check_cache(function, k_cache, v_cache)
    _check_heads(function, q, num_kv_heads, head_dim)
    _check_index(function, "block_tables", block_tables, 2, k_cache.device)
    _check_index(function, "seq_lens", seq_lens, 1, k_cache.device)
    requests = q.shape[0]
    if block_tables.shape[0] != requests or seq_lens.shape[0] != requests:
        raise _fail(
            function,
            f"q has {requests} rows, block_tables {_shape(block_tables)}, seq_lens {_shape(seq_lens)}",
            "pass one query token, one block-table row and one length per request",
        )
    if q.device != k_cache.device:
        raise _fail(function, f"q is on {q.device}, the cache on {k_cache.device}", "move it there")


def check_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata
) -> torch.Tensor:
    """Checks for ``paged_prefill_attention``; returns ``meta.cu_seqlens_q`` (a packed step has one)."""
    function = "paged_prefill_attention"
    block_tables, seq_lens, cu_seqlens_q = meta.block_tables, meta.seq_lens, meta.cu_seqlens_q
    if cu_seqlens_q is None:
        raise _fail(
            function,
            "meta.cu_seqlens_q is None",
            "pass the cumulative query offsets of a packed step (or call paged_decode_attention)",
        )
    _, num_kv_heads, head_dim = _check_cache(function, k_cache, v_cache)
    _check_heads(function, q, num_kv_heads, head_dim)
    _check_index(function, "block_tables", block_tables, 2, k_cache.device)
    _check_index(function, "cu_seqlens_q", cu_seqlens_q, 1, k_cache.device)
    _check_index(function, "seq_lens", seq_lens, 1, k_cache.device)
    requests = block_tables.shape[0]
    if seq_lens.shape[0] != requests or cu_seqlens_q.shape[0] != requests + 1:
        raise _fail(
            function,
            f"block_tables {_shape(block_tables)}, seq_lens {_shape(seq_lens)}, "
            f"cu_seqlens_q {_shape(cu_seqlens_q)}",
            "pass R block-table rows, R lengths and R + 1 cumulative query offsets",
        )
    if q.device != k_cache.device:
        raise _fail(function, f"q is on {q.device}, the cache on {k_cache.device}", "move it there")
    return cu_seqlens_q


def check_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Checks for ``varlen_attention``."""
    function = "varlen_attention"
    if k.dim() != 3 or k.shape != v.shape:
        raise _fail(
            function, f"k {_shape(k)}, v {_shape(v)}", "both must be [tokens, num_kv_heads, head_dim]"
        )
    _check_heads(function, q, k.shape[1], k.shape[2])
    if k.shape[0] != q.shape[0]:
        raise _fail(function, f"q has {q.shape[0]} tokens, k {k.shape[0]}", "pack q, k and v alike")
    if k.device != q.device or v.device != q.device or k.dtype != v.dtype:
        raise _fail(function, "q, k and v differ in device (or k and v in dtype)", "pass them alike")
    _check_index(function, "cu_seqlens", cu_seqlens, 1, q.device)
    if cu_seqlens.shape[0] < 1:
        raise _fail(function, "cu_seqlens is empty", "pass at least [0]")
