"""Attention kernels over device metadata: a paged KV cache that device graphs can replay for any batch.

Every function reads its metadata (slots, block tables, lengths, cumulative offsets) from device
tensors and never on the host, and every launch shape follows tensor shapes only, so a forward that
uses them can be captured once per padded shape and replayed for any batch composition.

The contract (``k_cache``/``v_cache [num_blocks, block_size, KVH, D]``, block_size a power of two
>= 16; a flat slot is ``block * block_size + offset``):

* ``write_kv(k, v, k_cache, v_cache, slot_mapping)``: token ``i`` of ``k``/``v [T, KVH, D]`` goes to
  slot ``slot_mapping[i]`` (``[T]``); a negative slot writes nothing.
* ``paged_decode_attention(q, k_cache, v_cache, meta, scale) -> [R, H, D]``: one query per request
  (``q [R, H, D]``; of the step's :class:`PagedMetadata` ``meta`` it reads ``block_tables [R,
  max_blocks]`` int32 and ``seq_lens [R]`` int32, the current token included); ``seq_lens[r] == 0`` gives
  a zero row.
* ``paged_prefill_attention(q, k_cache, v_cache, meta, scale) -> [T, H, D]``: packed queries
  (``meta.cu_seqlens_q [R + 1]``), a cached prefix, causal; ``meta.seq_lens`` includes the new tokens;
  tokens at or past ``cu_seqlens_q[-1]`` give zero rows.
* ``varlen_attention(q, k, v, cu_seqlens, scale, causal=False) -> [T, H, D]``: block-diagonal
  attention over packed segments without a cache; tokens at or past ``cu_seqlens[-1]`` give zero rows.

GQA everywhere: query head ``h`` reads kv head ``h // (H // KVH)``. Outputs are new tensors in q's
dtype. Block-table entries past a request's length are never read by the Triton kernels and are
clamped by the reference, so engines may leave them stale.

The paged metadata and the signatures are declared once, in ``devgraph.reference.kernels.interface``
(with the argument checks every backend runs). ``attention_backend("triton" | "torch" | "auto")`` returns
the four functions of one backend; triton is imported only when asked for (``available_backends()`` says
whether it imports here). The reference functions themselves live in ``devgraph.reference.kernels.torch_ref``.
"""

from devgraph.reference.kernels.backends import (
    BACKEND_NAMES,
    AttentionKernels,
    attention_backend,
    available_backends,
)
from devgraph.reference.kernels.interface import PagedAttention, PagedMetadata, VarlenAttention, WriteKV

__all__ = [
    "BACKEND_NAMES",
    "AttentionKernels",
    "PagedAttention",
    "PagedMetadata",
    "VarlenAttention",
    "WriteKV",
    "attention_backend",
    "available_backends",
]
