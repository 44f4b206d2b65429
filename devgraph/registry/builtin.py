"""The built-in plug-in: the CPU simulated platform, the vendor-neutral ``torch.accelerator`` platform, and
every strategy on each (neither needs a package beyond torch; docs/plugins.md says why they live here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph.registry.hookspecs import hookimpl

#: What ``auto`` picks per phase on both built-in platforms: one graph for decode; prefill and encode cut
#: at break ops, which needs no compiler (the CUDA plug-in's defaults, for the same reasons).
DEFAULTS: dict[str, str] = {"decode": "full", "prefill": "breakable", "encode": "breakable"}


def _defaults_for(mode: str) -> tuple[str, ...]:
    return tuple(phase for phase, chosen in DEFAULTS.items() if chosen == mode)


@hookimpl
def devgraph_register_platforms(register: Callable[[type[Any]], None]) -> None:
    from devgraph.platforms.accelerator import AcceleratorGraphPlatform
    from devgraph.platforms.sim.platform import CpuSimPlatform

    register(CpuSimPlatform)
    register(AcceleratorGraphPlatform)


@hookimpl
def devgraph_register_backends(register: Callable[..., None]) -> None:
    from devgraph.strategies import BreakableBackend, FullGraphBackend, TcPiecewiseBackend

    # No default_for: ``auto`` takes each phase's default mode (devgraph.contract.phases.PHASE_SPECS).
    for platform in ("cpu", "accelerator"):
        register(FullGraphBackend, name="full", platform=platform)
        register(BreakableBackend, name="breakable", platform=platform)
        register(TcPiecewiseBackend, name="tc_piecewise", platform=platform)
