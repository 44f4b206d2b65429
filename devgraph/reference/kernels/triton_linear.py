"""A Triton matrix-vector product for decode steps of a few rows: ``y = x @ w.T (+ bias)`` for ``x [M, K]``
with ``M <= MAX_ROWS`` and ``w [N, K]`` (imports triton).

At batch 1 a decode step reads every weight once and does almost no arithmetic, so it runs at the speed
the weights stream from memory. cuBLAS falls short of that on narrow projections: on an H200 its kernel for
Qwen3-0.6B's output projection (``[1, 2048] x [2048, 1024]``, 4 MiB of weight) takes 12.8 us, this one 3.7
(``benchmarks/results/h200-linear.json``); at Llama-3-8B's widths the two are level. This kernel splits
``N`` only: each program owns ``BLOCK_N`` output columns, walks the whole of ``K`` in ``BLOCK_K`` steps and
writes its columns once. No split over ``K`` means no second pass and no atomics: the result does not
depend on the launch, the same on every run and every rank.

Two forms, both summing in float32 and rounding once to the output's dtype:

* ``dot``: the rows padded to 16 and multiplied on the tensor cores (``tl.dot``), so Triton's pipeliner
  keeps ``STAGES`` weight tiles in flight per program;
* ``sum``: the rows (padded to a power of two) multiplied and summed on the CUDA cores, ``BLOCK_N x
  BLOCK_K`` weights per step.

:func:`config_for` picks the form and tile per shape class from :data:`CONFIGS` (or cuBLAS, where the
sweep found it as fast); :func:`linear` runs on GPU tensors, or on CPU tensors under ``TRITON_INTERPRET=1``
(the tests; Triton's interpreter multiplies bfloat16 tiles wrongly, so they use float16 and float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "CONFIGS",
    "HALF",
    "LM_HEAD_COLUMNS",
    "LONG_K",
    "MAX_ROWS",
    "SMALL_WEIGHT",
    "WIDE_COLUMNS",
    "LinearConfig",
    "build_linear",
    "config_for",
    "linear",
]

#: The most rows the kernels take; more rows are a matrix product, cuBLAS's job.
MAX_ROWS = 16


@dataclass(frozen=True)
class LinearConfig:
    """How one launch tiles the product: the form (``dot`` or ``sum``), the tile, warps and stages."""

    form: str
    block_n: int
    block_k: int
    warps: int
    stages: int = 1


#: The dtypes :func:`linear` takes the kernel for by itself (the sweep's); float32 stays on cuBLAS unless a
#: tiling is asked for.
HALF = (torch.float16, torch.bfloat16)

#: The tilings :func:`config_for` picks from, named by what they suit (``benchmarks/bench_linear.py``'s
#: sweep on an H200, ``benchmarks/results/h200-linear.json``).
CONFIGS: dict[str, LinearConfig] = {
    # One row: two output columns a program, the whole of K in 1024-wide steps on the CUDA cores.
    "one_row": LinearConfig("sum", block_n=2, block_k=1024, warps=4),
    # A few rows, or one row over a long K (a down projection): tensor cores, six tiles in flight.
    "few_rows": LinearConfig("dot", block_n=16, block_k=128, warps=2, stages=6),
    "long_k": LinearConfig("dot", block_n=32, block_k=512, warps=4, stages=3),
    # An LM head (tens of thousands of columns): wider tiles, fewer programs to schedule.
    "wide": LinearConfig("dot", block_n=32, block_k=256, warps=4, stages=4),
}

#: From this many output columns on, a projection of several rows stays on cuBLAS (Llama-3-8B's gate/up,
#: whole or halved, and every LM head: cuBLAS was level or faster there in the sweep).
WIDE_COLUMNS = 8192
#: Above this many columns a projection of one row is an LM head (a vocabulary): the ``wide`` tiling.
LM_HEAD_COLUMNS = 30_000
#: Weights of at most this many elements are small (Qwen3-0.6B's): cuBLAS from eight rows on.
SMALL_WEIGHT = 8 * 1024 * 1024
#: From this depth on a projection takes ``long_k`` (Llama-3-8B's down projection, 14336).
LONG_K = 8192


@triton.jit
def _linear_dot_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    rows,
    n,
    k,
    stride_x,
    stride_w,
    stride_o,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, 16)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < rows
    col_ok = offs_n < n
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_w
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, k, BLOCK_K, num_stages=STAGES):
        ks = k0 + offs_k
        k_ok = ks < k
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _linear_sum_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    rows,
    n,
    k,
    stride_x,
    stride_w,
    stride_o,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_r = tl.arange(0, ROWS)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_r < rows
    col_ok = offs_n < n
    x_rows = x_ptr + offs_r[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    # Products summed per lane over the whole of K, reduced across lanes once at the end.
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < k
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w[None, :, :] * x[:, None, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_r[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def config_for(rows: int, n: int, k: int) -> LinearConfig | None:
    """The tiling :func:`linear` uses for ``[rows, k] x [k, n]``, or ``None`` where cuBLAS was as fast or
    faster in the sweep: more than :data:`MAX_ROWS` rows; at more than one row, a wide projection (a
    gate/up or an LM head, :data:`WIDE_COLUMNS`), and from eight rows on a small one (Qwen3-0.6B's)."""
    if rows < 1 or rows > MAX_ROWS:
        return None
    if rows == 1:
        if n > LM_HEAD_COLUMNS:
            return CONFIGS["wide"]
        return CONFIGS["long_k"] if k >= LONG_K else CONFIGS["one_row"]
    if n >= WIDE_COLUMNS or (rows >= 8 and n * k <= SMALL_WEIGHT):
        return None
    return CONFIGS["long_k"] if k >= LONG_K else CONFIGS["few_rows"]


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]`` and ``weight [N, K]``: ``[M, N]`` in ``x``'s dtype (``x`` of
    another rank: ``F.linear``).

    The Triton kernel runs where :func:`config_for` gives a tiling for half-precision operands (or
    ``config`` is given) and the operands suit it (rows of ``x`` and ``weight`` contiguous, one dtype,
    one device); anything else is ``torch.nn.functional.linear``, so every shape works."""
    if x.dim() != 2:
        return torch.nn.functional.linear(x, weight, bias)
    rows, k = x.shape
    n = weight.shape[0]
    if config is not None and rows > MAX_ROWS:
        raise ValueError(f"a Triton tiling takes at most {MAX_ROWS} rows; got x {tuple(x.shape)}")
    c = config if config is not None else config_for(rows, n, k) if x.dtype in HALF else None
    if c is None or rows == 0 or n == 0 or k == 0 or not _suits(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.empty((rows, n), device=x.device, dtype=x.dtype)
    has_bias = bias is not None
    b = bias if bias is not None else weight
    grid = (triton.cdiv(n, c.block_n),)
    if c.form == "sum":
        _linear_sum_kernel[grid](
            x, weight, b, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=has_bias, ROWS=triton.next_power_of_2(rows), BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            num_warps=c.warps,
        )  # fmt: skip
    else:
        _linear_dot_kernel[grid](
            x, weight, b, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=has_bias, BLOCK_N=c.block_n, BLOCK_K=c.block_k, STAGES=c.stages,
            PRECISION=_precision(x.dtype), num_warps=c.warps, num_stages=c.stages,
        )  # fmt: skip
    return out


def _precision(dtype: torch.dtype) -> str:
    """float32 multiplied as float32 (``F.linear``'s default, no TF32); half types as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _suits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Operands the kernels read as they assume: 2-D, last dimension contiguous, one dtype and device."""
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or x.stride(1) != 1 or weight.stride(1) != 1:
        return False
    if weight.dtype != x.dtype or weight.device != x.device:
        return False
    return bias is None or (
        bias.shape == (weight.shape[0],) and bias.stride(0) == 1 and bias.dtype == x.dtype
    )


def build_linear(dtype: torch.dtype, has_bias: bool = False) -> None:
    """Build (or load from Triton's cache) every kernel :func:`linear` launches for one row of ``dtype``
    and the tensor-core forms, without launching them (no device memory), as
    ``triton_fused.build_silu_mul`` does for its kernel: a start-up's first capture then compiles none."""
    for c in CONFIGS.values():
        if c.form == "sum":
            _linear_sum_kernel.warmup(
                dtype, dtype, dtype, dtype, 1, 4096, 4096, 4096, 4096, 4096,
                HAS_BIAS=has_bias, ROWS=1, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.warps,
                grid=(1,),
            )  # fmt: skip
        else:
            _linear_dot_kernel.warmup(
                dtype, dtype, dtype, dtype, 1, 4096, 4096, 4096, 4096, 4096,
                HAS_BIAS=has_bias, BLOCK_N=c.block_n, BLOCK_K=c.block_k, STAGES=c.stages,
                PRECISION=_precision(dtype), num_warps=c.warps, num_stages=c.stages, grid=(1,),
            )  # fmt: skip
