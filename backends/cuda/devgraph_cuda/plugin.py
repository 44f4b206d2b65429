"""Entry point ``cuda`` in group ``devgraph``: the CUDA platform and its three graph strategies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph import hookimpl

__all__ = ["devgraph_register_platforms", "devgraph_register_backends"]


@hookimpl
def devgraph_register_platforms(register: Callable[[type[Any]], None]) -> None:
    from devgraph_cuda.platform import CudaPlatform

    register(CudaPlatform)


@hookimpl
def devgraph_register_backends(register: Callable[..., None]) -> None:
    from devgraph_cuda.backends import CudaBreakableBackend, CudaFullGraphBackend, CudaTcPiecewiseBackend

    # No default_for: ``auto`` takes each phase's default mode (devgraph.contract.phases.PHASE_SPECS, where
    # the measurements behind them are cited).
    register(CudaFullGraphBackend, name="full", platform="cuda")
    register(CudaBreakableBackend, name="breakable", platform="cuda")
    register(CudaTcPiecewiseBackend, name="tc_piecewise", platform="cuda")
