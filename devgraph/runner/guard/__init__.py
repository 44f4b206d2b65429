"""The address guard: graphs replay only on the memory they were captured on (docs/user-guide.md, "Address
guard"). :func:`reach` and :func:`observe` find what a runner's forward uses; :class:`AddressGuard` watches it
and checks it before a replay."""

from devgraph.runner.guard.guard import AddressGuard, Watched
from devgraph.runner.guard.observe import observe
from devgraph.runner.guard.reach import reach

__all__ = ["AddressGuard", "Watched", "observe", "reach"]
