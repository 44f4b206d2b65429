"""A fake ``torch.accelerator`` graph API for CI: ``torch.accelerator.Graph`` and the device-neutral streams
and memory calls, capturing through the CPU simulator. No GPU here has a torch with the API (the GPU image's
torch 2.11 predates it), so this fake is what the ``accelerator`` platform's CI proof runs on.

What it models, as torch 2.13 ships the API (``torch/accelerator/graphs.py`` over
``torch._C._acceleratorGraph``) and as its CUDA implementation (``aten/src/ATen/cuda/CUDAGraph.cpp``) behaves:

* ``Graph(keep_graph=False, *, pool=None, capture_error_mode="default")``; ``capture_begin()`` reads
  ``graph_pool`` and ``capture_error_mode`` from the object (``form="capture_begin"``: the API's first form,
  ``Graph(keep_graph=False, *, pool=None)`` and ``capture_begin(capture_error_mode=...)``), ``capture_end``,
  ``instantiate``, ``replay``, ``reset``, ``pool``;
* the rules: a pool id is a tuple of two ints or None (the binding refuses anything else); ``pool=None``
  makes a pool whose id ``pool()`` returns, and only after a successful capture; an id never seen makes
  a pool on first use; capture only on a non-default stream, ending on the stream it began on; modes
  default/global/thread_local/relaxed; replay only after a capture; ``keep_graph=True`` instantiates on the
  first replay;
* ``torch.accelerator.current_accelerator`` / ``is_available`` / ``current_device_index`` /
  ``current_stream`` / ``set_stream`` / ``synchronize`` / ``get_memory_info`` / ``memory_reserved`` /
  ``empty_cache`` and ``torch.Stream(device=)`` with ``wait_stream``; optionally
  ``generate_graph_pool_handle()`` (``pool_handles=True``), or no ``Graph`` at all (``graph=False``: a torch
  before 2.12).

Tensors stay on the CPU: the fake's accelerator reports device type ``device_type`` (``cpu`` to run work,
``cuda`` to test which platform resolves a GPU device). The platform's ``record_opaque`` records compiled
pieces whole while installed, as the CPU platform does (see ``fakes_rocm``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from fakes_common import FakeStream, Pools, SimBackedGraph, Streams

from devgraph.platforms import accelerator
from devgraph.platforms.accelerator import AcceleratorGraphPlatform
from devgraph.platforms.sim import graph as sim

__all__ = ["FakeAccelerator", "install"]

MEMORY = 80 << 30


@dataclass
class FakeAccelerator:
    """The fake's state: streams, pools, and counts of what the platform asked of it."""

    device_type: str = "cpu"
    streams: Streams = field(default_factory=Streams)
    pools: Pools = field(default_factory=Pools)
    live_graphs: int = 0
    replays: int = 0
    instantiations: int = 0
    modes: list[str] = field(default_factory=list)
    pool_ids: list[tuple[int, int]] = field(default_factory=list)
    capturing: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    # hooks of SimBackedGraph
    def before_capture(self, graph: SimBackedGraph) -> None:
        with self.lock:
            self.live_graphs += 1

    def captured(self, graph: SimBackedGraph) -> None:
        self.pool_ids.append(graph.pool())

    def released(self, graph: SimBackedGraph) -> None:
        with self.lock:
            self.live_graphs = max(0, self.live_graphs - 1)

    def generate_graph_pool_handle(self) -> tuple[int, int]:
        return self.pools.graph_pool_handle()


class _GraphCore(SimBackedGraph):
    """What the ``torch._C._acceleratorGraph`` binding and the device's graph implementation enforce."""

    kind = "accelerator"
    capture_error_modes = ("default", "global", "thread_local", "relaxed")
    fake: FakeAccelerator  # set on the class that install() makes

    def __init__(self, keep_graph: bool = False) -> None:
        super().__init__(self.fake)
        self.keep_graph = keep_graph
        self.graph_pool: Any = None
        self._instantiated = False
        self._stream: FakeStream | None = None

    def _begin(self, mode: str) -> None:
        pool = self.graph_pool
        if pool is not None and not (
            isinstance(pool, tuple) and len(pool) == 2 and all(type(v) is int for v in pool)
        ):
            raise TypeError(
                "capture_begin(): incompatible function arguments. The following argument types are "
                f"supported: pool: tuple[int, int] | None; invoked with pool={pool!r}"
            )
        self.fake.modes.append(mode)
        super().capture_begin(pool=pool, capture_error_mode=mode)
        self._stream = self.fake.streams.current_stream()

    def _open_pool(self, pool: Any) -> tuple[Any, sim.SimPool | None]:
        return self.fake.pools.adopt(pool)

    def capture_end(self) -> None:
        if self._state == "capturing" and self.fake.streams.current_stream() is not self._stream:
            raise RuntimeError("Capture must end on the same stream it began on.")
        super().capture_end()
        self._instantiated = not self.keep_graph
        self.fake.instantiations += not self.keep_graph

    def instantiate(self) -> None:
        if self._state != "captured":
            raise RuntimeError("capture_end() must have been called before calling instantiate")
        self._instantiated = True
        self.fake.instantiations += 1

    def replay(self) -> None:
        if self._state == "captured" and not self._instantiated:
            self.instantiate()
        super().replay()

    def reset(self) -> None:
        super().reset()
        self._instantiated = False

    def pool(self) -> Any:
        if self._state != "captured":
            raise RuntimeError("Called Graph::pool() without a preceding successful capture.")
        return self._pool


class ModeAtConstruction(_GraphCore):
    """``torch.accelerator.Graph`` as torch 2.13 has it: the capture mode is given at construction."""

    def __init__(
        self, keep_graph: bool = False, *, pool: Any = None, capture_error_mode: str = "default"
    ) -> None:
        super().__init__(keep_graph)
        self.graph_pool = pool
        self.capture_error_mode = capture_error_mode

    def capture_begin(self) -> None:  # type: ignore[override]
        self._begin(self.capture_error_mode)


class ModeAtCaptureBegin(_GraphCore):
    """The API's first form: ``capture_begin(capture_error_mode=...)``, no mode at construction."""

    def __init__(self, keep_graph: bool = False, *, pool: Any = None) -> None:
        super().__init__(keep_graph)
        self.graph_pool = pool

    def capture_begin(self, capture_error_mode: str = "default") -> None:  # type: ignore[override]
        self._begin(capture_error_mode)


class FakeTorchStream(FakeStream):
    """``torch.Stream(device=..., priority=...)``; a class, so torch's ``isinstance`` checks keep working."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        super().__init__(device, priority)
        self.device = torch.device(device if device is not None else "cpu")
        self.device_type = self.device.type
        self.device_index = self.device.index or 0


@contextlib.contextmanager
def install(
    monkeypatch: Any,
    *,
    device_type: str = "cpu",
    form: str = "constructor",
    pool_handles: bool = False,
    graph: bool = True,
) -> Iterator[FakeAccelerator]:
    """Make ``torch.accelerator`` drive one fake ``device_type`` device with graphs for the enclosed block."""
    fake = FakeAccelerator(device_type=device_type)
    forms = {"constructor": ModeAtConstruction, "capture_begin": ModeAtCaptureBegin}
    graph_class = type("Graph", (forms[form],), {"fake": fake})

    def set_stream(stream: Any) -> None:
        fake.streams.set_current(stream)

    api: dict[str, Any] = {
        "current_accelerator": lambda check_available=False: torch.device(device_type),
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device_index": lambda: 0,
        "current_stream": lambda device=None: fake.streams.current_stream(),
        "set_stream": set_stream,
        "synchronize": lambda device=None: None,
        "get_memory_info": lambda device=None: (MEMORY - sim.reserved_bytes(), MEMORY),
        "memory_reserved": lambda device=None: sim.reserved_bytes(),
        "empty_cache": lambda: None,
    }
    for name, value in api.items():
        monkeypatch.setattr(torch.accelerator, name, value)
    if graph:
        monkeypatch.setattr(torch.accelerator, "Graph", graph_class)
    else:
        monkeypatch.delattr(torch.accelerator, "Graph", raising=False)
    if pool_handles:
        monkeypatch.setattr(
            torch.accelerator, "generate_graph_pool_handle", fake.generate_graph_pool_handle, raising=False
        )
    else:
        monkeypatch.delattr(torch.accelerator, "generate_graph_pool_handle", raising=False)
    monkeypatch.setattr(torch, "Stream", FakeTorchStream)
    # The process-wide capture stream cache must not hand a fake stream to real device code afterwards.
    monkeypatch.setattr(accelerator, "_CAPTURE_STREAMS", {})
    monkeypatch.setattr(
        AcceleratorGraphPlatform,
        "record_opaque",
        lambda self, fn, *args, **kwargs: sim.record_opaque(fn, *args, **kwargs),
    )
    yield fake
