"""CPU simulated device graphs: a real capture/replay on the CPU, so graph strategies run in CPU-only CI."""

from __future__ import annotations

from devgraph.platforms.sim.graph import SimGraph, SimPool
from devgraph.platforms.sim.platform import CpuSimPlatform

__all__ = ["SimGraph", "SimPool", "CpuSimPlatform"]
