"""Reused memory for step messages on one device: the host buffers steps are encoded into, and the device
buffer they cross to.

Why: a step message crosses to a GPU from pinned memory in one non-blocking copy
(:mod:`~devgraph.serve.engine.wire`). Allocating that pinned buffer, the device copy and a view per input
for every step is host time on the critical path of every decode step (and, under tensor parallelism, on
every rank): tens of microseconds a step on a GPU host. A server repeats a few dozen step layouts, so:

- **host buffers** come from a small ring per size class (powers of two); a buffer is handed out again only
  once the device has finished copying it (an event recorded after its copy; the ring grows, up to
  :data:`MAX_HOST_BUFFERS` per class, before the host ever waits);
- **the device buffer** is one per size class, and every layout's input views of it are made once. Reusing
  it is safe because every step's copy and every reader of its inputs are queued on the same stream in
  step order: step N+1's copy runs after step N's forward, sampling and slot writes have read theirs;
- a 2-D input sent narrower than it is (:data:`~devgraph.serve.engine.wire.TRIM_MIN_BYTES`) is padded into
  a tensor of its own each step, as :meth:`StepMessage.inputs` does.

On the CPU the inputs are views of the message itself and nothing is reused (allocating host memory is
cheap there, and an input may be read after the step by the host). ``copy=True`` makes a CPU one
copy as a GPU one does, so the reuse logic runs in the CPU tests too.
"""

from __future__ import annotations

from typing import Final

import torch

from devgraph.serve.engine.wire import StepMessage, input_views

__all__ = ["MAX_HOST_BUFFERS", "MessageMemory"]

#: Host buffers kept per size class; past them, taking a buffer waits for the oldest copy to finish.
MAX_HOST_BUFFERS: Final = 8
#: The smallest size class (bytes): a decode step of a few requests fits.
MIN_CLASS_BYTES: Final = 4096
#: Layouts whose device views are kept (a server repeats a few dozen; more is a workload of odd shapes).
MAX_LAYOUTS: Final = 256


def _size_class(size: int) -> int:
    return max(MIN_CLASS_BYTES, 1 << (max(size, 1) - 1).bit_length())


class _HostBuffer:
    """A pooled host buffer: lent (handed out, its copy not queued yet), copying (its copy queued, with
    ``event`` recorded behind it) or free."""

    __slots__ = ("buffer", "copying", "event", "lent")

    def __init__(self, buffer: torch.Tensor, event: torch.Event | None) -> None:
        self.buffer, self.event = buffer, event
        self.lent = self.copying = False

    def free(self) -> bool:
        if self.lent:
            return False
        if self.copying:
            if self.event is not None and not self.event.query():
                return False
            self.copying = False
        return True


class _HostRing:
    """The host buffers of one size class, handed out in turn from ``next``."""

    def __init__(self) -> None:
        self.slots: list[_HostBuffer] = []
        self.next = 0


class MessageMemory:
    """Host buffers to encode or receive steps into (:meth:`host_buffer`) and the step's inputs on
    ``device`` (:meth:`inputs`). Owned by one engine (a tensor-parallel worker steps through its own);
    not thread-safe: one thread issues the steps."""

    def __init__(self, device: torch.device, *, copy: bool | None = None) -> None:
        self.device: Final = device
        #: Steps cross to a device buffer (a GPU; ``copy=True`` on the CPU for tests).
        self.copies: Final = device.type != "cpu" if copy is None else copy
        self.pinned: Final = device.type != "cpu"
        self._rings: dict[int, _HostRing] = {}
        self._owner: dict[int, _HostBuffer] = {}  # a pooled host buffer's address -> its slot
        self._device_buffers: dict[int, torch.Tensor] = {}
        self._views: dict[
            tuple[object, int], tuple[dict[str, torch.Tensor], tuple[tuple[str, int], ...]]
        ] = {}
        #: Host buffers made, and waits for a copy to finish before reusing one.
        self.allocated = 0
        self.waits = 0

    def host_buffer(self, size: int) -> torch.Tensor:
        """A CPU uint8 buffer of ``size`` bytes (pinned for a GPU) nobody else uses until :meth:`inputs` has
        queued its copy and the device has run it."""
        if not self.copies:
            self.allocated += 1
            return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        capacity = _size_class(size)
        ring = self._rings.get(capacity)
        if ring is None:
            ring = self._rings[capacity] = _HostRing()
        slots = ring.slots
        count = len(slots)
        for turn in range(count):
            index = (ring.next + turn) % count
            if slots[index].free():
                return self._lend(ring, index, size)
        if count < MAX_HOST_BUFFERS:
            self.allocated += 1
            buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pinned)
            slot = _HostBuffer(buffer, torch.Event(device=self.device) if self.pinned else None)
            slots.append(slot)
            self._owner[int(buffer.data_ptr())] = slot
            return self._lend(ring, count, size)
        copying = [i for i in range(count) if slots[i].copying]
        if not copying:  # every buffer lent and none sent: a caller keeps them; this one is not pooled
            self.allocated += 1
            return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        index = min(copying, key=lambda i: (i - ring.next) % count)  # the oldest copy queued
        event = slots[index].event
        if event is not None:
            self.waits += 1
            event.synchronize()
        slots[index].copying = False
        return self._lend(ring, index, size)

    def _lend(self, ring: _HostRing, index: int, size: int) -> torch.Tensor:
        ring.next = (index + 1) % len(ring.slots)
        slot = ring.slots[index]
        slot.lent = True
        return slot.buffer[:size]

    def release(self, message: StepMessage) -> None:
        """Take back the buffer of a message that never reached :meth:`inputs` (its step failed between
        encoding and issuing: nothing was queued from it); a no-op for any other message. Without it a
        failed step's buffer would stay lent, and enough of them would end the reuse in its size class."""
        slot = self._owner.get(int(message.buffer.data_ptr())) if self.copies else None
        if slot is not None:
            slot.lent = False

    def inputs(self, message: StepMessage) -> dict[str, torch.Tensor]:
        """``message``'s input tensors on the device: views of this object's device buffer, filled by one
        non-blocking copy of the message (a host buffer it lent is free again once the copy ran).
        A message whose buffer it did not lend crosses as :meth:`StepMessage.inputs` does."""
        buffer = message.buffer
        slot = self._owner.get(int(buffer.data_ptr())) if self.copies else None
        if slot is None:
            return message.inputs(self.device)
        size = int(buffer.numel())
        capacity = _size_class(size)
        try:
            target = self._device_buffers.get(capacity)
            if target is None:
                target = torch.empty(capacity, dtype=torch.uint8, device=self.device)
                self._device_buffers[capacity] = target
            target[:size].copy_(buffer, non_blocking=self.pinned)
            if slot.event is not None:  # a CPU copy is done when copy_ returns
                slot.event.record()
                slot.copying = True
        finally:  # lent no more: free once its copy ran, or at once where none was queued (it failed)
            slot.lent = False
        key = (message.arrays, capacity)
        made = self._views.get(key)
        if made is None:
            if len(self._views) >= MAX_LAYOUTS:
                self._views.clear()
            made = self._views[key] = input_views(message.arrays, target)
        views, narrow = made
        out = dict(views)
        for name, full in narrow:
            tensor = out[name]
            out[name] = torch.nn.functional.pad(tensor, (0, full - tensor.shape[-1]))
        return out
