"""Entry point ``cuda`` in group ``devgraph``: the CUDA platform and its three graph strategies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph import hookimpl


@hookimpl
def devgraph_register_platforms(register: Callable[[type[Any]], None]) -> None:
    from devgraph_cuda.platform import CudaPlatform

    register(CudaPlatform)


@hookimpl
def devgraph_register_backends(register: Callable[..., None]) -> None:
    from devgraph_cuda.backends import CudaBreakableBackend, CudaFullGraphBackend, CudaTcPiecewiseBackend

    register(CudaFullGraphBackend, name="full", platform="cuda", default_for=("decode",))
    register(CudaBreakableBackend, name="breakable", platform="cuda", default_for=("prefill", "encode"))
    register(CudaTcPiecewiseBackend, name="tc_piecewise", platform="cuda")
