"""Rank 0's engine under tensor parallelism: every step's message goes to the other ranks first.

Every engine packs a step into one message on the host (:mod:`~devgraph.serve.engine.wire`); rank 0 puts
those same bytes in the step ring before it moves them to its own device, and every worker turns them
into the same inputs (:mod:`~devgraph.serve.tp.worker`). The overlapped scheduler works here as on one
device: rank 0 issues step N+1 while the ranks run step N; the ids of the tokens step N sampled are on rank
0's device only, so the step broadcasts them to the workers on the device (one small collective in the
step, see :mod:`~devgraph.serve.engine.device_step`): no rank's host waits for another's beyond the step's
collectives, and rank 0 never waits for a worker to read a step (the ring holds several).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from devgraph.messages import describe_error
from devgraph.ranks.group import RANK_TIMEOUT_ENV
from devgraph.reference.inputs import StepContext
from devgraph.serve.engine.device_step import StepResult
from devgraph.serve.engine.engine import Engine
from devgraph.serve.engine.wire import StepMessage
from devgraph.serve.tp.channel import RankLost, StepChannel

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

    def launch(
        self, kind: str, message: StepMessage, arrays: dict[str, torch.Tensor], context: StepContext
    ) -> StepResult:
        try:
            self.channel.send(message)
            return super().launch(kind, message, arrays, context)
        except Exception as exc:
            note = "" if isinstance(exc, RankLost) else self._timeout_note()
            self.on_failure(f"a {kind} step failed on rank 0: {describe_error(exc)}{note}")
            raise

    def _timeout_note(self) -> str:
        return f" (a rank exited or did not answer within {RANK_TIMEOUT_ENV}={self.channel.timeout_s:g} s)"
