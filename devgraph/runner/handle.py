"""``StepHandle``: a step that returned before the device finished it (``GraphRunner.submit``).

An engine that overlaps its host work with the device (schedule step N+1, stage its inputs and finish step
N-1's bookkeeping while step N runs) submits a step, gets its outputs at once (device tensors the device
is still writing) and an event recorded on the stream right after the step's work, and waits only where it
reads them on the host. Outputs follow ``run()``'s rule: valid until the runner's next step, so the engine
copies what it keeps (a non-blocking copy to pinned host memory, ordered after the event) before it
submits the next step, or passes ``copy=True`` / ``out=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from devgraph.contract.platform import DeviceEvent

__all__ = ["StepHandle"]


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
