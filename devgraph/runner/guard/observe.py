"""One eager run of the forward under a dispatch mode that notes every tensor storage its ops read or write
and that the run did not allocate itself: the weights, caches and buffers a captured graph reaches by
address. The same pass notes what a graph would replay wrongly (the sanitizer's capture-time checks,
:class:`Hazard`): random numbers drawn from a ``torch.Generator`` of the forward's own (a graph replays the
capture's draws unless the generator is registered with it), and on a device a tensor made on one stream,
used on another without ``record_stream`` and freed within the forward (inside a graph its memory is
handed to a later allocation on the first stream while the other may still read it: TensorRT-LLM#12847).

A device graph records addresses; it cannot say which of them belong to tensors the engine owns. This
pass can: an op's tensor argument whose storage no earlier op of the run produced existed before the run.
Kernels launched outside the dispatcher (a Triton kernel called directly) are not seen; the guard also
watches every parameter and buffer of the modules the forward reaches for that reason.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Hazard", "Observed", "Touched", "observe"]


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


@dataclass(frozen=True)
class Hazard:
    """Something the observed run did that a graph would replay wrongly: its class, what, and the fix."""

    cause: str  # "unregistered_generator" or "cross_stream_free"
    what: str
    advice: str


class Observed(dict[int, tuple[torch.Tensor, str]]):
    """The storages the run used that existed before it (data pointer -> one tensor on it and the first op
    that used it), the hazards it showed, and the storages it made that are not its outputs (a workspace
    or cache made lazily on the first call: state the graphs use from then on, if something keeps it)."""

    hazards: tuple[Hazard, ...] = ()
    made: frozenset[int] = frozenset()


def _default_generators() -> tuple[torch.Generator, ...]:
    found = [torch.default_generator]
    if torch.cuda.is_available():
        found.extend(torch.cuda.default_generators)
    return tuple(found)


_GENERATOR_ADVICE = (
    "draw from the default generator (graphs advance it on every replay), or draw the numbers outside "
    "the captured forward and pass them in as a static input"
)
_STREAM_ADVICE = (
    "call tensor.record_stream(stream) for each stream that uses a tensor made on another one (or make it "
    "on the stream that frees it last), as the caching allocator requires outside graphs too"
)


class Touched(TorchDispatchMode):
    """Notes, per storage the run did not allocate, one tensor on it and the first op that used it; and
    the hazards of :class:`Hazard`."""

    def __init__(self) -> None:
        super().__init__()
        self.found = Observed()
        self._made: set[int] = set()
        self._generators: dict[str, str] = {}  # op -> the generator it drew from, for a custom generator
        self._defaults = _default_generators()
        # CUDA only: the stream each storage the run made was made on, a weak reference to it, the other
        # streams that used it, and the streams record_stream() told the allocator about.
        self._streams: dict[int, tuple[Any, Any, str]] = {}
        self._crossed: dict[int, set[Any]] = {}
        self._recorded: dict[int, set[Any]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        found, made = self.found, self._made
        packet = str(getattr(func, "_overloadpacket", ""))
        literal = packet in _LITERALS
        generator = kwargs.get("generator")
        if generator is not None and not any(generator is d for d in self._defaults):
            self._generators.setdefault(str(func), str(generator.device))
        stream = None
        for tensor in _tensors((args, kwargs)):
            ptr = _ptr(tensor)
            if literal:
                made.add(ptr)
            elif ptr and ptr not in made and ptr not in found:
                found[ptr] = (tensor, str(func))
            if tensor.is_cuda and ptr in self._streams:
                stream = stream if stream is not None else _key(torch.cuda.current_stream(tensor.device))
                if packet == "aten.record_stream":
                    self._recorded.setdefault(ptr, set()).add(_key(args[1]) if len(args) > 1 else stream)
                elif stream != self._streams[ptr][0]:
                    self._crossed.setdefault(ptr, set()).add(stream)
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            ptr = _ptr(tensor)
            if ptr and ptr not in found:
                made.add(ptr)
                if tensor.is_cuda and ptr not in self._streams:
                    made_on = _key(torch.cuda.current_stream(tensor.device))
                    self._streams[ptr] = (made_on, weakref.ref(tensor.untyped_storage()), str(func))
        return out

    def made(self) -> set[int]:
        """Storages the run's ops made (whether or not still alive)."""
        return set(self._made)

    def hazards(self) -> tuple[Hazard, ...]:
        """What the run showed (after it ended: a storage freed within it is dead by then)."""
        found = [
            Hazard(
                "unregistered_generator",
                f"{op} drew random numbers from a torch.Generator of the forward's own (device {device}): "
                "a graph records the generator's state at capture, so every replay would draw the same "
                "numbers",
                _GENERATOR_ADVICE,
            )
            for op, device in self._generators.items()
        ]
        for ptr, streams in self._crossed.items():
            made_on, ref, op = self._streams[ptr]
            unrecorded = streams - self._recorded.get(ptr, set())
            if unrecorded and ref() is None:
                found.append(
                    Hazard(
                        "cross_stream_free",
                        f"a tensor made by {op} on stream {made_on[1]} was used on another stream and freed "
                        "within the forward without record_stream(): inside a graph its memory goes to a "
                        "later allocation while the other stream may still read it",
                        _STREAM_ADVICE,
                    )
                )
                break
        return tuple(found)


def _key(stream: Any) -> tuple[int, int]:
    """A stream as (device index, stream id): ``torch.Stream`` and ``torch.cuda.Stream`` alike."""
    return int(stream.device_index), int(stream.stream_id)


def _eagerly() -> contextlib.AbstractContextManager[Any]:
    """Compiled code runs as plain eager code in here (dynamo refuses to trace under a dispatch mode, and
    ``fullgraph=True`` then fails), compiling nothing and leaving its caches as they were."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def observe(run: Callable[[], Any]) -> Observed:
    """Run ``run()`` under :class:`Touched`; the storages it used that existed before it, and the hazards."""
    mode = Touched()
    with _eagerly(), mode:
        result = run()
    found = mode.found
    found.hazards = mode.hazards()  # while the run's outputs are alive: only its temporaries are dead
    found.made = frozenset(mode.made()) - {_ptr(t) for t in _tensors(result)}
    del result
    return found
