"""Greedy tokens: the index of each row's largest logit, in two short Triton kernels (imports triton).

``torch.argmax`` over a decode step's logits (``[R, V]`` with ``V`` of 150k) runs one reduction kernel
that reads a row with few blocks, plus a memset of its semaphores: on an H200, 8.8 us at one row and
16.5 us at 32 (``benchmarks/results/h200-step-gap*.json``), the largest single piece of a served decode
step's device work outside its graph. Here the row is cut into ``BLOCK``-wide chunks, each chunk's best
found by its own program (``[R, cdiv(V, BLOCK)]`` programs: every SM busy even at one row), and one
program per row picks the best of its chunks.

The result is ``torch.argmax``'s, bit for bit, for float16, bfloat16 and float32 logits (the dtypes it
takes): values compare in float32, exact for all three; among equal maxima the lowest index wins; a NaN
counts as larger than every number, so a row with one gives its first NaN's index, as ``torch.argmax``
does.

They pay inside a graph: 3.0 us of the device's time at one row against ``torch.argmax``'s 8.6 there. Issued
eagerly their two launches from Python cost about 54 us of the host's time against torch's 12
(``h200-argmax.json``): the serving engine takes its greedy tokens from inside the decode graph
(``ReferenceModel.decode_step_with_greedy``), not from a launch after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from devgraph.reference.kernels.launching import launch

__all__ = ["BLOCK", "TAKES", "argmax_rows"]

#: The logits' dtypes the kernels take (compared in float32, which holds each exactly).
TAKES = (torch.float16, torch.bfloat16, torch.float32)
#: Logits per first-stage program: 75 programs a row at a vocabulary of 151936.
BLOCK = 2048
#: Larger than any index: "no such element" in the min-reductions over indices.
_NONE = 2**31 - 1


@triton.jit
def _chunk_best_kernel(
    logits, best_val, best_idx, first_nan, vocab, stride_row, chunks, BLOCK: tl.constexpr, NONE: tl.constexpr
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    start = logits + row.to(tl.int64) * stride_row
    x = tl.load(start + offs, mask=inside, other=float("-inf")).to(tl.float32)
    nan = (x != x) & inside
    numbers = tl.where(nan, float("-inf"), x)
    best = tl.max(numbers, axis=0)
    # the first index holding the best number (a row of -inf: its first index, as torch.argmax)
    idx = tl.min(tl.where((numbers == best) & inside & (~nan), offs, NONE), axis=0)
    at = row * chunks + chunk
    tl.store(best_val + at, best)
    tl.store(best_idx + at, idx)
    tl.store(first_nan + at, tl.min(tl.where(nan, offs, NONE), axis=0))


@triton.jit
def _row_best_kernel(best_val, best_idx, first_nan, out, chunks, CHUNKS: tl.constexpr, NONE: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS)
    inside = offs < chunks
    at = row * chunks + offs
    vals = tl.load(best_val + at, mask=inside, other=float("-inf"))
    idxs = tl.load(best_idx + at, mask=inside, other=NONE)
    nans = tl.load(first_nan + at, mask=inside, other=NONE)
    best = tl.max(vals, axis=0)
    token = tl.min(tl.where(vals == best, idxs, NONE), axis=0)
    nan = tl.min(nans, axis=0)
    tl.store(out + row, tl.where(nan < NONE, nan, token).to(tl.int64))


def argmax_rows(logits: torch.Tensor, *, block: int = BLOCK) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``logits [R, V]`` (:data:`TAKES`, rows of unit stride) as int64 ``[R]``.
    ``block``: logits per first-stage program (a power of two; ``benchmarks/bench_argmax.py`` times the
    choices). On a GPU, or on the CPU under Triton's interpreter."""
    if logits.dim() != 2 or logits.dtype not in TAKES or logits.stride(-1) != 1:
        raise ValueError(
            "argmax_rows takes float16, bfloat16 or float32 logits [R, V] with unit-stride rows "
            f"(torch.argmax takes the rest); got {logits.dtype} "
            f"{tuple(logits.shape)} with strides {logits.stride()}"
        )
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax_rows: a row of no logits has no largest one (torch.argmax raises too)")
    if vocab >= _NONE:
        raise ValueError(f"argmax_rows takes fewer than {_NONE} logits a row; got {vocab}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"argmax_rows: block must be a power of two >= 16; got {block}")
    chunks = triton.cdiv(vocab, block)
    best_val = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    first_nan = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    launch(
        _chunk_best_kernel, (rows, chunks),
        logits, best_val, best_idx, first_nan, vocab, logits.stride(0), chunks, BLOCK=block, NONE=_NONE,
        num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    launch(
        _row_best_kernel, (rows,),
        best_val, best_idx, first_nan, out, chunks, CHUNKS=max(triton.next_power_of_2(chunks), 16),
        NONE=_NONE, num_warps=4 if chunks > 256 else 1,
    )  # fmt: skip
    return out
