"""Entry point ``cuda`` in group ``devgraph``: the CUDA platform and its three graph strategies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph import hookimpl

__all__ = ["DEFAULTS", "devgraph_register_platforms", "devgraph_register_backends"]

#: What ``--device-graph-mode auto`` picks per phase on NVIDIA GPUs (measurements: docs/performance.md).
#: decode: ``full`` replays the whole step with one launch, as fast as a hand-written CUDA graph
#: (0.99-1.01x on an H100) and bit-identical to eager; decode attention reads only device tensors.
#: prefill/encode: real attention needs host-side metadata (variable lengths), so the default cuts the
#: graph at break ops; ``breakable`` replays as fast as ``tc_piecewise`` with the eager compiler, captures
#: 10x faster (no torch.compile) and puts no dynamo constraints on the model code.
DEFAULTS: dict[str, str] = {"decode": "full", "prefill": "breakable", "encode": "breakable"}


def _defaults_for(mode: str) -> tuple[str, ...]:
    return tuple(phase for phase, chosen in DEFAULTS.items() if chosen == mode)


@hookimpl
def devgraph_register_platforms(register: Callable[[type[Any]], None]) -> None:
    from devgraph_cuda.platform import CudaPlatform

    register(CudaPlatform)


@hookimpl
def devgraph_register_backends(register: Callable[..., None]) -> None:
    from devgraph_cuda.backends import CudaBreakableBackend, CudaFullGraphBackend, CudaTcPiecewiseBackend

    register(CudaFullGraphBackend, name="full", platform="cuda", default_for=_defaults_for("full"))
    register(CudaBreakableBackend, name="breakable", platform="cuda", default_for=_defaults_for("breakable"))
    register(
        CudaTcPiecewiseBackend,
        name="tc_piecewise",
        platform="cuda",
        default_for=_defaults_for("tc_piecewise"),
    )
