"""Device-neutral graph strategies, each a :class:`~devgraph.contract.backend.DeviceGraphBackend` over a
platform."""

from devgraph.strategies.breakable import BreakableBackend
from devgraph.strategies.compiling import CompilingStrategy
from devgraph.strategies.eager import EagerBackend
from devgraph.strategies.full import FullGraphBackend
from devgraph.strategies.tc_piecewise import TcPiecewiseBackend

__all__ = ["BreakableBackend", "CompilingStrategy", "EagerBackend", "FullGraphBackend", "TcPiecewiseBackend"]
