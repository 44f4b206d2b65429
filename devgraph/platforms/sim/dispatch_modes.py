"""The dispatch modes a sim capture runs under, and the bookkeeping that keeps torch's mode stacks right.

A capture watches two levels: :class:`SimRecorder` (a ``TorchDispatchMode``) sees every aten op the
capturing thread dispatches, and :class:`HostReadGuard` (a ``TorchFunctionMode``) sees the Python-level
calls, including the host reads that dispatch no op (``.tolist()``, ``.numpy()``). Both only forward
to the capture they belong to (:class:`CaptureHooks`).

A note on failed captures: a ``TorchDispatchMode`` handler runs with its own mode popped, and torch
pushes the mode back after the handler returns or raises, so a mode can never leave the stack from
inside its own handler. The ``TorchFunctionMode`` therefore removes the recorder once the error has
left the dispatcher. That outer mode (and a recorder that failed where no Python-level call surrounded
it) is *retired*: made an inert pass-through that stays on its stack until the next capture call on
the thread (``capture_begin``, ``capture_end``, ``abort_capture``, ``reset``, ``record_opaque``)
sweeps it off.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from devgraph.platforms.sim.ops import tensors_in

__all__ = [
    "CaptureHooks",
    "HostReadGuard",
    "SimRecorder",
    "keys_below_python",
    "mode_state",
    "on_stack",
    "remove_mode",
    "retire",
    "sweep_retired",
    "top_mode",
]


class CaptureHooks(Protocol):
    """What the modes forward to: the capture in progress."""

    paused: bool

    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def on_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


class _ModeState(threading.local):
    """Per-thread mode bookkeeping: like a device stream capture, a sim capture belongs to one thread."""

    def __init__(self) -> None:
        # True while an op recorded as a whole runs: what it issues internally belongs to it and must
        # not be recorded or checked again.
        self.in_op = False
        # How many of our mode handlers are running on this thread. A handler's own mode is off its
        # stack until the handler returns, so a finished mode can only be known gone at depth 0.
        self.depth = 0
        # Modes of finished captures that may still be on (or come back onto) a stack: (mode, dispatch?).
        self.retired: list[tuple[Any, bool]] = []


mode_state = _ModeState()


class SimRecorder(TorchDispatchMode):
    """The dispatch mode that records aten ops into the capture in progress on this thread.

    It is entered by :func:`~devgraph.platforms.sim.graph.begin_capture` and exited by
    :func:`~devgraph.platforms.sim.graph.end_capture`; do not enter it directly.
    """

    def __init__(self, capture: CaptureHooks) -> None:
        super().__init__()
        self.capture: CaptureHooks | None = capture

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        capture = self.capture
        if capture is None or capture.paused:
            return func(*args, **kwargs)
        state = mode_state
        state.depth += 1
        try:
            return capture.on_op(func, args, kwargs)
        finally:
            state.depth -= 1


class HostReadGuard(TorchFunctionMode):
    """Sees the Python-level calls of a capture: ``.tolist()`` and ``.numpy()`` (which dispatch no op),
    the name of the call that led to a failing op (for the error), and a place to take the recorder off
    the dispatch stack once an error has left it."""

    def __init__(self, capture: CaptureHooks) -> None:
        super().__init__()
        self.capture: CaptureHooks | None = capture

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        capture = self.capture
        state = mode_state
        if capture is None or capture.paused or state.in_op:
            return func(*args, **kwargs)
        state.depth += 1
        try:
            return capture.on_call(func, args, kwargs)
        finally:
            state.depth -= 1


# -- mode stacks -------------------------------------------------------------------------------------
def top_mode(dispatch: bool) -> Any:
    """The innermost mode of the dispatch (``dispatch=True``) or function mode stack, or ``None``."""
    if dispatch:
        length = torch._C._len_torch_dispatch_stack()
        return torch._C._get_dispatch_stack_at(length - 1) if length else None
    length = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(length - 1) if length else None


def on_stack(mode: Any, dispatch: bool) -> bool:
    """Whether ``mode`` is anywhere on its stack now."""
    if dispatch:
        length, get_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
    else:
        length, get_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
    return any(get_at(i) is mode for i in range(length()))


def remove_mode(mode: Any, dispatch: bool) -> bool:
    """Take ``mode`` off its stack wherever it is; ``False`` if it is not there (popped for its handler).

    Modes entered above it (left over by code that did not exit them) are put back in order.
    ``__exit__`` does the final pop so that torch's bookkeeping of active dispatch modes stays right.
    """
    if not on_stack(mode, dispatch):
        return False
    if dispatch:
        pop, push = (lambda: torch._C._pop_torch_dispatch_stack(None)), torch._C._push_on_torch_dispatch_stack
    else:
        pop, push = torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack
    above = []
    while True:
        top = pop()
        if top is mode:
            push(mode)
            mode.__exit__(None, None, None)
            break
        above.append(top)
    for other in reversed(above):
        push(other)
    return True


def retire(recorder: SimRecorder, guard: HostReadGuard) -> None:
    """Make a capture's modes inert and take them off their stacks (now, or at a later sweep)."""
    recorder.capture = None
    guard.capture = None
    mode_state.retired.extend(((recorder, True), (guard, False)))
    sweep_retired()


def sweep_retired() -> None:
    """Take retired modes off their stacks; forget them once no handler of ours can push one back."""
    retired = mode_state.retired
    if not retired:
        return
    for mode, dispatch in retired:
        while remove_mode(mode, dispatch):
            pass
    if mode_state.depth == 0:
        retired.clear()


def keys_below_python(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The dispatch keys of the arguments' tensors that come after the Python key (backend keys)."""
    keys = None
    for tensor in tensors_in((*args, *kwargs.values())):
        tensor_keys = torch._C._dispatch_keys(tensor)
        keys = tensor_keys if keys is None else keys | tensor_keys
    if keys is None:
        return None
    return keys & torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)
