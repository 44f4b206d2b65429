"""A fake ROCm build of torch for CI: ``torch.version.hip`` is set and ``torch.cuda``'s graph calls capture
through the CPU simulator.

What it models of torch on ROCm, as devgraph-rocm uses it:

* ``torch.version.hip`` set (and ``torch.version.cuda`` None), ``torch.cuda.is_available()`` true, one AMD
  device; ``torch.cuda.CUDAGraph`` (HIP graphs on ROCm) with ``capture_begin(pool=, capture_error_mode=)``,
  ``capture_end``, ``replay``, ``reset``, ``pool``; ``graph_pool_handle``; ``Stream`` / ``current_stream`` /
  ``stream`` (per-thread current stream); ``synchronize``; ``mem_get_info``, ``memory_reserved``,
  ``empty_cache``.
* The rules: capture only on a non-default stream (torch's own message), ``capture_error_mode`` in
  global/thread_local/relaxed, replay only after a successful capture, no second ``capture_begin``.
* hipBLASLt's lazy handles: the first GEMM (``mm``/``addmm``/``bmm``/``baddbmm``) issued on a stream
  creates that stream's handle and workspace. If that first GEMM happens while the stream captures,
  it fails with hipErrorStreamCaptureUnsupported, as on the device — which is why the warm-up must run
  on the capture stream.

Three methods of the ROCm platform are patched while installed: ``default_device`` (tensors live on the
CPU), ``record_opaque`` (compiled pieces are recorded whole, as the CPU platform records them) and
``allocate_into`` (break-op outputs are allocated as on the CPU platform; see ``install``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from fakes_common import FakeStream, Pools, SimBackedGraph, Streams, ensure_plugins_importable, pop_mode
from torch.utils._python_dispatch import TorchDispatchMode

from devgraph.platforms.sim import graph as sim

__all__ = ["FakeHip", "install", "HIPBLASLT_CAPTURE_TEXT"]

HIP_VERSION = "6.3.42131-devgraph-fake"
HIPBLASLT_CAPTURE_TEXT = (
    "CUDA error: operation not permitted when stream is capturing\nhipblasLtCreate / workspace allocation "
    "for a new stream failed: hipErrorStreamCaptureUnsupported (HIPBLAS_STATUS_INTERNAL_ERROR)"
)
_GEMMS = frozenset({"mm.default", "addmm.default", "bmm.default", "baddbmm.default", "mm.out", "addmm.out"})


class HipGraph(SimBackedGraph):
    """``torch.cuda.CUDAGraph`` on a ROCm build (a HIP graph)."""

    kind = "CUDA"  # torch's messages say CUDA on ROCm builds too


class _HipBlasLt(TorchDispatchMode):
    """Creates a hipBLASLt handle the first time a GEMM runs on a stream; refuses to while it captures."""

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __init__(self, fake: FakeHip) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func.__name__ in _GEMMS:
            self.fake.gemm_on(self.fake.streams.current_stream())
        return func(*args, **(kwargs or {}))


@dataclass
class FakeHip:
    """The fake's state and its ``torch.cuda`` functions."""

    streams: Streams = field(default_factory=Streams)
    pools: Pools = field(default_factory=Pools)
    live_graphs: int = 0
    replays: int = 0
    blas_handles: set = field(default_factory=set)
    capturing: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    rng_state: torch.Tensor = field(default_factory=lambda: torch.zeros(16, dtype=torch.uint8))

    # hooks of SimBackedGraph
    def before_capture(self, graph: SimBackedGraph) -> None:
        with self.lock:
            self.live_graphs += 1

    def captured(self, graph: SimBackedGraph) -> None:
        pass

    def released(self, graph: SimBackedGraph) -> None:
        with self.lock:
            self.live_graphs = max(0, self.live_graphs - 1)

    def gemm_on(self, stream: FakeStream) -> None:
        if stream.stream_id in self.blas_handles:
            return
        if threading.get_ident() in self.capturing and sim.is_capturing():
            raise RuntimeError(HIPBLASLT_CAPTURE_TEXT)
        self.blas_handles.add(stream.stream_id)

    # torch.cuda API
    def cuda_api(self) -> dict[str, Any]:
        fake = self

        def stream(s: Any) -> Any:
            return fake.streams.stream(s)

        return {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "get_device_name": lambda device=None: "AMD Instinct MI300X (devgraph fake)",
            "CUDAGraph": lambda: HipGraph(fake),
            "graph_pool_handle": fake.pools.graph_pool_handle,
            "Stream": lambda device=None, priority=0: FakeStream(device, priority),
            "current_stream": fake.streams.current_stream,
            "default_stream": fake.streams.default_stream,
            "stream": stream,
            "synchronize": lambda device=None: None,
            "mem_get_info": lambda device=None: ((192 << 30) - sim.reserved_bytes(), 192 << 30),
            "memory_reserved": lambda device=None: sim.reserved_bytes(),
            "empty_cache": lambda: None,
            # torch.compile saves and restores the device RNG state around tracing when a GPU is present.
            "get_rng_state": lambda device="cuda": fake.rng_state.clone(),
            "set_rng_state": lambda state, device="cuda": fake.rng_state.copy_(state),
        }


def _answer_triton_probes() -> None:
    from torch.utils import _triton

    for name in dir(_triton):
        probe = getattr(_triton, name)
        if name.startswith("has_triton") and callable(probe) and hasattr(probe, "cache_info"):
            with contextlib.suppress(Exception):  # a probe this torch answers differently is left alone
                probe()


@contextlib.contextmanager
def install(monkeypatch: Any) -> Iterator[FakeHip]:
    """Make this torch look like a ROCm build with one AMD GPU for the enclosed block."""
    ensure_plugins_importable()
    from devgraph_rocm.platform import RocmPlatform

    from devgraph.platforms import torch_cuda

    fake = FakeHip()
    # Dynamo asks torch.utils._triton's probes (has_triton(), the TMA ones: each cached once per process)
    # while it traces; asked first under the fake, they would query the fake GPU's properties, which a CPU
    # build cannot give. Answer them for this machine before the fake is on (the fake GPU runs no Triton
    # kernels either way), whatever order the tests run in.
    _answer_triton_probes()
    monkeypatch.setattr(torch.version, "hip", HIP_VERSION)
    monkeypatch.setattr(torch.version, "cuda", None)
    for name, value in fake.cuda_api().items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(RocmPlatform, "default_device", lambda self: torch.device("cpu"))
    # The process-wide capture stream cache must not hand a fake stream to real CUDA code afterwards.
    monkeypatch.setattr(torch_cuda, "_CAPTURE_STREAMS", {}, raising=False)
    # torch.compile'd pieces (tc_piecewise) run code the simulator cannot judge op by op: dynamo lifts
    # Python floats into CPU scalar tensors and reads them with .item(), harmless on a GPU (host memory)
    # but a "device sync" to a simulator whose every tensor is a device tensor. The CPU platform records
    # such calls whole through record_opaque; so does the fake (on a GPU the kernels are simply captured).
    monkeypatch.setattr(
        RocmPlatform,
        "record_opaque",
        lambda self, fn, *args, **kwargs: sim.record_opaque(fn, *args, **kwargs),
    )
    # Break ops allocate their outputs in the graph pool through the caching allocator's private calls,
    # which a CPU build does not have; the simulator's pools hold no allocator, so (as on the CPU platform)
    # the eager break op allocates as usual.
    monkeypatch.setattr(RocmPlatform, "allocate_into", lambda self, pool: contextlib.nullcontext())
    mode = _HipBlasLt(fake)
    mode.__enter__()
    try:
        yield fake
    finally:
        pop_mode(mode)
