"""A fake ``torch_npu`` for CI: its ``NPUGraph`` captures through the CPU simulator.

What it models of torch-npu 2.x (``torch_npu/npu/graphs.py``), as devgraph-npu uses it:

* ``torch.npu.NPUGraph`` with ``capture_begin(pool=, capture_error_mode=)``, ``capture_end``, ``replay``,
  ``reset``, ``pool`` and ``update(cpu_update_input)``; ``torch.npu.graph(npu_graph, pool=None,
  stream=None, auto_dispatch_capture=False, capture_error_mode="global")`` as the context manager that
  synchronizes, switches to the capture stream and (with ``auto_dispatch_capture``) enters the dispatch
  mode that records the ops torch-npu can update; ``graph_pool_handle``; streams; ``mem_get_info``,
  ``memory_reserved``, ``empty_cache``.
* The rules: capture on a non-default stream only; ``capture_error_mode`` in global/thread_local/
  relaxed; replay only after a successful capture; ``update`` raises unless the capture used
  ``auto_dispatch_capture=True``; a one-element ``cpu_update_input`` applies to every recorded op,
  otherwise its length must equal the number of recorded ops; an op is recorded only if a handler is
  registered for ``func.__name__`` (``npu_fused_infer_attention_score.default``, ...), and an update
  key the op was not called with is ignored. Without ``update``, a replay re-runs the attention op with
  the host-side lengths it was captured with, exactly the staleness the real device shows.
* Stream exhaustion: every captured graph holds a capture stream until ``reset``; past
  ``stream_budget`` live graphs, ``capture_begin`` raises the runtime's error 207008 text.

Two differences, both deliberate: work runs on CPU tensors (the platform's ``device_type`` is patched
to ``cpu`` while the fake is installed), and the dispatch mode sits above the simulator's recorder
rather than below the C++ capture, so that an updated op is replayed from its record (the real runtime
rewrites the captured task in place instead). ``update`` runs synchronously; the real one runs on a
side stream that the captured op waits for through an event.
"""

# No ``from __future__ import annotations``: torch derives the fake op's schema from the annotations.

import contextlib
import copy
import importlib.machinery
import math
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from fakes_common import Pools, SimBackedGraph, Streams, ensure_plugins_importable, push_raw, remove_raw
from torch.utils._python_dispatch import TorchDispatchMode

from devgraph.platforms.sim import graph as sim

__all__ = ["FakeTorchNpu", "install", "npu_fused_infer_attention_score", "STREAM_EXHAUSTION_TEXT"]

STREAM_EXHAUSTION_TEXT = (
    "capture_begin:../torch_npu/csrc/core/npu/NPUGraph.cpp:230 NPU function error: "
    "c10_npu::acl::AclmdlRICaptureBegin(capture_stream_, capture_mode), error code is 207008\n[ERROR] "
    "(PID:4242, Device:0, RankID:-1) ERR00100 PTA call acl api failed\n[Error]: Stream resources are "
    "insufficient.\n        Check whether the number of streams meets the requirements by referring to the "
    "description of the acl.rt.create_stream interface.\nInsufficient_Stream_Resources(EL0009): The stream "
    "resources are insufficient."
)


# -- the fake attention kernel (host-side sequence lengths) --------------------------------------------
@torch.library.custom_op("npu::npu_fused_infer_attention_score", mutates_args=())
def _ifa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    actual_seq_lengths_kv: Optional[list[int]] = None,  # noqa: UP045 - torch's schema inference needs it
    num_heads: int = 1,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention: ``query [B, N, D]``, ``key``/``value [B, S, N, D]``; row ``b`` attends to its first
    ``actual_seq_lengths_kv[b]`` positions (0: the row outputs zeros). Returns ``(out, softmax_lse)``."""
    b, s = key.shape[0], key.shape[1]
    lengths = list(actual_seq_lengths_kv) if actual_seq_lengths_kv is not None else [s] * b
    if len(lengths) != b:
        raise RuntimeError(
            f"npu_fused_infer_attention_score: actual_seq_lengths_kv has {len(lengths)} entries for batch {b}"
        )
    positions = torch.arange(s, device=key.device)
    limit = torch.tensor(lengths, device=key.device)
    visible = positions[None, :] < limit[:, None]  # [B, S]
    scores = torch.einsum("bnd,bsnd->bns", query, key) * scale
    scores = scores.masked_fill(~visible[:, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [B, N]
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1))
    out = torch.einsum("bns,bsnd->bnd", weights, value)
    return out, torch.nan_to_num(lse, neginf=0.0)


@_ifa.register_fake
def _ifa_fake(query, key, value, *, actual_seq_lengths_kv=None, num_heads=1, scale=1.0):
    return torch.empty_like(query), query.new_empty(query.shape[:2])


def npu_fused_infer_attention_score(query, key, value, **kwargs):
    """``torch_npu.npu_fused_infer_attention_score`` of the fake."""
    return torch.ops.npu.npu_fused_infer_attention_score(query, key, value, **kwargs)


# -- update records (torch_npu.npu.graphs._GraphDispatchMode) -----------------------------------------
@dataclass
class _DispatchRecord:
    func: Any
    args: list[Any]
    kwargs: dict[str, Any]
    updates: int = 0


class _IFAHandler:
    """``_IFAv1DefaultHandler``: ``actual_seq_lengths_kv`` may also be the 7th positional argument."""

    @classmethod
    def update_args(cls, record: _DispatchRecord, update_input: dict[str, Any]) -> None:
        if "actual_seq_lengths_kv" in update_input and len(record.args) >= 7:
            record.args[6] = update_input["actual_seq_lengths_kv"]


HANDLERS: dict[str, type] = {
    "npu_fused_infer_attention_score": _IFAHandler,
    "npu_fused_infer_attention_score.default": _IFAHandler,
}


class _GraphDispatchMode(TorchDispatchMode):
    """Records each op with a registered handler while its graph captures; ``update`` re-issues them."""

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.graph_dispatch_records: list[_DispatchRecord] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.__name__ not in HANDLERS:
            return func(*args, **kwargs)
        # Host-side values are copied (torch-npu deep-copies non-NPU kwargs into the record).
        record = _DispatchRecord(
            func,
            list(args),
            {k: copy.deepcopy(v) if not isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
        )
        self.graph_dispatch_records.append(record)
        # Recorded as one replay step that reads the record at replay time: an update changes what runs.
        return sim.record_opaque(_issue, record)

    def update_capture_record(self, cpu_update_input: list[dict[str, Any]]) -> None:
        records = self.graph_dispatch_records
        if len(cpu_update_input) == 1:
            cpu_update_input = [dict(cpu_update_input[0]) for _ in records]
        if len(cpu_update_input) != len(records):
            raise RuntimeError(
                f"Currently, there are {len(records)} operators that need to be updated by capture, and "
                f"there are only {len(cpu_update_input)} elements in the incoming cpu_update_input "
                "list"
            )
        for record, update_input in zip(records, cpu_update_input, strict=True):
            for key, value in update_input.items():
                if key in record.kwargs:
                    record.kwargs[key] = value
            HANDLERS[record.func.__name__].update_args(record, update_input)
            record.updates += 1


def _issue(record: _DispatchRecord) -> Any:
    return record.func(*record.args, **record.kwargs)


# -- NPUGraph and torch.npu.graph ---------------------------------------------------------------------
class NPUGraph(SimBackedGraph):
    kind = "NPU"

    def __init__(self, fake: "FakeTorchNpu") -> None:
        super().__init__(fake)
        self.graph_dispatch_mode = _GraphDispatchMode()
        self.auto_dispatch_capture = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.graph_dispatch_mode.graph_dispatch_records.clear()
        super().capture_begin(pool, capture_error_mode)

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        if not self.auto_dispatch_capture:
            raise RuntimeError(
                "The current graph configuration does not support update,Try to capture by setting "
                "auto_dispatch_capture=True during capture"
            )
        if not self.is_captured:
            raise RuntimeError("NPUGraph.update called on a graph without a successful capture")
        self.graph_dispatch_mode.update_capture_record(cpu_update_input)
        self._fake.updates += 1

    def reset(self) -> None:
        super().reset()
        self.graph_dispatch_mode.graph_dispatch_records.clear()


class _GraphContext:
    """``torch.npu.graph``: the capture context manager."""

    default_capture_stream = None

    def __init__(
        self,
        fake: "FakeTorchNpu",
        npu_graph: NPUGraph,
        pool: Any = None,
        stream: Any = None,
        auto_dispatch_capture: bool = False,
        capture_error_mode: str = "global",
    ) -> None:
        if stream is None:
            if _GraphContext.default_capture_stream is None:
                _GraphContext.default_capture_stream = fake.Stream()
            stream = _GraphContext.default_capture_stream
        self.fake = fake
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream
        self.stream_ctx = fake.stream(stream)
        self.npu_graph = npu_graph
        self.capture_error_mode = capture_error_mode
        npu_graph.auto_dispatch_capture = auto_dispatch_capture

    def __enter__(self) -> None:
        self.fake.synchronize()
        self.fake.empty_cache()
        self.stream_ctx.__enter__()
        self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)
        if self.npu_graph.auto_dispatch_capture:
            push_raw(self.npu_graph.graph_dispatch_mode)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.npu_graph.auto_dispatch_capture:
            remove_raw(self.npu_graph.graph_dispatch_mode)
        self.npu_graph.capture_end()
        self.stream_ctx.__exit__(exc_type, exc, tb)


@dataclass
class FakeTorchNpu:
    """The fake's state and its ``torch.npu`` functions (bound methods become module attributes)."""

    stream_budget: int = 1800
    streams: Streams = field(default_factory=Streams)
    pools: Pools = field(default_factory=Pools)
    live_graphs: int = 0
    replays: int = 0
    updates: int = 0
    synchronizes: int = 0
    capturing: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    # hooks of SimBackedGraph
    def before_capture(self, graph: SimBackedGraph) -> None:
        with self.lock:
            if self.live_graphs >= self.stream_budget:
                raise RuntimeError(STREAM_EXHAUSTION_TEXT)
            self.live_graphs += 1  # a failed capture keeps its stream until reset(), as on the device

    def captured(self, graph: SimBackedGraph) -> None:
        pass

    def released(self, graph: SimBackedGraph) -> None:
        with self.lock:
            self.live_graphs = max(0, self.live_graphs - 1)

    # torch.npu API
    def NPUGraph(self) -> NPUGraph:  # noqa: N802 - the vendor's name
        return NPUGraph(self)

    def graph_pool_handle(self) -> Any:
        return self.pools.graph_pool_handle()

    def Stream(self, device: Any = None, priority: int = 0) -> Any:  # noqa: N802
        from fakes_common import FakeStream

        return FakeStream(device, priority)

    def current_stream(self, device: Any = None) -> Any:
        return self.streams.current_stream()

    def stream(self, stream: Any) -> Any:
        return self.streams.stream(stream)

    def synchronize(self, device: Any = None) -> None:
        self.synchronizes += 1

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def get_device_name(self, device: Any = None) -> str:
        return "Ascend910B3 (devgraph fake)"

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        total = 64 << 30
        return total - sim.reserved_bytes(), total

    def memory_reserved(self, device: Any = None) -> int:
        return sim.reserved_bytes()

    def empty_cache(self) -> None:
        pass

    def module(self) -> types.ModuleType:
        """The fake as a ``torch_npu`` module with a ``torch_npu.npu`` submodule."""
        npu = types.ModuleType("torch_npu.npu")
        for name in (
            "NPUGraph",
            "graph_pool_handle",
            "Stream",
            "current_stream",
            "stream",
            "synchronize",
            "is_available",
            "device_count",
            "current_device",
            "get_device_name",
            "mem_get_info",
            "memory_reserved",
            "empty_cache",
        ):
            setattr(npu, name, getattr(self, name))
        fake = self

        def graph(
            npu_graph: NPUGraph,
            pool: Any = None,
            stream: Any = None,
            auto_dispatch_capture: bool = False,
            capture_error_mode: str = "global",
        ) -> _GraphContext:
            return _GraphContext(fake, npu_graph, pool, stream, auto_dispatch_capture, capture_error_mode)

        npu.graph = graph  # a class in torch-npu; the same call signature
        root = types.ModuleType("torch_npu")
        root.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
        root.__version__ = "2.6.0.post3+devgraph.fake"
        root.npu = npu
        root.npu_fused_infer_attention_score = npu_fused_infer_attention_score
        root._devgraph_fake = self
        return root


@contextlib.contextmanager
def install(monkeypatch: Any, **state: Any) -> Iterator[FakeTorchNpu]:
    """Install the fake as ``torch_npu`` / ``torch.npu`` for the enclosed block.

    The NPU platform's ``device_type`` becomes ``cpu`` (tensors live on the CPU); the seam forgets any
    module it imported before and after.
    """
    ensure_plugins_importable()
    import sys

    from devgraph_npu import _torch_npu
    from devgraph_npu.platform import NpuPlatform

    fake = FakeTorchNpu(**state)
    module = fake.module()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", module.npu, raising=False)
    monkeypatch.setattr(NpuPlatform, "device_type", "cpu")
    _torch_npu.reset()
    try:
        yield fake
    finally:
        _torch_npu.reset()
