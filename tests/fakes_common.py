"""Shared pieces of the vendor fakes (``fakes_npu``, ``fakes_rocm``): streams, pool handles and a graph
object whose capture records through the CPU simulator (:mod:`devgraph.platforms.sim.graph`).

The fakes stand in for a vendor's Python API (``torch_npu``, ``torch.cuda`` on a ROCm build), not for
devgraph: the plug-ins under test run unchanged against them. What they model is the contract of the
real API — argument names, call order, what raises and with which message — while the work itself
runs on CPU tensors through the simulator, which really records at capture and replays on the same
tensors. Host-sync detection comes from the simulator, so a ``.item()`` during a fake capture raises
devgraph's ``CaptureError`` rather than the vendor's ``RuntimeError``; the vendor texts are tested
separately against each platform's ``translate_capture_error``.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from devgraph.platforms.sim import graph as sim
from devgraph.registry.plugins import Registry

ROOT = Path(__file__).resolve().parents[1]


def ensure_plugins_importable() -> None:
    """Make ``devgraph_npu`` / ``devgraph_rocm`` / ``devgraph_cuda`` importable from a source checkout."""
    for name in ("npu", "rocm", "cuda"):
        path = str(ROOT / "backends" / name)
        if path not in sys.path:
            try:
                __import__(f"devgraph_{name}")
            except ImportError:
                sys.path.append(path)


def plugin_registry(*plugins: Any) -> Registry:
    """A registry with the built-ins plus the given plug-in modules (hook functions called directly):
    their platforms, backends and compatibility rules."""
    registry = Registry(entry_points=False).load()
    for module in plugins:
        origin = f"{module.__name__} (tests)"
        module.devgraph_register_platforms(
            register=lambda cls, o=origin: registry.add_platform(cls, origin=o)
        )
        module.devgraph_register_backends(
            register=lambda cls, o=origin, **kw: registry.add_backend(cls, origin=o, **{"name": None, **kw})
        )
        rules = getattr(module, "devgraph_compatibility_rules", None)
        if rules is not None:  # vendor policy (ROCm's rocm-no-breakable) comes through this hook
            rules(register=lambda rule, o=origin: registry.add_rule(rule, origin=o))
    return registry


# -- what the fakes' tests capture ---------------------------------------------------------------------
class Mlp:
    """A two-layer perceptron on 8 features: two GEMMs (what a vendor's lazy BLAS handles react to)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.w1 = torch.randn(8, 16, generator=gen)
        self.w2 = torch.randn(16, 8, generator=gen)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w1) @ self.w2


# -- streams -----------------------------------------------------------------------------------------
class FakeStream:
    """A device stream handle. Work runs on the CPU at once, so there is nothing to wait for."""

    _ids = itertools.count(1)

    def __init__(self, device: Any = None, priority: int = 0, *, name: str | None = None) -> None:
        self.stream_id = 0 if name == "default" else next(self._ids)
        self.name = name or f"stream{self.stream_id}"

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: FakeStream) -> None:
        pass

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class StreamState(threading.local):
    """The current stream of each thread (the default stream until a ``stream(s)`` context sets one)."""

    def __init__(self, default: FakeStream) -> None:
        self.current = default


class Streams:
    """``Stream`` / ``current_stream`` / ``stream`` with the vendor semantics (per-thread current stream)."""

    def __init__(self) -> None:
        self.default = FakeStream(name="default")
        self._state = StreamState(self.default)

    def current_stream(self, device: Any = None) -> FakeStream:
        return self._state.current

    def default_stream(self, device: Any = None) -> FakeStream:
        return self.default

    def set_current(self, stream: FakeStream) -> None:
        """Make ``stream`` this thread's current stream until another is set (``set_stream``)."""
        if not isinstance(stream, FakeStream):
            raise TypeError(f"expected a stream of this device, got {type(stream).__name__}")
        self._state.current = stream

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        if stream is None:  # torch.cuda.stream(None) is a no-op
            yield
            return
        if not isinstance(stream, FakeStream):
            raise TypeError(f"expected a stream of this device, got {type(stream).__name__}")
        previous = self._state.current
        self._state.current = stream
        try:
            yield
        finally:
            self._state.current = previous


# -- pools -------------------------------------------------------------------------------------------
class Pools:
    """``graph_pool_handle()`` returns an opaque id tuple, as torch does; captures look the pool up."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._pools: dict[tuple[int, int], sim.SimPool] = {}

    def graph_pool_handle(self) -> tuple[int, int]:
        handle = (0, next(self._ids))
        self._pools[handle] = sim.SimPool()
        return handle

    def adopt(self, handle: tuple[int, int] | None) -> tuple[tuple[int, int], sim.SimPool]:
        """The pool of ``handle``, made on first use as the caching allocator makes it; ``None``: a new
        pool whose id the capture makes (torch sets the id's first value then, the second otherwise)."""
        if handle is None:
            handle = (next(self._ids), 0)
        return handle, self._pools.setdefault(handle, sim.SimPool())

    def lookup(self, handle: Any) -> sim.SimPool | None:
        if handle is None:
            return None
        try:
            return self._pools[handle]
        except (KeyError, TypeError):
            raise RuntimeError(
                f"unknown graph memory pool {handle!r}: pass a handle from graph_pool_handle() or "
                "another graph's pool()"
            ) from None


# -- graphs ------------------------------------------------------------------------------------------
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


class SimBackedGraph:
    """A vendor graph object (``CUDAGraph`` / ``NPUGraph``) whose capture records through the simulator."""

    kind = "CUDA"
    capture_error_modes: tuple[str, ...] = CAPTURE_ERROR_MODES

    def __init__(self, fake: Any) -> None:
        self._fake = fake
        self._sim = sim.SimGraph()
        self._state = "empty"  # empty | capturing | captured | failed
        self._pool: tuple[int, int] | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if capture_error_mode not in self.capture_error_modes:
            raise RuntimeError(
                f"Unknown capture_error_mode {capture_error_mode!r}; "
                f"expected one of {', '.join(self.capture_error_modes)}"
            )
        if self._state == "capturing":
            raise RuntimeError(f"{self.kind} graph capture_begin called twice without capture_end")
        if self._state == "captured":
            raise RuntimeError(
                f"this {self.kind} graph already holds a capture; call reset() before capturing again"
            )
        if self._fake.streams.current_stream() is self._fake.streams.default:
            raise RuntimeError(
                f"{self.kind} graphs must be captured on a non-default stream. (However, after "
                "capture, it's ok to replay them on the default stream.)"
            )
        pool, sim_pool = self._open_pool(pool)
        self._fake.before_capture(self)  # may raise the device's resource error
        try:
            sim.begin_capture(self._sim, sim_pool)
        except BaseException:
            self._fake.released(self)
            raise
        self._fake.capturing.add(threading.get_ident())
        self._pool = pool
        self._state = "capturing"

    def _open_pool(self, pool: Any) -> tuple[Any, sim.SimPool | None]:
        """The id the capture records as its pool and the simulator's pool behind it."""
        return pool, self._fake.pools.lookup(pool)

    def capture_end(self) -> None:
        if self._state != "capturing":
            raise RuntimeError(f"{self.kind} graph capture_end called without a capture in progress")
        self._fake.capturing.discard(threading.get_ident())
        try:
            sim.end_capture(self._sim)
        except BaseException:
            self._state = "failed"
            raise
        self._state = "captured"
        self._fake.captured(self)

    def replay(self) -> None:
        if self._state != "captured":
            raise RuntimeError(
                f"{self.kind} graph replay called without a preceding successful capture (state: "
                f"{self._state})"
            )
        self._fake.replays += 1
        self._sim.replay()

    def reset(self) -> None:
        if self._state == "capturing":
            self._fake.capturing.discard(threading.get_ident())
        self._sim.reset()
        if self._state in ("captured", "capturing", "failed"):
            self._fake.released(self)
        self._state = "empty"

    def pool(self) -> Any:
        return self._pool

    @property
    def is_captured(self) -> bool:
        return self._state == "captured"


def push_raw(mode: TorchDispatchMode) -> None:
    """Push ``mode`` on the dispatch-mode stack without touching torch's Python-level "in a mode" flags.

    ``TorchDispatchMode.__enter__``/``__exit__`` save and restore those flags assuming strict LIFO order;
    the simulator takes its recorder off the stack out of order when a capture fails, so a fake mode that
    lives above the recorder must not take part in that bookkeeping (or the flags leak, and dynamo then
    recompiles on every call).
    """
    torch._C._push_on_torch_dispatch_stack(mode)


def remove_raw(mode: TorchDispatchMode) -> None:
    """Take ``mode`` (pushed with :func:`push_raw`) off the stack wherever it is; others keep their order."""
    above = []
    while torch._C._len_torch_dispatch_stack():
        top = torch._C._pop_torch_dispatch_stack(None)
        if top is mode:
            break
        above.append(top)
    else:
        above.reverse()
        for other in above:
            torch._C._push_on_torch_dispatch_stack(other)
        return
    for other in reversed(above):
        torch._C._push_on_torch_dispatch_stack(other)


def pop_mode(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off the dispatch-mode stack where it sits (modes above it are put back)."""
    stack = _get_current_dispatch_mode_stack()
    if mode not in stack:
        return
    above = []
    while True:
        top = _get_current_dispatch_mode_stack()[-1]
        top.__exit__(None, None, None)
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        other.__enter__()
