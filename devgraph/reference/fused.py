"""The decoder's elementwise steps, one function each, in two forms.

* torch (``fused=False``): the operations transformers runs, in its order (the CPU always, and a GPU
  without Triton): an RMSNorm is six kernels, the per-head q/k norm and RoPE fifteen, SiLU-and-multiply two.
* Triton (``fused=True``): one kernel each (``devgraph.reference.kernels.triton_fused``), as torch custom
  ops: opaque to dynamo and inductor (the compiling strategies keep each as one call, as they keep the
  attention kernels) and captured whole by device graphs. They round where the torch form rounds, so they
  differ from it only in a reduction's order and a math function's last bit.
  The projections take the same road: one op (:func:`linear`) that runs a Triton matrix-vector kernel
  (``devgraph.reference.kernels.triton_linear``) for a decode step's few rows where the sweep found it
  faster than cuBLAS, and cuBLAS otherwise.

On a GPU a decode step of the reference decoder launches about 40 kernels per layer in the torch form and
about 12 in the fused one; in a replayed graph, where launches are cheap but every kernel still costs
microseconds, that is most of the step.

``fused_kernels(kernels, device)``: whether a model built for ``device`` with ``config.kernels`` uses the
Triton form (``torch``: no; ``auto``: on a CUDA device when triton imports; ``triton``: on a CUDA device,
or on the CPU under Triton's interpreter, ``TRITON_INTERPRET=1``).
"""

# No ``from __future__ import annotations`` here: torch derives the operator schemas from the annotations.

import functools
import importlib
import logging
import os
import threading
import time
from typing import Optional

import torch
import torch.nn.functional as F

from devgraph.reference.kernel_builds import DecodeShapes, build_decode_kernels
from devgraph.reference.rope import apply_rope

__all__ = [
    "TRITON_SET_UP",
    "add_rms_norm",
    "fused_kernels",
    "greedy_tokens",
    "linear",
    "qk_norm_rope",
    "rms_norm",
    "set_up_triton",
    "silu_mul",
]

logger = logging.getLogger(__name__)

#: What the background set-up did (:func:`set_up_triton`): ``seconds`` once done, ``error`` if it failed.
TRITON_SET_UP: dict[str, object] = {}


@functools.lru_cache(maxsize=1)
def _triton() -> bool:
    try:
        importlib.import_module("devgraph.reference.kernels.triton_fused")
    except ImportError:
        return False
    return True


def fused_kernels(kernels: str, device: torch.device) -> bool:
    """Whether the Triton form runs for ``config.kernels`` on ``device`` (see the module docstring)."""
    if kernels == "triton":
        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return kernels == "auto" and device.type == "cuda" and _triton()


def set_up_triton(
    kernels: str,
    device: torch.device,
    width: int,
    dtype: torch.dtype,
    *,
    bias: bool = False,
    decode: DecodeShapes | None = None,
) -> threading.Thread | None:
    """Start Triton's one-time set-up on a daemon thread, once per process, where a model built with
    ``config.kernels`` for ``device`` runs the Triton kernels on a GPU (``None`` otherwise, and when it ran
    already). A model calls it first thing, so the set-up (and the build of kernels the model uses: its
    SiLU-and-multiply over ``width`` columns of ``dtype``, then with ``decode`` every kernel of its decode
    step, :func:`~devgraph.reference.kernel_builds.build_decode_kernels`; without, the projections' one-row
    tilings at a typical size, with a bias too where ``bias``) runs while the weights are drawn or loaded
    instead of inside the first capture. It launches nothing and allocates no device memory
    (:func:`~devgraph.reference.kernels.triton_fused.build_silu_mul`); a failure is logged and leaves the
    first launch to do the set-up as before. :data:`TRITON_SET_UP` says what it did."""
    if TRITON_SET_UP or device.type != "cuda" or not fused_kernels(kernels, device):
        return None
    TRITON_SET_UP["started"] = True
    index = device.index  # the current device is per thread, and Triton keeps a kernel per device
    if index is None:
        try:
            index = torch.cuda.current_device()  # the caller's, for a bare "cuda"
        except Exception:  # no usable CUDA here: the build fails below and is recorded
            index = None

    def work() -> None:
        start = time.perf_counter()
        try:
            if index is not None:
                torch.cuda.set_device(index)
            _ops().build_silu_mul(width, dtype)
            if decode is None:  # with the shapes, the decode build makes the model's own one-row tilings
                _linear_ops().build_linear(dtype, has_bias=bias)
            TRITON_SET_UP["set_up_seconds"] = round(time.perf_counter() - start, 3)
            if decode is not None:
                build_decode_kernels(decode, device)
                TRITON_SET_UP["decode_kernels"] = True
        except Exception as exc:  # an optimisation: the first launch does the same work
            TRITON_SET_UP["error"] = repr(exc)
            logger.debug("Triton's set-up in the background failed: %r", exc)
        TRITON_SET_UP["seconds"] = round(time.perf_counter() - start, 3)

    thread = threading.Thread(target=work, name="devgraph-triton-set-up", daemon=True)
    thread.start()
    return thread


def _ops():  # type: ignore[no-untyped-def]
    return importlib.import_module("devgraph.reference.kernels.triton_fused")


def _linear_ops():  # type: ignore[no-untyped-def]
    return importlib.import_module("devgraph.reference.kernels.triton_linear")


# -- torch forms ---------------------------------------------------------------------------------------
def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# -- custom ops over the Triton kernels ------------------------------------------------------------------
@torch.library.custom_op("devgraph_ref::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _ops().rms_norm(x, weight, eps)[0]


@_rms_norm_op.register_fake
def _(x, weight, eps):  # type: ignore[no-untyped-def]
    return torch.empty_like(x)


@torch.library.custom_op("devgraph_ref::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, total = _ops().rms_norm(x, weight, eps, residual)
    return normed, total


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):  # type: ignore[no-untyped-def]
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("devgraph_ref::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(
    qk: torch.Tensor,
    weight: Optional[torch.Tensor],  # noqa: UP045 - torch derives the op schema from it
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    return _ops().qk_norm_rope(qk, weight, cos, sin, eps)


@_qk_norm_rope_op.register_fake
def _(qk, weight, cos, sin, eps):  # type: ignore[no-untyped-def]
    return torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)


@torch.library.custom_op("devgraph_ref::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045 - torch derives the op schema from it
) -> torch.Tensor:
    return _linear_ops().linear(x, weight, bias)


@_linear_op.register_fake
def _(x, weight, bias):  # type: ignore[no-untyped-def]
    return x.new_empty((*x.shape[:-1], *weight.shape[:-1]))  # F.linear's: a 1-D weight drops the last dim


@torch.library.custom_op("devgraph_ref::argmax_rows", mutates_args=())
def _argmax_op(logits: torch.Tensor) -> torch.Tensor:
    return importlib.import_module("devgraph.reference.kernels.triton_argmax").argmax_rows(logits)  # type: ignore[no-any-return]


@_argmax_op.register_fake
def _(logits):  # type: ignore[no-untyped-def]
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


@torch.library.custom_op("devgraph_ref::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _ops().silu_mul(gate_up)


@_silu_mul_op.register_fake
def _(gate_up):  # type: ignore[no-untyped-def]
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


# -- the steps -----------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool) -> torch.Tensor:
    """RMSNorm of ``x [N, H]`` over its last dimension, scaled by ``weight [H]``."""
    return _rms_norm_op(x, weight, eps) if fused else _torch_rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the residual stream and its norm in one step."""
    if fused:
        return _add_rms_norm_op(x, residual, weight, eps)
    total = residual + x
    return _torch_rms_norm(total, weight, eps), total


def qk_norm_rope(
    qk: torch.Tensor,
    weight: Optional[torch.Tensor],  # noqa: UP045 - kept alike the op's signature
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    fused: bool,
) -> torch.Tensor:
    """Queries and keys ``qk [T, H, D]``: each head RMS-normed with its row of ``weight [H, D]`` (when
    given), then rotated with ``cos``/``sin [T, D/2]`` (in ``qk``'s dtype)."""
    if fused:
        return _qk_norm_rope_op(qk, weight, cos, sin, eps)
    if weight is not None:
        qk = _torch_rms_norm(qk, weight, eps)
    return apply_rope(qk, cos[:, None], sin[:, None])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045 - kept alike the op's signature
    fused: bool,
) -> torch.Tensor:
    """``x [T, K] @ weight [N, K].T (+ bias)``. Fused: one op that runs the Triton matrix-vector kernel
    for the few rows of a decode step where it is faster than cuBLAS and ``F.linear`` otherwise, decided
    inside the op from the shapes at hand, so a compiled forward neither guards nor recompiles on them.
    Eagerly (no compile tracing), a step the kernel never takes (more rows than it holds, or not 2-D)
    skips the op: its dispatch costs several times ``F.linear``'s host time, a hundred times a step."""
    if not fused:
        return F.linear(x, weight, bias)
    if not torch.compiler.is_compiling() and (x.dim() != 2 or x.shape[0] > _linear_ops().MAX_ROWS):
        return F.linear(x, weight, bias)
    return _linear_op(x, weight, bias)


def greedy_tokens(logits: torch.Tensor, fused: bool) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``logits [R, V]`` (int64 ``[R]``). Fused: one op over the two Triton
    kernels of :mod:`~devgraph.reference.kernels.triton_argmax` (the same tokens, bit for bit; opaque, so a
    compiled forward keeps it whole), where they take the logits; else ``torch.argmax``."""
    if (
        fused
        and logits.dim() == 2
        and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)  # what the kernels compare exactly
        and logits.stride(-1) == 1
        and logits.shape[-1] > 0
        and (logits.device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
    ):
        return _argmax_op(logits)  # type: ignore[no-any-return]
    return logits.argmax(dim=-1)


def silu_mul(gate_up: torch.Tensor, fused: bool) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2I]`` (the fused gate/up projection's output)."""
    if fused:
        return _silu_mul_op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
