"""Triton kernels for the reference decoder's elementwise work: one launch where the torch version takes
six to fifteen (imports triton).

Each kernel rounds where the torch version's separate operations round, so its output equals them bit for
bit except where a reduction's order differs (the sum of squares of an RMSNorm) or a math function's last
bit does (``exp`` in SiLU):

* ``rms_norm(x, weight, eps, residual=None)``: ``y = x * rsqrt(mean(x^2) + eps)`` in float32, rounded to
  the input's dtype, times ``weight`` (rounded again), transformers' order. With ``residual``, ``x`` is
  first ``x + residual`` (rounded, as ``torch.add``) and that sum is returned too.
* ``qk_norm_rope(qk, weight, cos, sin, eps)``: per row of ``qk [T, H, D]`` (queries and keys of a step),
  an optional RMSNorm with that head's scale row, then rotate-half RoPE with ``cos``/``sin [T, D/2]``.
* ``silu_mul(gate_up)``: ``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate first).

The kernels run on GPU tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from devgraph.reference.kernels.launching import launch

__all__ = ["qk_norm_rope", "rms_norm", "silu_mul"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x [N, H]`` (last dim contiguous) normed; with ``residual``, also the rounded ``x + residual``."""
    rows, cols = x.shape
    out = torch.empty((rows, cols), device=x.device, dtype=x.dtype)
    total = torch.empty_like(out) if residual is not None else None
    if rows:
        launch(
            _rms_norm_kernel,
            (rows,),
            x,
            residual if residual is not None else x,
            weight,
            out,
            total if total is not None else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            out.stride(0),
            cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(cols),
        )
    return out, total


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    stride_ot,
    stride_oh,
    num_heads,
    half,
    eps,
    HAS_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    token = pid // num_heads
    head = pid % num_heads
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    base = x_ptr + token * stride_xt + head * stride_xh
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if HAS_NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * half) + eps)
        w1 = tl.load(w_ptr + head * 2 * half + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + head * 2 * half + half + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + token * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_st + offs, mask=mask, other=0.0).to(tl.float32)
    first = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    second = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    dst = out_ptr + token * stride_ot + head * stride_oh
    tl.store(dst + offs, first.to(dtype), mask=mask)
    tl.store(dst + half + offs, second.to(dtype), mask=mask)


def qk_norm_rope(
    qk: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """``qk [T, H, D]`` (last dim contiguous), per-head ``weight [H, D]`` or ``None``, ``cos``/``sin
    [T, D/2]`` in ``qk``'s dtype -> a new contiguous ``[T, H, D]``."""
    tokens, heads, dim = qk.shape
    out = torch.empty((tokens, heads, dim), device=qk.device, dtype=qk.dtype)
    if tokens:
        half = dim // 2
        launch(
            _qk_norm_rope_kernel,
            (tokens * heads,),
            qk,
            weight if weight is not None else qk,
            cos,
            sin,
            out,
            qk.stride(0),
            qk.stride(1),
            cos.stride(0),
            sin.stride(0),
            out.stride(0),
            out.stride(1),
            heads,
            half,
            eps,
            HAS_NORM=weight is not None,
            BLOCK=triton.next_power_of_2(half),
        )
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [T, 2I]`` (last dim contiguous) -> ``silu(gate) * up [T, I]``."""
    tokens, double = gate_up.shape
    width = double // 2
    out = torch.empty((tokens, width), device=gate_up.device, dtype=gate_up.dtype)
    if tokens:
        block = min(1024, triton.next_power_of_2(width))
        launch(
            _silu_mul_kernel,
            (tokens, triton.cdiv(width, block)),
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            width,
            BLOCK=block,
        )
    return out


def build_silu_mul(width: int, dtype: torch.dtype) -> None:
    """Build (or load from Triton's cache) the SiLU-and-multiply kernel for ``[T, 2 * width]`` rows of
    ``dtype`` without launching it: no device memory, no launch, so it may run on any thread, even while
    another captures a graph. The first build in a process also does Triton's one-time set-up (its
    driver, the compiler backend, the cache), a few hundred milliseconds a start would otherwise spend on
    its first kernel."""
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel.warmup(dtype, dtype, 2 * width, width, width, grid=(1,), BLOCK=block)
