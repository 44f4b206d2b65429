"""State a forward mutates besides its inputs, so ``capture()`` and ``verify()`` can leave it as found.

A forward that advances a write position or a step counter (Hugging Face's static cache does) is run
several times by ``capture()`` (warm-ups) and ``verify()`` (graph and eager). Declared state is saved
before and restored after, so neither changes what later steps compute. Declare small tensors
(``state=[model.step, cache.write_pos]``), a save/restore pair for state that is not a tensor, or
``state="auto"``: the tensors the capture finds the forward advancing
(:mod:`devgraph.runner.capture.undeclared`) are saved and restored from then on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.errors import ConfigError
from devgraph.messages import shorten

__all__ = ["StateHooks", "DeclaredState", "as_state"]


@dataclass(frozen=True)
class StateHooks:
    """A save/restore pair: ``restore(save())`` must put the state back exactly."""

    save: Callable[[], Any]
    restore: Callable[[Any], None]


class DeclaredState:
    """The state a runner saves and restores; empty when nothing was declared."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], hooks: Sequence[StateHooks], auto: bool = False
    ) -> None:
        self.tensors = dict(tensors)
        self.hooks = tuple(hooks)
        #: ``state="auto"``: tensors the capture finds the forward advancing are adopted (:meth:`adopt`).
        self.auto = auto

    def adopt(self, name: str, tensor: torch.Tensor) -> None:
        """Save and restore ``tensor`` from now on (found by the capture's probe under ``state="auto"``)."""
        while name in self.tensors:
            name += "_"
        self.tensors[name] = tensor

    def __bool__(self) -> bool:
        return bool(self.tensors or self.hooks)

    def save(self) -> tuple[dict[str, torch.Tensor], list[Any]]:
        return {n: t.detach().clone() for n, t in self.tensors.items()}, [h.save() for h in self.hooks]

    def restore(self, saved: tuple[dict[str, torch.Tensor], list[Any]]) -> None:
        tensors, hooked = saved
        with torch.no_grad():
            for name, value in tensors.items():
                self.tensors[name].copy_(value)
        for hook, value in zip(self.hooks, hooked, strict=True):
            hook.restore(value)

    @contextlib.contextmanager
    def preserved(self) -> Iterator[Callable[[], None]]:
        """Save now, restore on exit; the yielded function restores in between (between verify's runs)."""
        if not self:
            yield lambda: None
            return
        saved = self.save()
        try:
            yield lambda: self.restore(saved)
        finally:
            self.restore(saved)

    def describe(self) -> dict[str, Any]:
        return {
            "tensors": {n: f"{t.dtype} {tuple(t.shape)} on {t.device}" for n, t in self.tensors.items()},
            "hooks": len(self.hooks),
            "auto": self.auto,
        }


def as_state(value: Any) -> DeclaredState:
    """``state=`` as given to the runner: tensors (a list or a name mapping), hooks, or a mix in a list."""
    if value is None:
        return DeclaredState({}, ())
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(
                "state= must be a tensor, a list or a mapping of them, StateHooks, or 'auto'; "
                f"got {shorten(value)}"
            )
        return DeclaredState({}, (), auto=True)
    items = value.items() if isinstance(value, Mapping) else enumerate(_as_list(value))
    tensors: dict[str, torch.Tensor] = {}
    hooks: list[StateHooks] = []
    for name, item in items:
        if isinstance(item, torch.Tensor):
            tensors[str(name)] = item
        elif isinstance(item, StateHooks):
            hooks.append(item)
        else:
            raise ConfigError(
                "state= takes tensors the forward mutates in place, or devgraph.StateHooks(save, restore); "
                f"got {shorten(item)} ({type(item).__name__})"
            )
    return DeclaredState(tensors, hooks)


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, (torch.Tensor, StateHooks)):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ConfigError(f"state= must be a tensor, a list or a mapping, got {shorten(value)}")
