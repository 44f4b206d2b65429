"""Undo a capture's writes to memory that existed before it, as a device capture never makes them.

A device capture records kernels without running them, so a KV cache, a step counter or a static
input buffer is the same after ``capture_end`` as before ``capture_begin``. The simulator runs each op
as it records it; :class:`StorageSnapshots` copies each such storage just before the capture's first
write to it and copies it back when the capture ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["StorageSnapshots"]


@contextlib.contextmanager
def _unwatched() -> Iterator[None]:
    """No dispatch or function mode sees the copies: they are bookkeeping, not part of any capture."""
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        yield


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage`` (whole storage, whatever view was written)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StorageSnapshots:
    """The contents a capture's writes replaced, one copy per untyped storage.

    Keyed by the storage's ``data_ptr`` at the first write; the storage itself is kept so that its
    address stays taken (and its data alive) until :meth:`restore`.
    """

    def __init__(self) -> None:
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}

    def save(self, ptr: int, storage: torch.UntypedStorage) -> None:
        """Copy ``storage`` (at address ``ptr``) unless this capture already has."""
        if ptr in self._saved:
            return
        with _unwatched():
            self._saved[ptr] = (storage, _as_bytes(storage).clone())

    def restore(self) -> None:
        """Copy every saved storage back and forget the copies.

        Latest first, so that where a storage was saved twice (moved to a new address by a ``resize_``
        in between) the contents from before the capture win. A storage that changed size keeps the
        bytes past the shorter of the two lengths.
        """
        saved, self._saved = self._saved, {}
        with _unwatched():
            for storage, before in reversed(saved.values()):
                now = _as_bytes(storage)
                if now.numel() == before.numel():
                    now.copy_(before)
                else:
                    shared = min(now.numel(), before.numel())
                    now[:shared].copy_(before[:shared])
