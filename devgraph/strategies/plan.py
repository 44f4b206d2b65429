"""Replay plans: what one captured shape key runs at replay."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from devgraph.breaks import BreakOp
from devgraph.platform import DeviceGraph

__all__ = ["BreakCall", "SegmentedPlan", "copy_into"]


def copy_into(captured: Any, fresh: Any) -> None:
    """Copy every tensor of ``fresh`` into the matching tensor of ``captured`` (same pytree structure)."""
    if isinstance(captured, torch.Tensor):
        captured.copy_(fresh)
        return
    for dst, src in zip(pytree.tree_leaves(captured), pytree.tree_leaves(fresh), strict=True):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)


@dataclass
class BreakCall:
    """A break op as captured: the op, the tensors it was called with, the outputs later segments read.

    The strong references keep the capture-time tensors (and so their graph-pool memory) alive.
    """

    op: BreakOp | Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: Any

    def run(self) -> None:
        """Run the op eagerly on its captured inputs and write the result where the next segment reads it."""
        op = self.op
        fresh = op.run_eager(self.args, self.kwargs) if isinstance(op, BreakOp) else op(*self.args, **self.kwargs)
        copy_into(self.outputs, fresh)


class SegmentedPlan:
    """Graph segments and break ops in capture order; replay runs them in that order."""

    def __init__(self, steps: Sequence[DeviceGraph | BreakCall], outputs: Any) -> None:
        self.steps = list(steps)
        self.outputs = outputs
        self._calls = tuple(s.run if isinstance(s, BreakCall) else s.replay for s in self.steps)

    @property
    def num_segments(self) -> int:
        return sum(not isinstance(s, BreakCall) for s in self.steps)

    @property
    def num_breaks(self) -> int:
        return sum(isinstance(s, BreakCall) for s in self.steps)

    def replay(self) -> Any:
        for call in self._calls:
            call()
        return self.outputs

    def reset(self) -> None:
        for step in self.steps:
            if not isinstance(step, BreakCall):
                step.reset()
        self.steps.clear()
        self._calls = ()
        self.outputs = None
