"""One eager run of the forward under a dispatch mode that notes every tensor storage its ops read or write
and that the run did not allocate itself: the weights, caches and buffers a captured graph reaches by
address.

A device graph records addresses; it cannot say which of them belong to tensors the engine owns. This
pass can: an op's tensor argument whose storage no earlier op of the run produced existed before the run.
Kernels launched outside the dispatcher (a Triton kernel called directly) are not seen; the guard also
watches every parameter and buffer of the modules the forward reaches for that reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Touched", "observe"]


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for leaf in tree_leaves(values):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def _ptr(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


#: Ops that hand back a tensor torch made from Python data outside the dispatcher (``torch.tensor([...])``):
#: their argument is as new as their result, not memory the graph reaches from outside.
_LITERALS = frozenset({"aten.lift_fresh", "aten.lift", "aten.lift_fresh_copy"})


class Touched(TorchDispatchMode):
    """Notes, per storage the run did not allocate, one tensor on it and the first op that used it."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[int, tuple[torch.Tensor, str]] = {}
        self._made: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        found, made = self.found, self._made
        literal = str(getattr(func, "_overloadpacket", "")) in _LITERALS
        for tensor in _tensors((args, kwargs)):
            ptr = _ptr(tensor)
            if literal:
                made.add(ptr)
            elif ptr and ptr not in made and ptr not in found:
                found[ptr] = (tensor, str(func))
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            ptr = _ptr(tensor)
            if ptr and ptr not in found:
                made.add(ptr)
        return out


def _eagerly() -> contextlib.AbstractContextManager[Any]:
    """Compiled code runs as plain eager code in here (dynamo refuses to trace under a dispatch mode, and
    ``fullgraph=True`` then fails), compiling nothing and leaving its caches as they were."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def observe(run: Callable[[], Any]) -> dict[int, tuple[torch.Tensor, str]]:
    """Run ``run()`` under :class:`Touched`; the storages it used that existed before it."""
    mode = Touched()
    with _eagerly(), mode:
        run()
    return mode.found
