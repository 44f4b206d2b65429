"""The CUDA backends: the device-neutral strategies, with CUDA-specific availability checks."""

from __future__ import annotations

from devgraph.platform import Availability, GraphPlatform
from devgraph.strategies import BreakableBackend, FullGraphBackend, TcPiecewiseBackend

__all__ = ["CudaFullGraphBackend", "CudaBreakableBackend", "CudaTcPiecewiseBackend"]


class CudaFullGraphBackend(FullGraphBackend):
    """One CUDA graph per batch size."""


class CudaBreakableBackend(BreakableBackend):
    """CUDA graph segments cut at break ops."""


class CudaTcPiecewiseBackend(TcPiecewiseBackend):
    """torch.compile pieces, each captured as a CUDA graph per size."""

    @classmethod
    def availability(cls, platform: GraphPlatform) -> Availability:
        base = platform.availability()
        if not base:
            return base
        try:
            import torch._dynamo  # noqa: F401
        except Exception as exc:  # e.g. a Python version this torch's dynamo does not support
            return Availability(False, f"torch.compile is unavailable here ({exc}); use 'breakable'")
        return Availability(True)
