"""What can move a graph's memory, as events: one process-wide counter that any of them bumps.

Three kinds of event reach it, none costing anything per step: a watched storage was freed (a weak
reference's callback: the last tensor on it died, or ``.data =`` / ``set_`` swapped it out), a parameter,
buffer or child module was assigned on a watched module (torch's global registration hooks, which
``module.weight = nn.Parameter(...)``, ``module.cache = torch.zeros(...)`` on a buffer and
``layers[3] = new_layer`` all run), and a storage's memory was given back or moved in place
(``tensor.untyped_storage().resize_(0)``, what sleep modes and offloading do to keep the tensor objects:
``UntypedStorage.resize_`` is wrapped once, and an event is counted when the storage's address changes).
A guard compares the counter with the value it last checked at: one integer comparison per step, and the
full check only after something happened.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["epoch", "install", "storage_ref", "watch_module"]


class _Counter:
    value = 0


_events = _Counter()
_lock = threading.Lock()
_watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_hooks_installed = False


def epoch() -> int:
    """The number of events so far (compare it; its value means nothing else)."""
    return _events.value


def _bump(*_: Any) -> None:
    # A lost increment between threads still leaves the counter changed, which is all a guard needs.
    _events.value += 1


def storage_ref(storage: torch.UntypedStorage) -> weakref.ReferenceType[torch.UntypedStorage]:
    """A weak reference to ``storage`` whose death is an event."""
    return weakref.ref(storage, _bump)


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    if module in _watched:
        _bump()


def _wrap_storage_resize() -> None:
    """Count a storage resized to other memory (its data pointer changed) as an event."""
    resize = torch.UntypedStorage.resize_

    def resize_(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        before = self.data_ptr()
        result = resize(self, size)
        if self.data_ptr() != before:
            _bump()
        return result

    resize_.__doc__ = resize.__doc__
    resize_.__wrapped__ = resize  # type: ignore[attr-defined]
    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]


def watch_module(module: nn.Module) -> None:
    """Make assignments of parameters, buffers and child modules on ``module`` events."""
    install()
    with _lock:
        _watched.add(module)


def install() -> None:
    """Install the hooks that report events (once per process)."""
    global _hooks_installed
    with _lock:
        if not _hooks_installed:
            from torch.nn.modules import module as torch_module

            torch_module.register_module_parameter_registration_hook(_on_registration)
            torch_module.register_module_buffer_registration_hook(_on_registration)
            torch_module.register_module_module_registration_hook(_on_registration)
            _wrap_storage_resize()
            _hooks_installed = True
