"""The Triton kernels a reference decoder's decode step launches, built ahead, on another thread.

A cold start on a GPU used to compile eight of these kernels inside its first captures: 1.56 s of the
7.88 s a regional-compile warm-up took on an H200 (``triton_jit_compiles`` in
``benchmarks/results/h200-startup-pyc-round12-before.json``), each compile and, on Triton 3.6, each
launcher's C build on the critical path.
:func:`build_decode_kernels` builds them while the weights are drawn or loaded
(:func:`~devgraph.reference.fused.set_up_triton` runs it on its thread): it calls the kernels' own
wrappers, as the decoder layer calls them, on ``meta`` tensors of the layer's shapes and views, inside
:func:`~devgraph.reference.kernels.launching.build_only`. So the build specialises on the same dtypes,
strides, alignments and compile-time values as the later launch, without one byte of device memory and
without a launch. What depends on the step's size is few kernels: the projections' Triton tilings (by
rows, up to :data:`~devgraph.reference.kernels.triton_linear.MAX_ROWS`) and the decode attention's two
forms (split over the cache, or one program per request and head); every other kernel is size-free.

Not built here: the prefill kernels (a server's first prefill compiles them, as before) and the
tensor-parallel all-reduce (built by its own set-up).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from devgraph.reference.config import ReferenceConfig
from devgraph.reference.kernels.interface import PagedMetadata
from devgraph.reference.kernels.launching import build_only

__all__ = ["DecodeShapes", "build_decode_kernels"]


@dataclass(frozen=True)
class DecodeShapes:
    """What the decode step's kernels specialise on, for one process's share of the model."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # this process's rows of the LM head
    logits_vocab: int  # a step's logits, whole (the greedy tokens are taken from them)
    dtype: torch.dtype
    qk_norm: bool
    qkv_bias: bool
    paged: bool  # attention through the paged Triton kernels (not SDPA)
    block_size: int
    max_blocks: int
    eps: float

    @classmethod
    def of(cls, config: ReferenceConfig, shards: int = 1) -> DecodeShapes:
        """``config``'s shapes; ``shards``: the tensor-parallel size (heads, MLP and vocabulary split)."""
        return cls(
            hidden=config.hidden_size,
            heads=config.num_heads // shards,
            kv_heads=max(config.num_kv_heads // shards, 1),
            head_dim=config.head_dim,
            intermediate=config.intermediate_size // shards,
            vocab=config.vocab_size // shards,
            logits_vocab=config.vocab_size,
            dtype=config.dtype,
            qk_norm=config.qk_norm,
            qkv_bias=config.qkv_bias,
            paged=config.attention == "paged",
            block_size=config.block_size,
            max_blocks=config.max_blocks_per_request,
            eps=config.rms_eps,
        )


def build_decode_kernels(
    shapes: DecodeShapes, device: torch.device, rows: Iterable[int] | None = None
) -> None:
    """Build every Triton kernel a decode step of ``shapes`` launches on ``device``: the size-free ones
    once, the projections' tilings for each row count in ``rows`` (default 1 to ``MAX_ROWS``, powers of
    two first; more rows run on cuBLAS). Launches nothing and allocates no device memory (see the module
    docstring); raises what Triton raises (the caller treats the build as an optimisation)."""
    fused = importlib.import_module("devgraph.reference.kernels.triton_fused")
    argmax = importlib.import_module("devgraph.reference.kernels.triton_argmax")
    linear = importlib.import_module("devgraph.reference.kernels.triton_linear")
    s = shapes
    counts = list(rows) if rows is not None else _rows_in_build_order(linear.MAX_ROWS)

    def empty(*size: int, dtype: torch.dtype = s.dtype) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device="meta")

    qkv_width = (s.heads + 2 * s.kv_heads) * s.head_dim
    weights = {
        "qkv": (empty(qkv_width, s.hidden), empty(qkv_width) if s.qkv_bias else None),
        "o": (empty(s.hidden, s.heads * s.head_dim), None),
        "gate_up": (empty(2 * s.intermediate, s.hidden), None),
        "down": (empty(s.hidden, s.intermediate), None),
        "lm_head": (empty(s.vocab, s.hidden), None),
    }
    with build_only():
        hidden = empty(1, s.hidden)
        norm = empty(s.hidden)
        fused.rms_norm(hidden, norm, s.eps)  # a layer's input norm (the first layer's, the final norm)
        fused.rms_norm(empty(1, s.hidden), norm, s.eps, empty(1, s.hidden))  # after attention: add + norm
        qkv = linear.linear(hidden, *weights["qkv"]).view(1, -1, s.head_dim)
        qk, v = qkv.split((s.heads + s.kv_heads, s.kv_heads), dim=1)
        scale = empty(s.heads + s.kv_heads, s.head_dim) if s.qk_norm else None
        half = s.head_dim // 2
        qk = fused.qk_norm_rope(qk, scale, empty(1, half), empty(1, half), s.eps)
        q, k = qk.split((s.heads, s.kv_heads), dim=1)
        if s.paged:
            _build_attention(q, k, v, s, device)
        fused.silu_mul(empty(1, 2 * s.intermediate))
        if s.dtype in argmax.TAKES:  # the greedy tokens a server takes inside its decode graph
            argmax.argmax_rows(empty(1, s.logits_vocab))
        inputs = {"qkv": s.hidden, "o": s.heads * s.head_dim, "gate_up": s.hidden, "down": s.intermediate}
        inputs["lm_head"] = s.hidden
        for count in counts:
            for name, (weight, bias) in weights.items():
                linear.linear(empty(count, inputs[name]), weight, bias)


def _rows_in_build_order(most: int) -> list[int]:
    """1 to ``most`` rows, powers of two first: the sizes capture plans hold most (a capture that needs a
    kernel before this thread has built it compiles it on the main thread)."""
    powers = [1 << i for i in range(most.bit_length()) if 1 << i <= most]
    return powers + [n for n in range(1, most + 1) if n not in powers]


def _build_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: DecodeShapes, device: torch.device
) -> None:
    """The cache write and both forms of the split-KV decode (with its reduction): which one a step
    runs depends on its number of requests; each is one kernel for every size (the split count and the
    head count are not specialised on)."""
    ops = importlib.import_module("devgraph.reference.kernels.triton_ops")
    cache = (2, s.block_size, s.kv_heads, s.head_dim)
    k_cache = torch.empty(cache, dtype=s.dtype, device="meta")
    v_cache = torch.empty(cache, dtype=s.dtype, device="meta")
    slots = torch.empty(1, dtype=torch.int64, device="meta")
    ops.write_kv(k, v, k_cache, v_cache, slots)
    meta = PagedMetadata(
        slots,
        torch.empty((1, s.max_blocks), dtype=torch.int32, device="meta"),
        torch.empty(1, dtype=torch.int32, device="meta"),
    )
    one = ops.decode_config(1, s.kv_heads, s.max_blocks, s.block_size, device)
    many = ops.decode_config(1 << 16, s.kv_heads, s.max_blocks, s.block_size, device)
    for config in {one, many}:
        ops.paged_decode_attention(q, k_cache, v_cache, meta, s.head_dim**-0.5, config=config)
