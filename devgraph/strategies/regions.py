"""Regional compilation: the model's repeated block compiled once, for every layer and every size.

Compiling a whole decoder compiles its 28 layers as one graph (inductor's time grows with the graph), and
again per size where one dynamic compile fails. A decoder repeats one block; compiling that block's forward
once serves every layer (dynamo lifts each layer's parameters and buffers as inputs of the one graph, so
the layers share it) and the rest of the forward (embedding, final norm, head) runs as it is. devgraph
captures the whole step in one device graph either way, so the replay is one launch; what is lost is the
fusion across layer boundaries, and the measured choice (:mod:`.choice`) still keeps the plain graph of any
key where that loses.

:func:`repeated_block` finds the block: the largest ``nn.ModuleList`` of at least two modules of one class.
:class:`RegionalForward` routes each of those modules' calls through one compiled function of the class's
``forward`` while devgraph runs the forward (the modules are left as they were outside those calls).
Turned on with ``regions=True`` in the backend options of ``full`` with a compiler.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

__all__ = ["RegionalForward", "repeated_block"]


def repeated_block(model: Any) -> tuple[str, list[nn.Module]] | None:
    """``(name, modules)`` of ``model``'s largest ``nn.ModuleList`` whose modules (two or more) are all of
    one class; ``None`` when it has none (a model that is not an ``nn.Module``, or whose layers are not
    modules: a plain forward over ``ParameterList`` weights)."""
    if not isinstance(model, nn.Module):
        return None
    best: tuple[str, list[nn.Module]] | None = None
    for name, child in model.named_modules():
        if not isinstance(child, nn.ModuleList) or len(child) < 2:
            continue
        items = list(child)
        if len({type(m) for m in items}) == 1 and (best is None or len(items) > len(best[1])):
            best = (name, items)
    return best


class RegionalForward:
    """``forward`` with each module of ``layers`` called through ``compiled`` (a compiled function of their
    class's ``forward``, taking the module first) while this object runs it."""

    def __init__(
        self, forward: Callable[..., Any], layers: Sequence[nn.Module], compiled: Callable[..., Any]
    ):
        self.forward = forward
        self.layers = list(layers)
        self.compiled = compiled
        self.block = type(self.layers[0]).__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._routed():
            return self.forward(*args, **kwargs)

    @contextlib.contextmanager
    def _routed(self) -> Iterator[None]:
        # An instance attribute named forward is what nn.Module.__call__ finds first: set for this call only,
        # and any the module already had is put back.
        saved = [layer.__dict__.get("forward") for layer in self.layers]
        for layer in self.layers:
            layer.forward = functools.partial(self.compiled, layer)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for layer, before in zip(self.layers, saved, strict=True):
                if before is None:
                    del layer.forward
                else:
                    layer.forward = before  # type: ignore[method-assign]


def block_forward(layers: Sequence[nn.Module]) -> Callable[..., Any]:
    """The function every layer's call goes through: the class's ``forward`` with the module first."""
    method = type(layers[0]).forward

    def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return method(module, *args, **kwargs)

    return call


def describe(name: str, layers: Sequence[nn.Module]) -> dict[str, Any]:
    return {"block": type(layers[0]).__name__, "modules": name, "count": len(layers)}
