"""Memory accounting for sim graphs: the CPU stand-in for a device graph pool."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["SIM_MEMORY", "SimDeviceMemory", "SimPool", "reserved_bytes"]


@dataclass
class _GraphMemory:
    """One graph's storages in its pool: bytes, when each is first and last used, which outlive the graph's
    run (its outputs)."""

    storages: dict[int, int]
    lifetimes: dict[int, tuple[int, int]]
    kept: set[int] = field(default_factory=set)

    def peak(self) -> int:
        """The most bytes live at once while the graph runs, each storage freed after its last use unless
        kept."""
        events: list[tuple[int, int]] = []
        for ptr, nbytes in self.storages.items():
            first, last = self.lifetimes.get(ptr, (0, 0))
            events.append((first, nbytes))
            if ptr not in self.kept:
                events.append((last + 1, -nbytes))
        live = top = 0
        for _, change in sorted(events):  # at one op, frees (negative) before allocations
            live += change
            top = max(top, live)
        return top

    def kept_bytes(self) -> int:
        return sum(self.storages[p] for p in self.kept if p in self.storages)


class SimDeviceMemory:
    """The simulator playing a device short of memory during capture (tests): past ``capture_limit`` bytes
    allocated by one capture, the allocation fails, counted in ``ooms`` as ``memory_stats()["num_ooms"]``
    counts it on CUDA, and the capture ends with the error torch then raises (an invalidated capture,
    pytorch#159594), not an out-of-memory error."""

    def __init__(self) -> None:
        self.capture_limit: int | None = None
        self.ooms = 0


#: The simulator's device memory (one per process, like a device).
SIM_MEMORY = SimDeviceMemory()

_LIVE_POOLS: weakref.WeakSet[SimPool] = weakref.WeakSet()


class SimPool:
    """The memory pool sim graphs are captured into: the CPU stand-in for a device graph pool handle.

    It only does the accounting. Each graph registers the storages its ops allocated during capture
    (and that replay keeps alive); :attr:`nbytes` sums them, counting each storage once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._storages: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, graphs holding it]
        self._graphs = 0
        self._memory: dict[int, _GraphMemory] = {}  # id(storages dict) -> its graph, in capture order
        _LIVE_POOLS.add(self)

    @property
    def nbytes(self) -> int:
        """Bytes held by the graphs captured into this pool."""
        with self._lock:
            return sum(entry[0] for entry in self._storages.values())

    @property
    def modelled_bytes(self) -> int:
        """Bytes a device pool would reserve for these graphs, captured in this order, if its allocator
        reused every freed block: each graph's intermediates are free once it ran (the next capture reuses
        them), its outputs stay (:meth:`keep`). :attr:`nbytes` is the sum with no reuse (every storage the
        simulator keeps alive); this is what sharing one pool between runners saves on a device."""
        with self._lock:
            graphs = list(self._memory.values())
        kept = top = 0
        for graph in graphs:
            top = max(top, kept + graph.peak())
            kept += graph.kept_bytes()
        return top

    def keep(self, tensors: Iterable[object]) -> None:
        """Mark the storages of ``tensors`` (a graph's outputs) as living as long as their graph."""
        ptrs = set()
        for leaf in tree_leaves(list(tensors)):
            if isinstance(leaf, torch.Tensor):
                try:
                    ptrs.add(leaf.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):
                    continue
        with self._lock:
            for graph in reversed(self._memory.values()):
                found = ptrs & graph.storages.keys()
                graph.kept |= found
                ptrs -= found

    @property
    def num_graphs(self) -> int:
        """How many live graphs hold memory from this pool."""
        return self._graphs

    def _hold(self, storages: dict[int, int], lifetimes: dict[int, tuple[int, int]] | None = None) -> None:
        with self._lock:
            self._graphs += 1
            self._memory[id(storages)] = _GraphMemory(storages, dict(lifetimes or {}))
            for ptr, nbytes in storages.items():
                entry = self._storages.setdefault(ptr, [nbytes, 0])
                entry[1] += 1

    def _release(self, storages: dict[int, int]) -> None:
        with self._lock:
            self._graphs -= 1
            self._memory.pop(id(storages), None)
            for ptr in storages:
                entry = self._storages.get(ptr)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self._storages[ptr]

    def __repr__(self) -> str:
        return f"SimPool(graphs={self._graphs}, nbytes={self.nbytes})"


def reserved_bytes() -> int:
    """Bytes held by every live sim graph in this process."""
    return sum(pool.nbytes for pool in list(_LIVE_POOLS))
