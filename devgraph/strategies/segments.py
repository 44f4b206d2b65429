"""Replay plans: what one captured shape key runs at replay."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.utils import _pytree as pytree

from devgraph.contract.breaks import BreakOp, break_op_for
from devgraph.contract.platform import DeviceGraph
from devgraph.errors import ReplayError

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
    _call: Callable[[], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._call = _bind_replay(self.op, self.args, self.kwargs)

    def run(self) -> None:
        """Run the op eagerly on its captured inputs and write the result where the next segment reads it."""
        try:
            copy_into(self.outputs, self._call())
        except Exception as exc:
            name = _op_name(self.op)
            raise ReplayError(
                f"break op {name} failed at replay ({type(exc).__name__}: {exc}); a break op must return "
                "outputs of the shapes it returned at capture (read per-step sizes from device tensors, "
                "not from the forward context, for anything that shapes an output)"
            ) from exc


def _op_name(op: BreakOp | Callable[..., Any]) -> str:
    """The break op's registered name, also when ``tc_piecewise`` recorded the FX submodule holding it."""
    if isinstance(op, BreakOp):
        return op.name
    graph = getattr(op, "graph", None)
    if isinstance(graph, torch.fx.Graph):
        for node in graph.nodes:
            found = break_op_for(node.target) if node.op == "call_function" else None
            if found is not None:
                return found.name
    return getattr(op, "__qualname__", None) or repr(op)


def _bind_replay(
    op: BreakOp | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[[], Any]:
    """The cheapest zero-argument call that runs ``op`` on its captured arguments at replay.

    A :class:`BreakOp` calls its Python function directly (see :meth:`BreakOp.replay_fn`). ``tc_piecewise``
    records an FX submodule holding one break-op node; calling it costs a module call plus the dispatcher,
    so when the submodule is exactly ``placeholders -> break op -> output`` the op's function is bound to
    the node's arguments instead. Anything else is called as recorded.
    """
    if isinstance(op, BreakOp):
        return partial(op.replay_fn(), *args, **kwargs)
    graph = getattr(op, "graph", None)
    if isinstance(graph, torch.fx.Graph) and not kwargs:
        direct = _bind_fx_break(graph, args)
        if direct is not None:
            return direct
    return partial(op, *args, **kwargs)


def _bind_fx_break(graph: torch.fx.Graph, args: tuple[Any, ...]) -> Callable[[], Any] | None:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    calls = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    outputs = [n for n in graph.nodes if n.op == "output"]
    if len(placeholders) != len(args) or len(calls) != 1 or len(outputs) != 1:
        return None
    node = calls[0]
    break_op = break_op_for(node.target) if node.op == "call_function" else None
    if break_op is None or outputs[0].args[0] is not node:
        return None
    values = {p: a for p, a in zip(placeholders, args, strict=True)}
    try:
        bound_args = torch.fx.node.map_arg(node.args, lambda n: values[n])
        bound_kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: values[n])
    except KeyError:
        return None
    return partial(break_op.replay_fn(), *bound_args, **bound_kwargs)


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

    def describe(self) -> dict[str, Any]:
        return {"graphs": self.num_segments, "segments": self.num_segments, "break_ops": self.num_breaks}

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
