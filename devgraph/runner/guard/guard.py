"""The address guard: before a replay, make sure every tensor the graphs read or write still lives where it
lived at capture, and name the one that does not instead of replaying on freed or stale memory.

Armed at capture from an observed eager run (:mod:`~devgraph.runner.guard.observe`) plus every parameter
and buffer of the modules the forward reaches (:mod:`~devgraph.runner.guard.reach`), it watches one entry
per storage: a weak reference whose death is an event, the data pointer, and the paths that led to it.
Per step (:meth:`AddressGuard.check`): one comparison of the event counter, and an identity check of the
few links no torch hook reports (closure cells, plain attributes, list and dict items), mapped in C.
Only after an event does it walk every entry. Weights updated in place (``param.copy_(new)``,
``load_state_dict``) keep their storage: the graphs stay valid and nothing fires.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.errors import ReplayError
from devgraph.runner.guard import events
from devgraph.runner.guard.reach import KEPT, Link, Place, Reach

__all__ = ["AddressGuard", "Watched"]

#: Entries named in one error (the rest are counted).
_SHOWN = 4
_CONTENTS = operator.attrgetter("cell_contents")


@dataclass
class Watched:
    """One storage the graphs use: how to tell it is still there, and how to name it."""

    ref: Callable[[], torch.UntypedStorage | None]
    ptr: int
    places: list[Place]
    facts: str  # "[1024, 4096] bfloat16"
    seen: str | None  # the op that used it in the observed run (None: only reachable as a module's tensor)

    @property
    def name(self) -> str:
        if self.places:
            return min((p.path for p in self.places), key=len)
        return f"an unnamed tensor {self.facts} (first used by {self.seen})"

    def problem(self) -> str | None:
        """What changed since capture, in words; ``None`` when nothing did."""
        storage = self.ref()
        if storage is None:
            return f"{self.name} ({self.facts}) was freed: its memory may hold anything now"
        if storage.data_ptr() != self.ptr:
            return f"{self.name} ({self.facts}) moved to new memory (resize_, set_ or .data =)"
        for place in self.places:
            broken = place.broken_at()
            if broken is not None:
                return f"{place.path} ({self.facts}) was replaced: {broken}, while the graphs use the old one"
            last = place.links[-1] if place.links else None
            # A rebound-on-purpose (kept) tensor is not the one its path holds now; its storage is checked.
            if last is not None and last.kind != KEPT and _ptr(last.current()) != self.ptr:
                return f"{place.path} ({self.facts}) is on other memory now (.data =, set_ or resize_)"
        return None


def _ptr(tensor: Any) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (AttributeError, RuntimeError, NotImplementedError):  # gone, or not a tensor with storage
        return 0


def _facts(tensor: torch.Tensor) -> str:
    return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


class AddressGuard:
    """Watches the tensors a runner's graphs use; :meth:`check` before each replay."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.entries: list[Watched] = []
        self._seen_epoch = -1
        self._stale: str | None = None
        # Links no hook reports, checked every step by identity: item containers and keys, cells.
        self._items: tuple[tuple[Any, ...], tuple[Any, ...], tuple[int, ...]] = ((), (), ())
        self._cells: tuple[tuple[Any, ...], tuple[int, ...]] = ((), ())

    @property
    def armed(self) -> bool:
        return bool(self.entries)

    def arm(
        self, reached: Reach, observed: Mapping[int, tuple[torch.Tensor, str]], exclude: set[int]
    ) -> None:
        """Watch every storage ``observed`` used and every module tensor ``reached``, except ``exclude``
        (the runner's own static buffers)."""
        wanted = (set(observed) | reached.module_tensors) - exclude - {0}
        entries = []
        for ptr in sorted(wanted):
            tensor, seen = observed.get(ptr, (reached.tensors.get(ptr), None))
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            entries.append(
                Watched(events.storage_ref(storage), ptr, reached.places.get(ptr, []), _facts(tensor), seen)
            )
        self.entries = entries
        self._stale = None
        self._index_links()
        self._seen_epoch = events.epoch()

    def _index_links(self) -> None:
        items: dict[tuple[int, Any], Link] = {}
        cells: dict[int, Link] = {}
        for entry in self.entries:
            for place in entry.places:
                for link in place.links:
                    if link.kind == "cell":
                        cells[id(link.owner())] = link
                    elif not link.hooked and link.kind != KEPT:
                        items[(id(link.container()), link.key)] = link
        self._items = (
            tuple(link.container() for link in items.values()),
            tuple(link.key for link in items.values()),
            tuple(link.value_id for link in items.values()),
        )
        self._cells = (
            tuple(link.owner() for link in cells.values()),
            tuple(link.value_id for link in cells.values()),
        )

    def disarm(self) -> None:
        self.entries = []
        self._items = ((), (), ())
        self._cells = ((), ())
        self._stale = None

    # -- per step -----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`ReplayError` naming what moved, if anything did; cheap when nothing happened."""
        if self._seen_epoch != events.epoch() or self._stale is not None:
            self.full_check()
            return
        containers, keys, ids = self._items
        if containers:
            try:
                now = tuple(map(id, map(operator.getitem, containers, keys)))
            except (KeyError, IndexError, TypeError):
                now = ()
            if now != ids:
                self.full_check()
                return
        cells, cell_ids = self._cells
        if cells:
            try:
                now = tuple(map(id, map(_CONTENTS, cells)))
            except ValueError:  # an emptied cell
                now = ()
            if now != cell_ids:
                self.full_check()

    def full_check(self) -> None:
        """Check every entry (after an event); raise naming what changed."""
        epoch = events.epoch()
        problems = [p for p in (e.problem() for e in self.entries) if p is not None]
        if not problems:
            self._seen_epoch = epoch
            self._stale = None
            return
        shown = "; ".join(problems[:_SHOWN])
        more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        self._stale = shown
        raise ReplayError(
            f"the {self.phase} graphs were captured on tensors that changed since: {shown}{more}. Replaying "
            "would read and write the old memory. Update weights and caches in place to keep the graphs "
            "valid (with torch.no_grad(): param.copy_(new); load_state_dict() does this, unless torch's swap "
            "mode is on: torch.__future__.set_swap_module_params_on_conversion(True) makes it swap in new "
            "tensors), or call runner.refresh() to capture again on the new tensors"
        )

    def describe(self) -> dict[str, Any]:
        return {
            "watched": len(self.entries),
            "named": sum(bool(e.places) for e in self.entries),
            "per_step_links": len(self._items[0]) + len(self._cells[0]),
            "stale": self._stale,
        }
