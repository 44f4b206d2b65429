"""The CUDA backends: the device-neutral strategies, with CUDA-specific availability checks."""

from __future__ import annotations

import importlib.util
from typing import Any

from devgraph import BackendUnavailableError
from devgraph.strategies import BreakableBackend, FullGraphBackend, TcPiecewiseBackend

__all__ = ["CudaFullGraphBackend", "CudaBreakableBackend", "CudaTcPiecewiseBackend"]


class CudaFullGraphBackend(FullGraphBackend):
    """One CUDA graph per batch size: the whole forward, break ops included, replayed with one launch."""


class CudaBreakableBackend(BreakableBackend):
    """CUDA graph segments cut at break ops, which run eagerly between them (reading the live context)."""


class CudaTcPiecewiseBackend(TcPiecewiseBackend):
    """torch.compile pieces, each captured as a CUDA graph segment per size; break ops run eagerly."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Fail at construction, with the fix, rather than deep inside the first warm-up.
        if self.compiler == "inductor" and importlib.util.find_spec("triton") is None:
            raise BackendUnavailableError(
                "tc_piecewise with compiler 'inductor' needs Triton on NVIDIA GPUs (pip install triton, or "
                "the torch wheel that bundles it); use compiler 'eager' or mode 'breakable'"
            )
