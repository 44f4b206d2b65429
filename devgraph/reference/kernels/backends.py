"""Choosing an attention backend: ``attention_backend("triton" | "torch" | "auto")``.

``torch`` is the reference (``torch_ref``), always there. ``triton`` imports triton (and the kernels)
on first request and says ``pip install 'devgraph[triton]'`` when it is missing. ``auto`` decides per
call: the Triton kernels for tensors on a GPU when triton imports, the reference otherwise. The decision reads
only the device of the tensors, a static property, so it is safe inside a captured graph.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, fields
from typing import Any

import torch

from devgraph import BackendUnavailableError, ConfigError
from devgraph.extras import install_hint, missing_extra
from devgraph.messages import shorten
from devgraph.reference.kernels import torch_ref
from devgraph.reference.kernels.interface import PagedAttention, VarlenAttention, WriteKV

__all__ = [
    "BACKEND_NAMES",
    "KERNEL_FUNCTIONS",
    "AttentionKernels",
    "attention_backend",
    "available_backends",
    "auto_fallback_note",
]

#: Names ``attention_backend`` accepts.
BACKEND_NAMES: tuple[str, ...] = ("auto", "triton", "torch")


@dataclass(frozen=True)
class AttentionKernels:
    """The four functions of the attention contract, from one backend (see the package docstring)."""

    name: str
    write_kv: WriteKV
    paged_decode_attention: PagedAttention
    paged_prefill_attention: PagedAttention
    varlen_attention: VarlenAttention

    @classmethod
    def of_module(cls, name: str, module: Any) -> AttentionKernels:
        """The backend whose functions are ``module``'s of the same names."""
        return cls(name, **{function: getattr(module, function) for function in KERNEL_FUNCTIONS})


#: The functions every backend offers (:mod:`devgraph.reference.kernels.interface` has their signatures).
KERNEL_FUNCTIONS: tuple[str, ...] = tuple(f.name for f in fields(AttentionKernels) if f.name != "name")

_TORCH = AttentionKernels.of_module("torch", torch_ref)


@functools.lru_cache(maxsize=1)
def _load_triton() -> AttentionKernels | ImportError:
    """The Triton backend, or why it does not import (cached: one import attempt per process)."""
    try:
        ops = importlib.import_module("devgraph.reference.kernels.triton_ops")
    except ImportError as error:  # triton missing, or an install that does not import
        return error
    return AttentionKernels.of_module("triton", ops)


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


def _per_call(function: str) -> Any:
    """``auto``'s ``function``: the one of the backend :func:`_pick` chooses by its first tensor argument
    (the kernels' checks hold every tensor of a call to one device)."""

    def call(first: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return getattr(_pick(first), function)(first, *args, **kwargs)

    call.__name__ = call.__qualname__ = function
    return call


_AUTO = AttentionKernels("auto", **{function: _per_call(function) for function in KERNEL_FUNCTIONS})


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
