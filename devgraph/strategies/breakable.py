"""``breakable``: graph segments cut at every break op, which runs eagerly between them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from devgraph.contract.breaks import BreakOp, break_handler
from devgraph.contract.context import capturing
from devgraph.contract.keys import GraphKey
from devgraph.contract.modes import Strategy
from devgraph.contract.platform import DeviceGraph, GraphPlatform
from devgraph.strategies._base import GraphStrategy
from devgraph.strategies.segments import BreakCall, SegmentedPlan

__all__ = ["BreakableBackend", "SegmentRecorder"]


def _pool_copy(value: Any) -> Any:
    """A copy of a tensor (same shape, dtype, device, layout and, where dense, strides), allocated where the
    caller's allocation context puts it (the graph pool inside ``allocate_into``); anything else as it is."""
    return value.clone(memory_format=torch.preserve_format) if isinstance(value, torch.Tensor) else value


class SegmentRecorder:
    """Builds a :class:`SegmentedPlan`: one graph capture open at a time, break calls between them."""

    def __init__(self, platform: GraphPlatform, pool: Any) -> None:
        self.platform = platform
        self.pool = pool
        self.steps: list[DeviceGraph | BreakCall] = []
        self._open: DeviceGraph | None = None

    def begin_segment(self) -> None:
        graph = self.platform.new_graph()
        self.platform.capture_begin(graph, self.pool)
        self._open = graph

    def end_segment(self) -> None:
        graph, self._open = self._open, None
        if graph is not None:
            self.platform.capture_end(graph)
            self.steps.append(graph)

    def run_break(
        self, op: BreakOp | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run a break op eagerly (outside any graph) and record it for replay.

        The op runs on the ordinary allocator, so its temporaries (an attention's gathered K/V, say) are
        freed when it returns instead of staying reserved by the graph pool for as long as the graphs live.
        Its outputs are then copied into the graph pool, and the plan keeps only weak aliases of its
        arguments and outputs: once the forward no longer needs them, later segments (and other keys,
        captured into the same pool) reuse that memory, as one full graph would. Replay runs segments and
        breaks in capture order and one key at a time, so every alias is read before its memory is written
        again; at replay the op's fresh outputs are copied into these pool tensors, as at capture.
        """
        with capturing(False):
            fresh = op.run_eager(args, kwargs) if isinstance(op, BreakOp) else op(*args, **kwargs)
        with self.platform.allocate_into(self.pool):
            outputs = pytree.tree_map(_pool_copy, fresh)
        del fresh
        weak = self._weakly
        self.steps.append(BreakCall(op, weak(args), weak(kwargs), weak(outputs)))
        return outputs

    def _weakly(self, tree: Any) -> Any:
        alias = self.platform.weak_alias
        return pytree.tree_map(lambda t: alias(t) if isinstance(t, torch.Tensor) else t, tree)

    def abort(self) -> None:
        """Release everything recorded so far after a failure."""
        if self._open is not None:
            self.platform.abort_capture(self._open)
            self._open = None
        SegmentedPlan(self.steps, None).reset()
        self.steps = []

    def finish(self, outputs: Any) -> SegmentedPlan:
        return SegmentedPlan(self.steps, outputs)


class BreakableBackend(GraphStrategy):
    """Captures the forward in segments, cut at every ``@devgraph.graph_break`` op.

    At replay: segment, break op (eager, live forward context), segment, ... Use it when an op cannot
    be captured (attention with host-side metadata, a custom communication op) but the rest should be.
    """

    name = Strategy.BREAKABLE.value
    runs_breaks_eagerly = True

    def _capture(self, key: GraphKey, forward_fn: Callable[[], Any]) -> SegmentedPlan:
        recorder = SegmentRecorder(self.platform, self._pool)

        def on_break(op: BreakOp, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            recorder.end_segment()
            outputs = recorder.run_break(op, args, kwargs)
            recorder.begin_segment()
            return outputs

        try:
            recorder.begin_segment()
            with break_handler(on_break), capturing():
                outputs = forward_fn()
            recorder.end_segment()
        except BaseException:
            recorder.abort()
            raise
        return recorder.finish(outputs)
