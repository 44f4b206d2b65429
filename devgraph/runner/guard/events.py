"""What can move a graph's memory, as events: one process-wide counter that any of them bumps.

Four kinds of event reach it, none costing anything per step: a watched storage was freed (a weak
reference's callback: the last tensor on it died, or ``.data =`` / ``set_`` swapped it out), a parameter,
buffer or child module was assigned on a watched module (torch's global registration hooks, which
``module.weight = nn.Parameter(...)``, ``module.cache = torch.zeros(...)`` on a buffer and
``layers[3] = new_layer`` all run), and a storage's memory was given back or moved in place
(``tensor.untyped_storage().resize_(0)``, what sleep modes and offloading do to keep the tensor objects:
``UntypedStorage.resize_`` is wrapped once, and an event is counted when the storage's address changes),
and two tensors swapped their contents (``torch.utils.swap_tensors``, which ``load_state_dict()`` and
``module.to()`` use under torch's swap mode: the parameter keeps its identity and its old storage may stay
alive elsewhere, so neither of the first two kinds fires; the function is wrapped once).
A guard compares the counter with the value it last checked at: one integer comparison per step, and the
full check only after something happened.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["SWAP_ADVICE", "epoch", "install", "storage_ref", "watch_module"]

#: Added to the errors of a ``load_state_dict()`` that could not swap a watched module's tensors.
SWAP_ADVICE = (
    "devgraph: torch's swap mode is on (torch.__future__.set_swap_module_params_on_conversion(True)), so "
    "load_state_dict() swaps each tensor for a new one, which torch refuses while anything else references "
    "the old one, and the device graphs of a live devgraph runner were captured on these tensors (they hold "
    "them). Free the graphs first and capture again after: runner.release() then runner.restore() (a "
    "compiling strategy's compiled forward holds them too and stays: runner.close() and a new runner), or "
    "turn swap mode off so load_state_dict() copies into the tensors in place and the graphs stay valid"
)


class _Counter:
    value = 0


_events = _Counter()
_lock = threading.Lock()
_watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_hooks_installed = False
# The error list of each load_state_dict() under way on a watched module, and where its module's own
# errors start (the pre-hook notes it, the post-hook reads what was added).
_loading: dict[int, tuple[list[str], int]] = {}


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


def _data_ptr(storage: torch.UntypedStorage) -> int | None:
    """Where ``storage``'s memory is, or ``None`` for one without memory to point at: the meta storages of
    the fake tensors torch.compile traces with (their ``data_ptr()`` raises)."""
    if storage.device.type == "meta":
        return None
    try:
        return storage.data_ptr()
    except RuntimeError:  # a functional or other wrapper storage: nothing a graph could have captured
        return None


def _wrap_storage_resize() -> None:
    """Count a storage resized to other memory (its data pointer changed) as an event."""
    resize = torch.UntypedStorage.resize_

    def resize_(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        before = _data_ptr(self)
        result = resize(self, size)
        if before is not None and _data_ptr(self) != before:
            _bump()
        return result

    resize_.__doc__ = resize.__doc__
    resize_.__wrapped__ = resize  # type: ignore[attr-defined]
    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]


def _wrap_swap_tensors() -> None:
    """Count every ``torch.utils.swap_tensors`` as an event (a swapped parameter is the same object on
    other memory: only the full check sees it, so it must run)."""
    utils = torch.utils
    swap = getattr(utils, "swap_tensors", None)
    if swap is None or getattr(swap, "__devgraph_wrapped__", False):
        return

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> Any:
        result = swap(t1, t2)
        _bump()
        return result

    swap_tensors.__doc__ = swap.__doc__
    swap_tensors.__wrapped__ = swap  # type: ignore[attr-defined]
    swap_tensors.__devgraph_wrapped__ = True  # type: ignore[attr-defined]
    utils.swap_tensors = swap_tensors  # type: ignore[assignment]


def watch_module(module: nn.Module) -> None:
    """Make assignments of parameters, buffers and child modules on ``module`` events."""
    install()
    with _lock:
        if module not in _watched:
            _say_why_a_swap_failed(module)
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
            _wrap_swap_tensors()
            _hooks_installed = True


def _say_why_a_swap_failed(module: nn.Module) -> None:
    """Make a failed swap of ``module``'s tensors under torch's swap mode say what devgraph has to do with
    it: torch collects the failure into the load's error list, and the post-hook (run before torch raises
    them) adds :data:`SWAP_ADVICE`."""
    pre = getattr(module, "register_load_state_dict_pre_hook", None)
    post = getattr(module, "register_load_state_dict_post_hook", None)
    if pre is None or post is None:  # a torch without the hooks: its own error stands alone
        return

    def before(*args: Any) -> None:
        error_msgs = args[-1]  # (module, state_dict, prefix, metadata, strict, missing, unexpected, errors)
        if isinstance(error_msgs, list):
            _loading[id(module)] = (error_msgs, len(error_msgs))

    def after(loaded: nn.Module, incompatible: Any) -> None:
        error_msgs, start = _loading.pop(id(loaded), ([], 0))
        new = error_msgs[start:]
        if any("swapping" in str(m) for m in new) and SWAP_ADVICE not in error_msgs:
            error_msgs.append(SWAP_ADVICE)

    pre(before)
    post(after)
