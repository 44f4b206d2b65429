"""``StepHandle``: a step that returned before the device finished it (``GraphRunner.submit``).

An engine that overlaps its host work with the device (schedule step N+1, stage its inputs and finish step
N-1's bookkeeping while step N runs) submits a step, gets its outputs at once (device tensors the device
is still writing) and an event recorded on the stream right after the step's work, and waits only where it
reads them on the host. Outputs follow ``run()``'s rule: valid until the runner's next step, so the engine
copies what it keeps (a non-blocking copy to pinned host memory, ordered after the event) before it
submits the next step, or passes ``copy=True`` / ``out=``.

``HostCopy`` (``GraphRunner.to_host``) is the way back: tensors the step's later work computed (sampled
tokens, log probabilities) copied into pinned host memory without blocking, with an event recorded after
the copies; the engine reads them once ``wait()`` returns, a step later, while the device runs the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.contract.platform import DeviceEvent
from devgraph.errors import InputError
from devgraph.messages import shorten

__all__ = ["HostCopy", "StepHandle", "copy_to_host"]


@dataclass(frozen=True)
class StepHandle:
    """One submitted step: its ``outputs`` (as ``run()`` returns them) and the ``event`` recorded on the
    replay stream after its work (on a device whose work is done when issued, one that has completed)."""

    outputs: Any
    event: DeviceEvent

    def ready(self) -> bool:
        """Whether the device has finished the step (never blocks)."""
        return bool(self.event.query())

    def wait(self) -> Any:
        """Block until the device has finished the step; returns its outputs."""
        self.event.synchronize()
        return self.outputs


@dataclass(frozen=True)
class HostCopy:
    """Device tensors on their way to the host: ``tensors`` (host tensors, pinned on a device, the copies
    possibly still in flight) and the ``event`` recorded after the copies. Read them after ``wait()``."""

    tensors: tuple[torch.Tensor, ...]
    event: DeviceEvent

    def ready(self) -> bool:
        """Whether the copies are done (never blocks)."""
        return bool(self.event.query())

    def wait(self) -> tuple[torch.Tensor, ...]:
        """Block until the copies are done; returns the host tensors."""
        self.event.synchronize()
        return self.tensors


def copy_to_host(tensors: Sequence[torch.Tensor], record_event: Any) -> HostCopy:
    """Copy ``tensors`` to the host, ordered after the work issued so far on the current stream, without
    blocking: each into pinned memory with a non-blocking copy, then ``record_event()`` (the platform's).
    Tensors already on the host are copied too (the result never aliases a buffer a later step rewrites)."""
    host = []
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise InputError(
                f"to_host() copies tensors: argument {index} is {shorten(tensor)}; pass each tensor as an "
                "argument of its own (to_host(*tensors) for a list)"
            )
        if tensor.device.type == "cpu":
            host.append(tensor.clone())
            continue
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.append(pinned.copy_(tensor, non_blocking=True))
    return HostCopy(tuple(host), record_event())
