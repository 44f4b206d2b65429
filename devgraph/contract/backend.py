"""The backend ABC every graph strategy implements.

A backend only captures and replays; deciding, per step, whether a graph replays and which one is the
runner's dispatcher's job (:mod:`devgraph.runner.dispatch`). The runner drives a backend in this order::

    backend.bind(runner)                       # one owner; a second live owner is an error
    backend.prepare(input_specs, keys)
    forward = backend.wrap_forward(runner.forward)
    with backend.capture_session(stream):
        for key in keys (largest first):
            outputs = backend.capture_one(key, forward_fn)
    ...
    with backend.runtime_session():            # once per replayed step
        outputs = backend.replay(key, static_inputs)
    backend.release(key)                       # optional: a lazily captured key evicted
    backend.cleanup()
    backend.unbind(runner)
"""

from __future__ import annotations

import contextlib
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from devgraph.contract.inputs import StaticInput
from devgraph.contract.keys import Batch, GraphKey
from devgraph.contract.platform import Availability, GraphPlatform
from devgraph.errors import ConfigError, ReplayError

__all__ = ["BackendOptions", "DeviceGraphBackend", "OnRecompile"]

OnRecompile = Literal["warn", "raise"]


@dataclass(frozen=True)
class BackendOptions:
    """Per-phase options a backend may use (from ``--device-graph-mode`` or the runner's arguments).

    * ``compiler``: ``eager`` or ``inductor`` for strategies that run ``torch.compile`` (``full``,
      ``tc_piecewise``); ``None`` means the strategy's default (``full``: no compile).
    * ``inductor_mode``: passed to inductor as its ``mode`` (``default``, ``max-autotune-no-cudagraphs``).
    * ``on_recompile``: what a recompile after capture does: log a warning or raise ``RecompileError``.
    * ``cache_dir``: where compiled artifacts are kept for warm restarts (``None``: no artifact cache).
    * ``extra``: vendor-specific options (``npu:full``'s ``host_update``).
    """

    compiler: str | None = None
    inductor_mode: str | None = None
    on_recompile: OnRecompile = "warn"
    cache_dir: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


class DeviceGraphBackend(ABC):
    """A strategy for turning a forward pass into replayable device graphs.

    One instance serves one runner (one phase) at a time. ``name`` is the mode name users type
    (``full``, ``breakable``, ``tc_piecewise``, ``eager``), ``platform`` the device graph API it runs on.
    """

    name: ClassVar[str] = "abstract"
    #: False for backends that never capture (``eager``): the runner then runs every step eagerly.
    uses_graphs: ClassVar[bool] = True
    #: Whether the strategy runs the forward through ``torch.compile`` when ``compiler`` is set. The flag
    #: and ``create_backend`` refuse ``compiler`` / ``inductor_mode`` for a backend that does not (they would
    #: be ignored); a plug-in's own compiling strategy sets it, and the flag then accepts its name with them.
    accepts_compiler: ClassVar[bool] = False
    #: Where break ops run at replay: eagerly between graph segments (``True``), captured inside the graph
    #: (``False``), or not declared (``None``: the conformance kit observes it).
    runs_breaks_eagerly: ClassVar[bool | None] = None
    #: Whether :meth:`release` can drop one key's graph (the lazily captured encoder cache needs it).
    supports_release: ClassVar[bool] = False
    #: Whether :meth:`use_pool` can capture into a pool other backends share (``GraphRunner(pool=...)``).
    supports_shared_pool: ClassVar[bool] = False

    def __init__(self, platform: GraphPlatform, *, phase: str, options: BackendOptions | None = None) -> None:
        self.platform = platform
        self.phase = phase
        self.options = options or BackendOptions()
        self._owner: weakref.ReferenceType[Any] | None = None

    @classmethod
    def availability(cls, platform: GraphPlatform) -> Availability:
        """Whether this backend can run on ``platform`` here; ``reason`` says what is missing."""
        return platform.availability()

    # -- ownership ----------------------------------------------------------------------------------
    def bind(self, owner: object) -> None:
        """Make ``owner`` (a runner) this backend's only user; raise if another live owner holds it.

        Two runners sharing a backend would share its graphs: one runner's failed capture or ``close()``
        would wipe the other's, which would then run eagerly while reporting itself captured.
        """
        current = self._owner() if self._owner is not None else None
        if current is not None and current is not owner:
            raise ConfigError(
                f"this {self.platform.name}:{self.name} backend already belongs to {current!r}; a backend "
                "serves one runner. Build another with devgraph.create_backend(...), or close() the "
                "first runner before handing its backend on"
            )
        self._owner = weakref.ref(owner)

    def unbind(self, owner: object) -> None:
        """Release ownership (the runner closed); the backend may then serve a new runner."""
        if self._owner is not None and self._owner() is owner:
            self._owner = None

    # -- set-up -------------------------------------------------------------------------------------
    def prepare(  # noqa: B027 - optional hook
        self, inputs: Mapping[str, StaticInput], keys: Sequence[GraphKey] = ()
    ) -> None:
        """Called once before the first capture with the runner's declared static inputs and the keys it
        will capture (empty for a lazily capturing runner)."""

    def wrap_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """The callable the runner warms up, captures and falls back to; compiling backends compile here."""
        return forward

    def can_run(self, batch: Batch) -> bool:
        """Whether this step may replay a graph. False sends the step to eager; must be cheap."""
        return True

    # -- capture ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture_session(self, stream: Any, *, shared_pool: bool = True) -> Iterator[None]:
        """Context around capturing keys on ``stream`` (capture-wide guards).

        ``shared_pool``: every key captured in the session shares one memory pool (start-up capture,
        largest first); ``False`` gives each key a pool of its own, released with :meth:`release`
        (a lazily captured cache returns an evicted graph's memory to the device that way).
        """
        yield

    @abstractmethod
    def capture_one(self, key: GraphKey, forward_fn: Callable[[], Any]) -> Any:
        """Capture ``forward_fn()`` (already bound to the static inputs sliced to ``key``).

        Returns the outputs captured for ``key``; their storage stays fixed across replays. On failure
        raises (the runner wraps it in :class:`~devgraph.errors.CaptureError`) and leaves nothing of
        ``key`` behind.
        """

    @abstractmethod
    def has_shape(self, key: GraphKey) -> bool:
        """Whether a graph for ``key`` was captured and can be replayed."""

    # -- replay -------------------------------------------------------------------------------------
    @abstractmethod
    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        """Replay the graph for ``key`` and return its outputs (the same tensors every time).

        ``static_inputs`` are the runner's buffers, already filled for this step; device backends
        ignore them, backends with host-side arguments (Ascend) read them.
        """

    def runtime_session(self) -> contextlib.AbstractContextManager[None]:
        """Context around each replay (per-step flags, e.g. telling break ops they replay)."""
        return contextlib.nullcontext()

    def use_pool(self, pool: Any) -> None:
        """Capture into ``pool``, a graph-pool handle other backends share (they replay one at a time)."""
        raise ConfigError(
            f"backend {self.platform.name}:{self.name} cannot capture into a shared pool; use a backend with "
            "supports_shared_pool (every built-in graph strategy has it)"
        )

    # -- teardown -----------------------------------------------------------------------------------
    def release(self, key: GraphKey) -> None:
        """Drop the graph of one key and return its memory (lazily captured caches evict with this)."""
        raise ReplayError(
            f"backend {self.platform.name}:{self.name} cannot release a single graph; "
            "use a backend with supports_release (every built-in graph strategy has it)"
        )

    @abstractmethod
    def cleanup(self) -> None:
        """Release every graph and the memory pool; the backend may be captured again afterwards."""

    # -- inspection ---------------------------------------------------------------------------------
    def captured_keys(self) -> list[GraphKey]:
        """The keys captured so far, for reports."""
        return []

    def describe_key(self, key: GraphKey) -> dict[str, Any]:
        """What was captured for ``key``: graphs, segments, break ops (plain data, for ``inspect()``)."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Backend-wide facts for ``inspect()``: compiles, recompiles, compiler."""
        return {}

    def stats(self) -> dict[str, Any]:
        """Backend facts for the runner's ``stats()`` (``full`` with a compiler: which keys replay the
        compiled graph and which the plain one); plain data, empty by default."""
        return {}

    def capture_notes(self) -> list[str]:
        """Lines the capture report adds after a capture: what the backend did differently from the plan
        and what it cost (a compile per size where one across sizes failed)."""
        return []
