"""The address guard: before a replay, make sure every tensor the graphs read or write still lives where it
lived at capture, and name the one that does not instead of replaying on freed or stale memory.

Armed at capture from an observed eager run (:mod:`~devgraph.runner.guard.observe`) plus every parameter
and buffer of the modules the forward reaches (:mod:`~devgraph.runner.guard.reach`), it watches one entry
per storage: a weak reference whose death is an event, the data pointer, and the paths that led to it.
Per step (:meth:`AddressGuard.check`): one comparison of the event counter, and an identity check of the
few links no torch hook reports (closure cells, plain and slotted attributes, list and dict items, module
globals), mapped in C.
Only after an event does it walk every entry. Weights updated in place (``param.copy_(new)``,
``load_state_dict``) keep their storage: the graphs stay valid and nothing fires.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.contract.keys import GraphKey
from devgraph.errors import CaptureError, ReplayError
from devgraph.messages import ADVICE_ATTRIBUTE, CAUSE_ATTRIBUTE
from devgraph.runner.guard import events
from devgraph.runner.guard.host_values import SANITIZE_ENV, HostValues
from devgraph.runner.guard.reach import KEPT, NOT_FOLLOWED, SLOT, Link, Place, Reach

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

    def __init__(self, phase: str, host_device: bool = False) -> None:
        self.phase = phase
        self.entries: list[Watched] = []
        #: The host values each key's capture read from the forward context (``host_device``: the runner's
        #: device is not the CPU, so CPU tensors there are host data).
        self.values = HostValues(phase, host_device)
        self._seen_epoch = -1
        self._stale: str | None = None
        # Links no hook reports, checked every step by identity: item containers and keys, cells.
        self._items: tuple[tuple[Any, ...], tuple[Any, ...], tuple[int, ...]] = ((), (), ())
        self._cells: tuple[tuple[Any, ...], tuple[int, ...]] = ((), ())
        self._slots: tuple[tuple[Any, ...], tuple[str, ...], tuple[int, ...]] = ((), (), ())
        self._complete = True

    @property
    def armed(self) -> bool:
        return bool(self.entries)

    def arm(
        self, reached: Reach, observed: Mapping[int, tuple[torch.Tensor, str]], exclude: set[int]
    ) -> None:
        """Watch every storage ``observed`` used and every module tensor ``reached``, except ``exclude``
        (the runner's own static buffers). Raises :class:`CaptureError` for what the observed run showed
        a graph would replay wrongly (:class:`~devgraph.runner.guard.observe.Hazard`), unless the sanitizer
        is off."""
        hazards = getattr(observed, "hazards", ())
        if hazards and self.values.enabled:
            hazard = hazards[0]
            error = CaptureError(f"{hazard.what} ({hazard.cause}; {SANITIZE_ENV}=0 turns this check off)")
            setattr(error, CAUSE_ATTRIBUTE, hazard.cause)
            setattr(error, ADVICE_ATTRIBUTE, hazard.advice)
            raise error
        events.install()  # a guard that watches no module still hears of storages resized in place
        # Tensors reached by name count when the observed run used them: made before it, or made by it and
        # kept (a lazily made workspace in a module global), besides every parameter and buffer.
        kept = set(reached.tensors) & getattr(observed, "made", frozenset())
        wanted = (set(observed) | reached.module_tensors | kept) - exclude - {0}
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
        self._complete = reached.complete
        self._index_links()
        self._seen_epoch = events.epoch()

    def _index_links(self) -> None:
        items: dict[tuple[int, Any], Link] = {}
        cells: dict[int, Link] = {}
        slots: dict[tuple[int, str], tuple[Any, Link]] = {}
        for entry in self.entries:
            for place in entry.places:
                for link in place.links:
                    if link.kind == "cell":
                        cells[id(link.owner())] = link
                    elif link.kind == SLOT:
                        owner = link.owner()
                        if owner is not None:
                            slots[(id(owner), link.key)] = (owner, link)
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
        # Slotted holders strongly, as list and dict containers are: a dropped holder is then still checked.
        self._slots = (
            tuple(owner for owner, _ in slots.values()),
            tuple(link.key for _, link in slots.values()),
            tuple(link.value_id for _, link in slots.values()),
        )

    def disarm(self) -> None:
        self.values.forget()
        self.entries = []
        self._items = ((), (), ())
        self._cells = ((), ())
        self._slots = ((), (), ())
        self._stale = None

    # -- per step -----------------------------------------------------------------------------------
    def check(self, key: GraphKey | None = None, context: Any = None) -> None:
        """Raise :class:`ReplayError` naming what moved, if anything did, or (given the ``key`` about to
        replay) which host value the live ``context`` holds differently from its capture; cheap when
        nothing happened."""
        self.check_addresses()
        if key is not None:
            self.values.check(key, context)

    def check_addresses(self) -> None:
        """The address part of :meth:`check`."""
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
                return
        owners, names, slot_ids = self._slots
        if owners:
            try:
                now = tuple(map(id, map(getattr, owners, names)))
            except AttributeError:  # a slot emptied (del holder.cache)
                now = ()
            if now != slot_ids:
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
            "per_step_links": len(self._items[0]) + len(self._cells[0]) + len(self._slots[0]),
            "stale": self._stale,
            # The walk stopped at a bound: tensors past it are watched by storage only, never by name.
            "complete": self._complete,
            "not_followed": list(NOT_FOLLOWED),
            "host_values": self.values.describe(),
        }
