"""Rank 0's engine under tensor parallelism: every forward hands its batch to the other ranks first.

The engine builds each step's inputs on the host (``batch_device`` is the CPU); the forward encodes them
once (:func:`~devgraph.serve.tp.wire.encode_step`), puts the bytes in the step ring, and only then moves
them to its own device, the same way every worker does with the same bytes: one copy of the payload from
pinned memory, each input a view of it. So rank 0 pays one encode and one copy per step where the
single-device engine pays one synchronous copy per input.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import torch

from devgraph.messages import describe_error
from devgraph.ranks.group import RANK_TIMEOUT_ENV
from devgraph.serve.engine.batch import StepBatch
from devgraph.serve.engine.engine import Engine, StepResult
from devgraph.serve.tp.channel import RankLost, StepChannel
from devgraph.serve.tp.wire import encode_step

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
        self._steps = itertools.count()
        super().__init__(*args, **kwargs)
        self.batch_device = torch.device("cpu")  # the forward moves the encoded step to the device
        self._pin = self.model.device.type == "cuda"

    def forward(self, kind: str, batch: StepBatch) -> StepResult:
        try:
            message = encode_step(
                kind,
                batch.inputs,
                batch.context,
                step=next(self._steps),
                columns=self._columns(batch),
                pin=self._pin,
            )
            self.channel.send(message)
            on_device = dataclasses.replace(batch, inputs=message.inputs(self.model.device))
            return super().forward(kind, on_device)
        except Exception as exc:
            note = "" if isinstance(exc, RankLost) else self._timeout_note()
            self.on_failure(f"a {kind} step failed on rank 0: {describe_error(exc)}{note}")
            raise

    def _columns(self, batch: StepBatch) -> dict[str, int]:
        """The block-table columns the step reads: those of its longest request (the rest go as zeros)."""
        lengths = batch.context.seq_lens
        if not lengths:
            return {}
        block_size = self.model_config.block_size
        return {"block_tables": -(-max(lengths) // block_size)}

    def _timeout_note(self) -> str:
        return f" (a rank exited or did not answer within {RANK_TIMEOUT_ENV}={self.channel.timeout_s:g} s)"
