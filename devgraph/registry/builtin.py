"""The built-in plug-in: the CPU simulated platform and every strategy on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph.registry.hookspecs import hookimpl


@hookimpl
def devgraph_register_platforms(register: Callable[[type[Any]], None]) -> None:
    from devgraph.platforms.sim.platform import CpuSimPlatform

    register(CpuSimPlatform)


@hookimpl
def devgraph_register_backends(register: Callable[..., None]) -> None:
    from devgraph.strategies import BreakableBackend, FullGraphBackend, TcPiecewiseBackend

    # No default_for: ``auto`` takes each phase's default mode (devgraph.contract.phases.PHASE_SPECS).
    register(FullGraphBackend, name="full", platform="cpu")
    register(BreakableBackend, name="breakable", platform="cpu")
    register(TcPiecewiseBackend, name="tc_piecewise", platform="cpu")
