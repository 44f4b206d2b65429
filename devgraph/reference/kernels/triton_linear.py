"""A Triton matrix-vector product for decode steps of a few rows: ``y = x @ w.T (+ bias)`` for ``x [M, K]``
with ``M <= MAX_ROWS`` and ``w [N, K]`` (imports triton).

At batch 1 a decode step reads every weight once and does almost no arithmetic, so it runs at the speed
the weights stream from memory. cuBLAS falls short of that on narrow projections: on an H200 its kernel
for Qwen3-0.6B's output projection (``[1, 2048] x [2048, 1024]``, 4 MiB of weight) takes 12.7-13.1 us,
this one 3.9 (``benchmarks/results/h200-linear*.json``); at Llama-3-8B's widths the two are level. This
kernel splits ``N`` only: each program owns ``BLOCK_N`` output columns, walks the whole of ``K`` in
``BLOCK_K`` steps and writes its columns once. No split over ``K`` means no second pass and no atomics:
the result does not depend on the launch, the same on every run and every rank.

Two forms, both summing in float32 and rounding once to the output's dtype:

* ``dot``: the rows padded to 16 and multiplied on the tensor cores (``tl.dot``), so Triton's pipeliner
  keeps ``STAGES`` weight tiles in flight per program;
* ``sum``: the rows (padded to a power of two) multiplied and summed on the CUDA cores, ``BLOCK_N x
  BLOCK_K`` weights per step.

:func:`config_for` picks the form and tile per shape class by :data:`RULES` (or cuBLAS, where the sweep
found it as fast or faster); :func:`linear` runs on GPU tensors, or on CPU tensors under
``TRITON_INTERPRET=1`` (the tests; Triton's interpreter multiplies bfloat16 tiles wrongly, so they use
float16 and float32).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from devgraph.reference.kernels.launching import launch, on_device

__all__ = [
    "CONFIGS",
    "HALF",
    "MAX_ROWS",
    "RULES",
    "LinearConfig",
    "Rule",
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

#: The tilings :func:`config_for` picks from, named by what they suit.
CONFIGS: dict[str, LinearConfig] = {
    # One or two rows of a narrow projection: two output columns a program, 1024-wide steps of K on the
    # CUDA cores.
    "one_row": LinearConfig("sum", block_n=2, block_k=1024, warps=4),
    # Three or four rows of a very narrow projection: one column a program, 512-wide steps.
    "small_rows": LinearConfig("sum", block_n=1, block_k=512, warps=4),
    # Rows padded to 16 on the tensor cores, six weight tiles in flight.
    "few_rows": LinearConfig("dot", block_n=16, block_k=128, warps=2, stages=6),
    # A deep projection (K of 4096 and more at several rows, a down projection at one): wider, deeper tiles.
    "long_k": LinearConfig("dot", block_n=32, block_k=512, warps=4, stages=3),
    # An LM head (tens of thousands of columns): wider tiles, fewer programs to schedule.
    "wide": LinearConfig("dot", block_n=32, block_k=256, warps=4, stages=4),
}


class Rule(NamedTuple):
    """Rows ``rows[0]..rows[1]``, output columns ``n[0]..n[1]`` and depth ``k[0]..k[1]`` (inclusive) take
    the tiling ``config`` (``None``: cuBLAS); ``measured`` says what the sweep found for those shapes."""

    rows: tuple[int, int]
    n: tuple[int, int]
    k: tuple[int, int]
    config: str | None
    measured: str


_ANY = (0, 1 << 62)
#: :func:`config_for`'s table, first match wins; the ratios are the Triton tiling's time over cuBLAS's,
#: medians over the runs in ``benchmarks/results/h200-linear-sweep.json`` and ``h200-linear.json`` (H200).
RULES: tuple[Rule, ...] = (
    Rule((1, 1), (30_001, 1 << 62), _ANY, "wide", "LM heads of 64k-128k columns: 0.93-0.95x"),
    Rule((1, 16), (4097, 1 << 62), _ANY, None, "Llama-3-8B's qkv and every gate/up: cuBLAS level or faster"),
    Rule((1, 16), _ANY, (7168, 1 << 62), "long_k", "down projections of 7168 and 14336: 0.89-1.0x"),
    Rule((1, 1), (3073, 4096), (2048, 1 << 62), "few_rows", "8B's o and its half: 0.89x, 0.95x"),
    Rule(
        (1, 1),
        _ANY,
        _ANY,
        "one_row",
        "Qwen3-0.6B's qkv, o, down: 0.86x, 0.28x, 0.62x; 8B's half qkv 0.77x",
    ),
    Rule((2, 2), (1, 1024), _ANY, "one_row", "Qwen3-0.6B's o and down at 2 rows: 0.33x, 0.69x"),
    Rule((3, 4), (1, 1024), _ANY, "small_rows", "Qwen3-0.6B's o and down at 4 rows: 0.71x, 0.99x"),
    Rule((5, 16), (1, 1024), _ANY, None, "Qwen3-0.6B's o and down from 8 rows: cuBLAS level"),
    Rule((2, 16), _ANY, (4096, 1 << 62), "long_k", "8B's o, its halved qkv: 0.87-0.96x"),
    Rule((2, 16), _ANY, (1, 1024), "few_rows", "Qwen3-0.6B's qkv: 0.95-0.99x"),
    # Anything else (8B's halved o, 2048 deep, at several rows: 1.0-1.03x) falls through to cuBLAS.
)


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
    """The tiling :func:`linear` uses for ``[rows, k] x [k, n]``: the first :data:`RULES` entry that holds
    the shape, or ``None`` (cuBLAS) where the entry says so, past :data:`MAX_ROWS` rows, or where no entry
    holds it."""
    if rows < 1 or rows > MAX_ROWS:
        return None
    for rule in RULES:
        if (
            rule.rows[0] <= rows <= rule.rows[1]
            and rule.n[0] <= n <= rule.n[1]
            and rule.k[0] <= k <= rule.k[1]
        ):
            return CONFIGS[rule.config] if rule.config is not None else None
    return None


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
    kernel, options = _launch(c, rows, x.dtype, bias is not None)
    b = bias if bias is not None else weight
    strides = (x.stride(0), weight.stride(0), out.stride(0))
    launch(kernel, (triton.cdiv(n, c.block_n),), x, weight, b, out, rows, n, k, *strides, **options)
    return out


def _launch(c: LinearConfig, rows: int, dtype: torch.dtype, has_bias: bool) -> tuple[Any, dict[str, Any]]:
    """The kernel of ``c``'s form and its compile-time arguments for ``rows`` rows of ``dtype``: what
    :func:`linear` launches and :func:`build_linear` builds ahead (the two must agree, or the build is
    a different kernel than the launch). Both kernels take the same positional arguments."""
    if c.form == "sum":
        return _linear_sum_kernel, {
            "HAS_BIAS": has_bias,
            "ROWS": triton.next_power_of_2(rows),
            "BLOCK_N": c.block_n,
            "BLOCK_K": c.block_k,
            "num_warps": c.warps,
        }
    return _linear_dot_kernel, {
        "HAS_BIAS": has_bias,
        "BLOCK_N": c.block_n,
        "BLOCK_K": c.block_k,
        "STAGES": c.stages,
        "PRECISION": _precision(dtype),
        "num_warps": c.warps,
        "num_stages": c.stages,
    }


def _precision(dtype: torch.dtype) -> str:
    """float32 multiplied as float32 (``F.linear``'s default, no TF32); half types as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _suits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Operands the kernels read as they assume: 2-D, last dimension contiguous, one dtype, one device,
    and that device a GPU (or the CPU under Triton's interpreter)."""
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or x.stride(1) != 1 or weight.stride(1) != 1:
        return False
    if weight.dtype != x.dtype or weight.device != x.device:
        return False
    if not on_device(x) and not _interpreting():
        return False
    return bias is None or (
        bias.shape == (weight.shape[0],)
        and bias.stride(0) == 1
        and bias.dtype == x.dtype
        and bias.device == x.device
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def build_linear(dtype: torch.dtype, has_bias: bool = False) -> None:
    """Build (or load from Triton's cache) the kernels :func:`linear` launches for one row of ``dtype`` (a
    decode step of one request, what a server runs first and most) without launching them (no device
    memory), as ``triton_fused.build_silu_mul`` does for its kernel: a start-up's batch-1 capture then
    compiles none. ``has_bias``: the narrow one-row form with a bias too (a q/k/v projection with one).
    Steps of more rows build their variants at their first warm-up. Nothing for a dtype :func:`linear`
    keeps on cuBLAS."""
    if dtype not in HALF:
        return
    one_row = {CONFIGS[rule.config] for rule in RULES if rule.config is not None and rule.rows[0] == 1}
    for c, bias in [(c, False) for c in one_row] + ([(CONFIGS["one_row"], True)] if has_bias else []):
        kernel, options = _launch(c, 1, dtype, bias)
        # Pointers as their dtype, then rows (1), n, k and the strides at a typical size.
        kernel.warmup(dtype, dtype, dtype, dtype, 1, 4096, 4096, 4096, 4096, 4096, grid=(1,), **options)
