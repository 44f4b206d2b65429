"""The backend ABC every graph strategy implements.

The runner drives a backend in this order::

    backend.prepare(runner)
    forward = backend.wrap_forward(runner.forward)
    with backend.capture_session(stream):
        for size in sizes (largest first):
            outputs = backend.capture_one(size, forward_fn)
    ...
    with backend.runtime_session():          # once per step
        if backend.can_run(batch) and backend.has_shape(size):
            outputs = backend.replay(size, static_inputs)
    backend.cleanup()
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from devgraph.platform import Availability, GraphPlatform

if TYPE_CHECKING:
    from devgraph.runner import GraphRunner

__all__ = ["Batch", "BackendOptions", "DeviceGraphBackend"]


@dataclass(frozen=True)
class Batch:
    """One step as the runner sees it: ``n`` real rows, padded to ``size``, with the live ``context``."""

    n: int
    size: int
    context: Any = None


@dataclass(frozen=True)
class BackendOptions:
    """Per-phase options a backend may use (from ``--device-graph-mode``)."""

    compiler: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


class DeviceGraphBackend(ABC):
    """A strategy for turning a forward pass into replayable device graphs.

    One instance serves one runner (one phase). ``name`` is the mode name users type
    (``full``, ``breakable``, ``tc_piecewise``, ``eager``), ``platform`` the device graph API it runs on.
    """

    name: ClassVar[str] = "abstract"
    #: False for backends that never capture (``eager``): the runner then skips padding and copies.
    uses_graphs: ClassVar[bool] = True

    def __init__(self, platform: GraphPlatform, *, phase: str, options: BackendOptions | None = None) -> None:
        self.platform = platform
        self.phase = phase
        self.options = options or BackendOptions()

    @classmethod
    def availability(cls, platform: GraphPlatform) -> Availability:
        """Whether this backend can run on ``platform`` here; ``reason`` says what is missing."""
        return platform.availability()

    def prepare(self, runner: GraphRunner) -> None:  # noqa: B027 - optional hook
        """Called once before capture with the runner (forward, static inputs, sizes, device).

        Backends that transform the forward (``tc_piecewise`` compiles it) do it here.
        """

    def wrap_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """The callable the runner warms up, captures and falls back to; ``tc_piecewise`` compiles it."""
        return forward

    def can_run(self, batch: Batch) -> bool:
        """Whether this step may replay a graph. False sends the step to eager; must be cheap."""
        return True

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        """Context around capturing all sizes on ``stream`` (shared pool, capture-wide guards)."""
        yield

    @abstractmethod
    def capture_one(self, key: int, forward_fn: Callable[[], Any]) -> Any:
        """Capture ``forward_fn()`` (already bound to the static inputs sliced to ``key``).

        Returns the outputs captured for ``key``; their storage stays fixed across replays. On failure
        raises :class:`~devgraph.errors.CaptureError` and leaves nothing of ``key`` behind.
        """

    @abstractmethod
    def has_shape(self, key: int) -> bool:
        """Whether a graph for ``key`` was captured and can be replayed."""

    @abstractmethod
    def replay(self, key: int, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        """Replay the graph for ``key`` and return its outputs (the same tensors every time).

        ``static_inputs`` are the runner's buffers, already filled for this step; device backends
        ignore them, backends with host-side arguments (Ascend) read them.
        """

    @contextlib.contextmanager
    def runtime_session(self) -> Iterator[None]:
        """Context around each replay (per-step flags, e.g. telling break ops they replay)."""
        yield

    @abstractmethod
    def cleanup(self) -> None:
        """Release every graph and the memory pool; the backend may be captured again afterwards."""

    def captured_keys(self) -> list[int]:
        """The keys captured so far, for reports."""
        return []
