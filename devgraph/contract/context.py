"""Forward context: what model code may ask about the step it is running in.

A break op replays with the arguments it was captured with, so anything that changes per batch and
is not in a static tensor (host-side sequence lengths, a scheduler's metadata) must be read from the
live context that :meth:`GraphRunner.run` installs for the duration of the step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

__all__ = [
    "CaptureView",
    "STATIC_VALUES",
    "forward_context",
    "get_forward_context",
    "is_capturing",
    "is_replaying",
    "capturing",
    "replaying",
]


#: The class attribute (or, for a mapping, the key) naming a context's values that may differ between
#: capture and replay on purpose: ``__devgraph_static__ = ("page_size", "attn.workspace")``. The graphs
#: replay what the capture read for them, and nothing checks it (docs/sanitizer.md).
STATIC_VALUES = "__devgraph_static__"


class CaptureView:
    """A capture-time context that shows model code another object while a graph is being captured.

    The runner hands one to :func:`forward_context` at capture: outside the capture itself (warm-ups, break
    ops running eagerly) :func:`get_forward_context` returns :attr:`target`, inside it
    :meth:`during_capture` (a view that notes what the forward read, so a replay whose live context holds
    other values can be stopped: devgraph.runner.guard.host_values).
    """

    __slots__ = ("target",)

    def __init__(self, target: Any) -> None:
        self.target = target

    def during_capture(self) -> Any:
        return self.target


class _State(threading.local):
    def __init__(self) -> None:
        self.context: Any = None
        self.view: CaptureView | None = None
        self.capturing = False
        self.replaying = False


_state = _State()


def get_forward_context() -> Any:
    """The per-step context object handed to ``GraphRunner.run(context=...)``, or ``None``."""
    # Dynamo cannot trace through the recording view (a proxy object): a compiled forward reads the plain
    # context while it is traced (docs/sanitizer.md, "Not compared"). is_compiling() comes first: dynamo
    # folds it, so a compiled forward never guards on the capture's state (no recompile at capture).
    view = _state.view
    if not torch.compiler.is_compiling() and view is not None and _state.capturing:
        return view.during_capture()
    return _state.context


def is_capturing() -> bool:
    """True while devgraph captures a graph (model code must then avoid host syncs)."""
    return _state.capturing


def is_replaying() -> bool:
    """True while devgraph replays a graph (only break ops run Python code then)."""
    return _state.replaying


@contextmanager
def forward_context(context: Any) -> Iterator[Any]:
    """Install ``context`` as the live forward context for the enclosed code (a :class:`CaptureView`:
    its target, seen through the view while a graph is captured)."""
    previous = _state.context, _state.view
    if isinstance(context, CaptureView):
        _state.context, _state.view = context.target, context
    else:
        _state.context, _state.view = context, None
    try:
        yield _state.context
    finally:
        _state.context, _state.view = previous


@contextmanager
def _switched(state: str, on: bool) -> Iterator[None]:
    previous = getattr(_state, state)
    setattr(_state, state, on)
    try:
        yield
    finally:
        setattr(_state, state, previous)


def capturing(on: bool = True) -> AbstractContextManager[None]:
    """Mark the enclosed code as running under capture (set by backends, read via :func:`is_capturing`)."""
    return _switched("capturing", on)


def replaying(on: bool = True) -> AbstractContextManager[None]:
    """Mark the enclosed code as running under replay (set by backends, read via :func:`is_replaying`)."""
    return _switched("replaying", on)
