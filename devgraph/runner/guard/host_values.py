"""Host values a graph baked in at capture, checked before each replay (the sanitizer's value check).

A device graph records kernels with their launch arguments. A Python number the forward read while it was
captured (``max_seqlen`` passed to a varlen kernel, a scale, a host-side attention plan) is in the graph as
a constant: a later step whose value differs replays the capture's, silently (transformers#45323,
sglang#39825). Where the forward reads such values through the forward context, devgraph sees them: at
capture the runner hands the forward a :class:`~devgraph.contract.context.CaptureView` of the capture
context, which, while the graph is being recorded (and only then: warm-ups and break ops that run eagerly
at replay read the plain context), notes every value read through it, by path (``context.attn.max_seqlen``):

* Python scalars, strings, ``None`` and tuples or lists of them, by value;
* tensors by storage and shape (the graph reads that memory: the live context must hold the same tensor,
  refilled in place), and host tensors of a device runner (small ones) by value too.

Before each replay of a key, :meth:`HostValues.check` reads the same paths from the live context and raises
:class:`~devgraph.errors.ReplayError` naming the first that differs and the fixes. A value declared static
(``__devgraph_static__`` on the context's class, or that key of a mapping) is not recorded; nor is anything
when ``run()`` gets no context (there is nothing to compare). The per-step cost is one dict lookup for a
key that read nothing, and about a microsecond per value read. ``DEVGRAPH_SANITIZE=0`` turns it off.
"""

from __future__ import annotations

import enum
import logging
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.contract.context import STATIC_VALUES, CaptureView
from devgraph.contract.keys import GraphKey
from devgraph.errors import ConfigError, ReplayError
from devgraph.messages import shorten

__all__ = ["SANITIZE_ENV", "HostValues", "Read", "sanitizing"]

logger = logging.getLogger(__name__)

#: Environment variable: ``0`` turns the value checks off (``1``, the default, keeps them on).
SANITIZE_ENV = "DEVGRAPH_SANITIZE"
#: Host tensors up to this many elements are compared by value; larger ones by storage only.
_VALUE_LIMIT = 4096
_SCALARS = (bool, int, float, complex, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)


def sanitizing() -> bool:
    """Whether the value checks are on (``$DEVGRAPH_SANITIZE``, default on)."""
    text = os.environ.get(SANITIZE_ENV, "").strip().lower()
    if text in ("", "1", "on", "true", "yes"):
        return True
    if text in ("0", "off", "false", "no"):
        return False
    raise ConfigError(f"{SANITIZE_ENV} must be 1 or 0 (on or off), got {text[:40]!r}")


def _is_scalar_sequence(value: Any) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) <= _VALUE_LIMIT
        and all(isinstance(v, _SCALARS) for v in value)
    )


Step = tuple[str, Any]  # ("attr", name) or ("item", key)


def _path_text(path: Sequence[Step]) -> str:
    text = "context"
    for kind, name in path:
        text += f".{name}" if kind == "attr" else f"[{name!r}]"
    return text


def _getter(path: Sequence[Step]) -> Callable[[Any], Any]:
    """Reads ``path`` from a context: one ``attrgetter`` for attribute paths (C), a loop otherwise."""
    if all(kind == "attr" for kind, _ in path):
        return operator.attrgetter(".".join(name for _, name in path))

    def read(context: Any) -> Any:
        for kind, name in path:
            context = getattr(context, name) if kind == "attr" else context[name]
        return context

    return read


def _storage(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


@dataclass(frozen=True)
class Read:
    """One value the forward read from the capture context while the graph was captured."""

    path: tuple[Step, ...]
    kind: str  # "value" (compared with ==), "tensor" (same storage and shape), "host" (values too)
    expected: Any
    read: Callable[[Any], Any]

    @property
    def name(self) -> str:
        return _path_text(self.path)

    def differs(self, context: Any) -> str | None:
        """How the live ``context`` differs here, in words; ``None`` when it holds what was captured."""
        try:
            value = self.read(context)
        except (AttributeError, KeyError, IndexError, TypeError):
            return f"{self.name} was {shorten(self._shown())} at capture; the live context has none"
        if self.kind == "value":
            now = tuple(value) if isinstance(value, list) else value
            if type(now) is type(self.expected) and now == self.expected:
                return None
            return f"{self.name} was {shorten(self._shown())} at capture and is {shorten(now)} now"
        if not isinstance(value, torch.Tensor):
            return f"{self.name} was a tensor at capture and is {shorten(value)} now"
        ptr, shape, values = self.expected
        same_shape = tuple(value.shape) == shape
        if _storage(value) != ptr or not same_shape:
            if values is not None and same_shape and torch.equal(value, values):
                return (  # a host tensor re-made with the same values each step
                    f"{self.name} is another host tensor than at capture, with the same values: a copy the "
                    "graph captured from host memory would read the capture-time tensor's (the guard cannot "
                    "tell whether the graph copied it or only used its values); keep one tensor in the "
                    "context and refill it in place"
                )
            return (
                f"{self.name} is another tensor than at capture ({list(value.shape)} now, {list(shape)} "
                "then): the graph reads the capture-time tensor's memory"
            )
        if values is not None and not torch.equal(value, values):
            return f"{self.name} (a host tensor) holds other values than at capture: the graph used those"
        return None

    def _shown(self) -> Any:
        if self.kind == "value":
            return self.expected
        return f"a tensor {list(self.expected[1])}"


class _Recorder:
    """Collects the reads of one key's capture (through the views :func:`_view` makes)."""

    def __init__(self, host_device: bool, static: frozenset[str]) -> None:
        self.host_device = host_device  # the runner's device is not the CPU: CPU tensors are host values
        self.static = static
        self.reads: dict[tuple[Step, ...], Read] = {}

    def seen(self, path: tuple[Step, ...], value: Any) -> Any:
        """Record ``value`` read at ``path`` and return what the forward gets (a view for containers)."""
        dotted = ".".join(str(name) for _, name in path)
        if dotted in self.static or str(path[0][1]) in self.static:
            return value
        if isinstance(value, _SCALARS) or _is_scalar_sequence(value):
            self._add(path, "value", tuple(value) if isinstance(value, list) else value)
            return value
        if isinstance(value, torch.Tensor):
            host = self.host_device and value.device.type == "cpu"
            copied = value.detach().clone() if host and value.numel() <= _VALUE_LIMIT else None
            facts = (_storage(value), tuple(value.shape), copied)
            self._add(path, "host" if copied is not None else "tensor", facts)
            return value
        if callable(value) or isinstance(value, (type, enum.EnumMeta)):
            return value  # methods, functions: what they compute is not a value of the context
        holder = hasattr(value, "__dict__") or hasattr(value, "__slots__")
        if holder or isinstance(value, (Mapping, list, tuple)):
            return _view(value, path, self)
        return value

    def _add(self, path: tuple[Step, ...], kind: str, expected: Any) -> None:
        if path not in self.reads:
            self.reads[path] = Read(path, kind, expected, _getter(path))


class _View:
    """What the forward sees instead of a context object while a graph is captured: attribute reads are
    recorded; everything else goes to the object. ``isinstance`` sees the object's class."""

    def __init__(self, target: Any, path: tuple[Step, ...], recorder: _Recorder) -> None:
        object.__setattr__(self, "_dg_target", target)
        object.__setattr__(self, "_dg_path", path)
        object.__setattr__(self, "_dg_recorder", recorder)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105 - isinstance() and type checks see the context's class
        return type(object.__getattribute__(self, "_dg_target"))

    def __getattr__(self, name: str) -> Any:
        target = object.__getattribute__(self, "_dg_target")
        value = getattr(target, name)
        if name.startswith("__"):
            return value
        path = (*object.__getattribute__(self, "_dg_path"), ("attr", name))
        return object.__getattribute__(self, "_dg_recorder").seen(path, value)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_dg_target"), name, value)

    def __repr__(self) -> str:
        return repr(object.__getattribute__(self, "_dg_target"))

    def __bool__(self) -> bool:
        return bool(object.__getattribute__(self, "_dg_target"))


class _ItemsView(_View):
    """A view of a mapping, list or tuple: item reads are recorded too."""

    def __getitem__(self, key: Any) -> Any:
        value = object.__getattribute__(self, "_dg_target")[key]
        path = (*object.__getattribute__(self, "_dg_path"), ("item", key))
        return object.__getattribute__(self, "_dg_recorder").seen(path, value)

    def get(self, key: Any, default: Any = None) -> Any:
        target = object.__getattribute__(self, "_dg_target")
        return self[key] if key in target else default

    def __len__(self) -> int:
        return len(object.__getattribute__(self, "_dg_target"))

    def __contains__(self, key: Any) -> bool:
        return key in object.__getattribute__(self, "_dg_target")

    def __iter__(self) -> Any:
        target = object.__getattribute__(self, "_dg_target")
        if isinstance(target, Mapping):
            return iter(target)
        return (self[i] for i in range(len(target)))


def _view(value: Any, path: tuple[Step, ...], recorder: _Recorder) -> Any:
    return (_ItemsView if isinstance(value, (Mapping, list, tuple)) else _View)(value, path, recorder)


def _static_names(context: Any) -> frozenset[str]:
    declared = (
        context.get(STATIC_VALUES, ())
        if isinstance(context, Mapping)
        else getattr(type(context), STATIC_VALUES, ())
    )
    return frozenset((declared,) if isinstance(declared, str) else declared)


class _RecordedContext(CaptureView):
    """The capture context of one key, seen through a recording view while the graph is captured."""

    __slots__ = ("recorder",)

    def __init__(self, target: Any, recorder: _Recorder) -> None:
        super().__init__(target)
        self.recorder = recorder

    def during_capture(self) -> Any:
        return _view(self.target, (), self.recorder)


class HostValues:
    """The host values each key's graph was captured with (see the module docstring)."""

    def __init__(self, phase: str, host_device: bool) -> None:
        self.phase = phase
        self.host_device = host_device
        self.enabled = sanitizing()
        self._reads: dict[GraphKey, tuple[Read, ...]] = {}
        self._recorders: dict[GraphKey, _Recorder] = {}

    def recording(
        self, capture_context: Callable[[GraphKey], Any] | None
    ) -> Callable[[GraphKey], Any] | None:
        """``capture_context`` wrapped so that each key's capture records what the forward read."""
        if capture_context is None or not self.enabled:
            return capture_context

        def context_for(key: GraphKey) -> Any:
            context = capture_context(key)
            self._reads.pop(key, None)
            self._recorders.pop(key, None)
            if context is None:
                return None
            recorder = self._recorders[key] = _Recorder(self.host_device, _static_names(context))
            return _RecordedContext(context, recorder)

        return context_for

    def _reads_of(self, key: GraphKey) -> tuple[Read, ...]:
        recorder = self._recorders.pop(key, None)
        if recorder is not None:  # the key's capture is over by its first replay: fix its reads
            self._reads[key] = tuple(recorder.reads.values())
        return self._reads.get(key, ())

    def check(self, key: GraphKey, context: Any) -> None:
        """Raise :class:`ReplayError` if the live ``context`` holds another value than ``key``'s capture
        read somewhere (no context: nothing to compare)."""
        if context is None or (not self._reads and not self._recorders):
            return
        reads = self._reads.get(key)
        if reads is None:
            reads = self._reads_of(key)
        for read in reads:
            problem = read.differs(context)
            if problem is not None:
                raise ReplayError(
                    f"the {self.phase} graph for {key} baked in a host value at capture: {problem}. "
                    "Replaying would compute with the capture's value (a Python number or host data in a "
                    "kernel's launch arguments is a constant of the graph). Make it device data (a "
                    "StaticInput, or a tensor the context keeps and refills in place), read it inside a "
                    "@devgraph.graph_break op under a breakable mode, make it part of the key (variants=), "
                    "or, if the graph's result does not depend on it, list it in the context's "
                    f"{STATIC_VALUES}"
                )

    def forget(self) -> None:
        self._reads.clear()
        self._recorders.clear()

    def describe(self) -> dict[str, Any]:
        for key in list(self._recorders):
            self._reads_of(key)
        return {
            "enabled": self.enabled,
            "keys": len(self._reads),
            "values": sorted({read.name for reads in self._reads.values() for read in reads}),
        }
