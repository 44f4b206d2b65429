"""Break ops: functions that always run eagerly, between graph segments.

``@devgraph.graph_break`` turns a function into a torch custom operator (so ``torch.compile`` keeps it
as one opaque node that ``tc_piecewise`` can split at) wrapped in a :class:`BreakOp`. While a
``breakable`` capture is in progress, calling the op hands control to the strategy, which ends the
current graph segment, runs the op eagerly and starts the next segment. Everywhere else the op simply
runs, so the same model code works in eager mode, under ``full`` capture and under ``torch.compile``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol, overload

import torch

from devgraph.errors import ConfigError

__all__ = ["BreakOp", "BreakHandler", "graph_break", "is_break_target", "break_handler"]


class BreakHandler(Protocol):
    """Called instead of a break op while a breakable capture is in progress."""

    def __call__(self, op: BreakOp, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


class _HandlerSlot(threading.local):
    handler: BreakHandler | None = None


_slot = _HandlerSlot()
_break_targets: set[Any] = set()
#: Op overload -> its BreakOp, so a replay plan can reach the Python function behind an FX call node.
_break_ops: dict[Any, BreakOp] = {}


class BreakOp:
    """A function registered as a break op. Call it like the function it wraps."""

    def __init__(self, fn: Callable[..., Any], op: Any) -> None:
        self.fn = fn
        self.name: str = op._qualname if hasattr(op, "_qualname") else str(op)
        self._op = op
        self.overload = op._opoverload
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", self.name)
        self.__wrapped__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # is_compiling() is constant-folded by dynamo, so tracing never reads the handler slot.
        if not torch.compiler.is_compiling():
            handler = _slot.handler
            if handler is not None:
                return handler(self, args, kwargs)
        return self._op(*args, **kwargs)

    def run_eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the op now, bypassing any installed handler."""
        return self._op(*args, **kwargs)

    def replay_fn(self) -> Callable[..., Any]:
        """What a replay plan calls: the wrapped function itself, unless a device kernel overrides it.

        Going through torch's custom-op dispatcher costs tens of microseconds per call, paid at every
        break of every replayed step; at replay the op runs eagerly outside any mode, so the plain
        function computes the same thing. Capture still goes through :meth:`run_eager` (and torch's checks).
        """
        kernels = getattr(self._op, "_backend_fns", None)
        if kernels is not None and set(kernels) <= {None} and not getattr(self._op, "_disabled_kernel", None):
            return self.fn
        return self._op

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """Register the shape function ``torch.compile`` uses to trace through this op."""
        return self._op.register_fake(fake)

    def __repr__(self) -> str:
        return f"BreakOp({self.name})"


def _auto_name(fn: Callable[..., Any]) -> str:
    module = re.sub(r"\W", "_", getattr(fn, "__module__", "user") or "user")
    qualname = re.sub(r"\W", "_", getattr(fn, "__qualname__", fn.__name__))
    return f"devgraph_user::{module}__{qualname}"


def _default_fake(*args: Any, **kwargs: Any) -> torch.Tensor:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return torch.empty_like(value)
    raise ConfigError("a graph_break op with no tensor argument needs an explicit fake=... shape function")


@overload
def graph_break(fn: Callable[..., Any], /) -> BreakOp: ...


@overload
def graph_break(
    name: str | None = None, /, *, mutates_args: Iterable[str] = (), fake: Callable[..., Any] | None = None
) -> Callable[[Callable[..., Any]], BreakOp]: ...


def graph_break(
    fn_or_name: Callable[..., Any] | str | None = None,
    /,
    *,
    mutates_args: Iterable[str] = (),
    fake: Callable[..., Any] | None = None,
) -> Any:
    """Mark a function as a break op.

    Use bare (``@graph_break``) or with options (``@graph_break("mylib::attn", mutates_args=("cache",))``).
    The function needs type annotations (torch derives the operator schema from them), must name every
    argument it writes in ``mutates_args``, and must return new tensors rather than views of its inputs.
    ``fake`` computes output shapes for ``torch.compile``; by default the output is shaped like the
    first tensor argument.

    A break op runs with the arguments it was captured with; per-batch state that is not in those
    tensors must come from :func:`devgraph.get_forward_context`.
    """

    def wrap(fn: Callable[..., Any], name: str | None) -> BreakOp:
        qualname = name or _auto_name(fn)
        if "::" not in qualname:
            raise ConfigError(f"graph_break name {qualname!r} must look like 'namespace::op_name'")
        try:
            op = torch.library.custom_op(qualname, fn, mutates_args=tuple(mutates_args))
        except Exception as exc:  # torch explains which annotation it could not turn into a schema
            raise ConfigError(f"cannot register {qualname} as a graph_break op: {exc}") from exc
        op.register_fake(fake or _default_fake)
        break_op = BreakOp(fn, op)
        _break_targets.add(break_op.overload)
        _break_ops[break_op.overload] = break_op
        return break_op

    if callable(fn_or_name):
        return wrap(fn_or_name, None)
    return lambda fn: wrap(fn, fn_or_name)


def break_op_for(target: Any) -> BreakOp | None:
    """The :class:`BreakOp` behind an FX node target (an op overload), or ``None``."""
    return _break_ops.get(target)


def is_break_target(target: Any) -> bool:
    """Whether an FX node target is a registered break op (``tc_piecewise`` splits there)."""
    if target in _break_targets:
        return True
    packet = getattr(target, "_overloadpacket", None)
    return packet is not None and any(getattr(t, "_overloadpacket", None) is packet for t in _break_targets)


class break_handler:  # noqa: N801 - used like contextlib helpers
    """Context manager that routes break-op calls on this thread to ``handler``."""

    def __init__(self, handler: BreakHandler | None) -> None:
        self._handler = handler
        self._previous: BreakHandler | None = None

    def __enter__(self) -> None:
        self._previous = _slot.handler
        _slot.handler = self._handler

    def __exit__(self, *exc: object) -> None:
        _slot.handler = self._previous
