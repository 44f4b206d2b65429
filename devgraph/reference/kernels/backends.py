"""Choosing an attention backend: ``attention_backend("triton" | "torch" | "auto")``.

``torch`` is the reference (``torch_ref``), always there. ``triton`` imports triton (and the kernels)
on first request and says ``pip install 'devgraph[triton]'`` when it is missing. ``auto`` decides per
call: the Triton kernels for tensors on a GPU when triton imports, the reference otherwise. The decision reads
only the device of the tensors, a static property, so it is safe inside a captured graph.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

from devgraph import BackendUnavailableError, ConfigError
from devgraph.extras import install_hint, missing_extra
from devgraph.messages import shorten
from devgraph.reference.kernels import torch_ref

__all__ = [
    "BACKEND_NAMES",
    "AttentionKernels",
    "DecodeAttention",
    "PrefillAttention",
    "VarlenAttention",
    "WriteKV",
    "attention_backend",
    "available_backends",
    "auto_fallback_note",
]

#: Names ``attention_backend`` accepts.
BACKEND_NAMES: tuple[str, ...] = ("auto", "triton", "torch")


class WriteKV(Protocol):
    def __call__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...


class DecodeAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...


class PrefillAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...


class VarlenAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float,
        causal: bool = False,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionKernels:
    """The four functions of the attention contract, from one backend (see the package docstring)."""

    name: str
    write_kv: WriteKV
    paged_decode_attention: DecodeAttention
    paged_prefill_attention: PrefillAttention
    varlen_attention: VarlenAttention


_TORCH = AttentionKernels(
    name="torch",
    write_kv=torch_ref.write_kv,
    paged_decode_attention=torch_ref.paged_decode_attention,
    paged_prefill_attention=torch_ref.paged_prefill_attention,
    varlen_attention=torch_ref.varlen_attention,
)


@functools.lru_cache(maxsize=1)
def _load_triton() -> AttentionKernels | ImportError:
    """The Triton backend, or why it does not import (cached: one import attempt per process)."""
    try:
        ops = importlib.import_module("devgraph.reference.kernels.triton_ops")
    except ImportError as error:  # triton missing, or an install that does not import
        return error
    return AttentionKernels(
        name="triton",
        write_kv=ops.write_kv,
        paged_decode_attention=ops.paged_decode_attention,
        paged_prefill_attention=ops.paged_prefill_attention,
        varlen_attention=ops.varlen_attention,
    )


def available_backends() -> tuple[str, ...]:
    """Concrete backends usable in this process: ``"torch"``, plus ``"triton"`` when triton imports.

    (Whether a GPU is present is a separate matter: the Triton kernels need GPU tensors.)
    """
    return ("torch", "triton") if isinstance(_load_triton(), AttentionKernels) else ("torch",)


def auto_fallback_note(kernels: str, device: torch.device) -> str | None:
    """Why ``auto`` kernels on a GPU ``device`` run the slow torch reference (triton does not import),
    with the install hint; ``None`` when they run Triton or ``device`` is not a GPU (the demo prints it,
    the server logs it: timings taken without Triton are not the kernels' speed)."""
    loaded = _load_triton()
    if kernels != "auto" or device.type != "cuda" or not isinstance(loaded, ImportError):
        return None
    message = missing_extra("triton", "triton", "the reference model's GPU attention kernels", loaded)
    return f"{message}; running the torch reference attention instead (correct, much slower)"


def _triton_kernels() -> AttentionKernels:
    loaded = _load_triton()
    if isinstance(loaded, ImportError):
        raise BackendUnavailableError(
            f"the triton attention backend needs the triton package, which does not import here "
            f"({shorten(str(loaded), 120)}): {install_hint('triton')} (CUDA builds of torch ship a matching "
            f"one), or use attention_backend('torch')"
        ) from loaded
    return loaded


def _pick(tensor: torch.Tensor) -> AttentionKernels:
    """``auto``'s choice for one call: Triton for GPU tensors when it imports, else the reference."""
    loaded = _load_triton()
    if tensor.device.type == "cuda" and isinstance(loaded, AttentionKernels):
        return loaded
    return _TORCH


def _auto_write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _pick(k_cache).write_kv(k, v, k_cache, v_cache, slot_mapping)


def _auto_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return _pick(q).paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def _auto_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    kernels = _pick(q)
    return kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)


def _auto_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    causal: bool = False,
) -> torch.Tensor:
    return _pick(q).varlen_attention(q, k, v, cu_seqlens, scale, causal)


_AUTO = AttentionKernels(
    name="auto",
    write_kv=_auto_write_kv,
    paged_decode_attention=_auto_decode,
    paged_prefill_attention=_auto_prefill,
    varlen_attention=_auto_varlen,
)


def attention_backend(name: str) -> AttentionKernels:
    """The attention functions of backend ``name``: ``"triton"``, ``"torch"`` or ``"auto"``.

    Raises :class:`~devgraph.errors.BackendUnavailableError` for ``"triton"`` when triton does not
    import, and :class:`~devgraph.errors.ConfigError` for an unknown name.
    """
    if name == "torch":
        return _TORCH
    if name == "triton":
        return _triton_kernels()
    if name == "auto":
        return _AUTO
    raise ConfigError(
        f"unknown attention backend {shorten(name)}; expected one of {', '.join(BACKEND_NAMES)}"
    )
