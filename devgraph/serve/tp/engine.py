"""Rank 0's engine under tensor parallelism: every forward sends its batch to the other ranks first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph.serve.engine.batch import StepBatch
from devgraph.serve.engine.engine import Engine, StepResult
from devgraph.serve.tp.channel import StepChannel

__all__ = ["TPEngine"]


class TPEngine(Engine):
    """An :class:`Engine` on rank 0 of a tensor-parallel model. ``on_failure`` is told of any failed
    forward: the ranks ran (or are stuck in) a step rank 0 did not finish, so they are out of step for
    good and the server must end."""

    def __init__(
        self, *args: Any, channel: StepChannel, on_failure: Callable[[str], None], **kwargs: Any
    ) -> None:
        self.channel = channel
        self.on_failure = on_failure
        super().__init__(*args, **kwargs)

    def forward(self, kind: str, batch: StepBatch) -> StepResult:
        # The inputs are small host lists turned into tensors; the workers rebuild them on their device.
        inputs = {name: tensor.cpu() for name, tensor in batch.inputs.items()}
        try:
            self.channel.send(("step", kind, inputs, batch.context))
            return super().forward(kind, batch)
        except Exception as exc:
            self.on_failure(f"a {kind} step failed on rank 0: {exc!r}")
            raise
