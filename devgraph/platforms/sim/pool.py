"""Memory accounting for sim graphs: the CPU stand-in for a device graph pool."""

from __future__ import annotations

import threading
import weakref

__all__ = ["SimPool", "reserved_bytes"]

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
        _LIVE_POOLS.add(self)

    @property
    def nbytes(self) -> int:
        """Bytes held by the graphs captured into this pool."""
        with self._lock:
            return sum(entry[0] for entry in self._storages.values())

    @property
    def num_graphs(self) -> int:
        """How many live graphs hold memory from this pool."""
        return self._graphs

    def _hold(self, storages: dict[int, int]) -> None:
        with self._lock:
            self._graphs += 1
            for ptr, nbytes in storages.items():
                entry = self._storages.setdefault(ptr, [nbytes, 0])
                entry[1] += 1

    def _release(self, storages: dict[int, int]) -> None:
        with self._lock:
            self._graphs -= 1
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
