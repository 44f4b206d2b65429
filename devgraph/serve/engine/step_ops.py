"""Counting the torch ops the engine issues per step around its graphs (a measuring tool, not a hot path).

On a GPU host every op issued outside the captured graph costs a launch (several microseconds of host time,
plus Python and the dispatcher), and with the overlapped scheduler the host must finish step N-1's reading
and issue step N+1 within step N's device time: on a fast model these ops are the inter-token latency's
host share. :class:`StepOps` counts them on any device (the CPU included, where the replay is simulated):
a ``TorchDispatchMode`` sees every aten op, and wrappers around the engine's parts (installed on the
instances, and on :class:`~devgraph.serve.engine.wire.StepMessage` for the message's copy, and removed on
exit) say which phase of the step issued it. The ops inside the graph backend's ``replay`` (the simulated
graph's own ops on the CPU) are the graph's and are not counted.

Phases, in step order: ``schedule``, ``stage`` (the batch's host tensors), ``plan`` (the sampling plan
and the step's message), then the device half: ``message`` (the message's one copy to the device),
``cow`` (copy-on-write blocks), ``ids`` (pending ids from the token slots), ``runner`` (the runner's
validation, static-input staging and output slicing), ``sample`` (the sampled tokens into their slots
too), ``slots`` (a direct :meth:`TokenSlots.write`),
``to_host`` (the copies back and their event), ``device`` (the rest of the device half); then
``read`` (the previous step's results) and ``engine`` (anything else in :meth:`Engine.step`).

Each op is one of: ``view`` (metadata only: no device work anywhere), ``alloc`` (an allocation, or
``torch.tensor`` of a list), ``kernel`` (device work on a GPU when its tensors are there: a launch; the
Triton greedy kernels, no aten ops, are counted by hand in the phase that launched them).
``copies`` counts the ops that move bytes between the host and the device (on the CPU, where nothing
crosses, the crossings a GPU would make: the message's copy and each tensor copied back); ``events`` the
device events recorded (the platform's ``record_event``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PHASES", "StepCount", "StepOps", "op_kind"]

PHASES = (
    "schedule",
    "stage",
    "plan",
    "message",
    "tables",
    "cow",
    "ids",
    "runner",
    "sample",
    "slots",
    "to_host",
    "device",
    "read",
    "engine",
)
#: Phases whose ops run on the device on a GPU (the rest work on host tensors).
DEVICE_PHASES = frozenset(
    {"message", "tables", "cow", "ids", "runner", "sample", "slots", "to_host", "device"}
)

_ALLOC = frozenset({"empty", "empty_strided", "lift_fresh", "new_empty", "new_empty_strided", "empty_like"})
_COPIES = frozenset({"copy_", "_to_copy", "_copy_from", "_copy_from_and_resize"})


def op_kind(func: Any) -> str:
    """``view``, ``alloc`` or ``kernel`` for an aten op overload (see the module docstring)."""
    name = func._schema.name.split("::")[-1]
    if name in _ALLOC:
        return "alloc"
    if getattr(func, "is_view", False) or name in {"as_strided", "set_", "detach", "alias"}:
        return "view"
    return "kernel"


@dataclass
class StepCount:
    """The ops of one step: per phase, ``ops[phase][op name]``; ``kinds[phase][kind]``; ``copies`` per
    phase (host <-> device crossings)."""

    ops: dict[str, Counter[str]] = field(default_factory=dict)
    kinds: dict[str, Counter[str]] = field(default_factory=dict)
    copies: Counter[str] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)

    def add(self, phase: str, name: str, kind: str) -> None:
        self.ops.setdefault(phase, Counter())[name] += 1
        self.kinds.setdefault(phase, Counter())[kind] += 1

    def total(self, kind: str | None = None, phases: Any = None) -> int:
        """Ops of ``kind`` (all when ``None``) in ``phases`` (all when ``None``)."""
        return sum(
            count
            for phase, kinds in self.kinds.items()
            if phases is None or phase in phases
            for k, count in kinds.items()
            if kind is None or k == kind
        )

    @property
    def device_ops(self) -> int:
        """Kernels of the device phases: the launches a GPU pays for around the replay."""
        return self.total("kernel", DEVICE_PHASES)

    def as_dict(self) -> dict[str, Any]:
        return {
            "device_ops": self.device_ops,
            "host_kernels": self.total("kernel") - self.device_ops,
            "ops": self.total(),
            "copies": sum(self.copies.values()),
            "events": sum(self.events.values()),
            "phases": {
                phase: {
                    "kinds": dict(sorted(self.kinds[phase].items())),
                    "ops": dict(sorted(self.ops[phase].items())),
                    "copies": self.copies.get(phase, 0),
                    "events": self.events.get(phase, 0),
                }
                for phase in PHASES
                if phase in self.kinds or phase in self.copies or phase in self.events
            },
        }


class _Mode(TorchDispatchMode):
    def __init__(self, census: StepOps) -> None:
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.census._saw(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


class StepOps:
    """Counts the ops of each :meth:`Engine.step` of ``engine`` while entered (``with StepOps(engine) as
    ops: engine.step()``); ``ops.steps`` holds one :class:`StepCount` per step."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: list[StepCount] = []
        self._phase: list[str] = []
        self._current: StepCount | None = None
        self._undo: list[Callable[[], None]] = []
        self._device = engine.model.device

    # -- counting ----------------------------------------------------------------------------------
    def _saw(self, func: Any, args: Any, kwargs: Any) -> None:
        step, phase = self._current, self._phase[-1] if self._phase else "engine"
        if step is None or phase == "replay":
            return
        name = func._schema.name.split("::")[-1]
        step.add(phase, name, op_kind(func))
        if name in _COPIES and _crosses(args, kwargs):
            step.copies[phase] += 1

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._phase.append(name)
        try:
            yield
        finally:
            self._phase.pop()

    # -- wrappers ----------------------------------------------------------------------------------
    def _wrap(self, owner: Any, attribute: str, phase: str, after: Callable[..., None] | None = None) -> None:
        """Run ``owner.attribute`` (a bound method, or a class's function) in ``phase``."""
        original = getattr(owner, attribute)
        in_class = isinstance(owner, type)
        census = self

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with census.phase(phase):
                result = original(*args, **kwargs)
                if after is not None:
                    after(result, *args, **kwargs)
                return result

        setattr(owner, attribute, wrapped)
        if in_class:
            self._undo.append(lambda: setattr(owner, attribute, original))
        else:
            self._undo.append(lambda: owner.__dict__.pop(attribute, None))

    def _wrap_module(self, module: Any, attribute: str, phase: str) -> None:
        original = getattr(module, attribute)
        census = self

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with census.phase(phase):
                return original(*args, **kwargs)

        setattr(module, attribute, wrapped)
        self._undo.append(lambda: setattr(module, attribute, original))

    def _install(self) -> None:
        from devgraph.serve.engine import engine as engine_module

        engine = self.engine
        cpu = self._device.type == "cpu"
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine, "_stage", "stage")
        self._wrap(engine, "_plan", "plan")
        self._wrap(engine, "_run_on_device", "device")
        self._wrap(engine, "_read", "read")

        def message_crossing(result: Any, *args: Any, **kwargs: Any) -> None:
            if cpu and self._current is not None:  # a GPU copies the message once; the CPU has no copy
                self._current.copies["message"] += 1

        self._wrap(engine.message_memory, "inputs", "message", message_crossing)
        step = engine.device_step
        self._wrap(step, "_tables", "tables")
        self._wrap(step, "copy_blocks", "cow")
        self._wrap(step, "_ids", "ids")
        self._wrap(step.slots, "write", "slots")
        for runner in (engine.decode_runner, engine.prefill_runner):
            self._wrap(runner, "run", "runner")
            for graphs in runner.life.sets.all:
                self._wrap(graphs.backend, "replay", "replay")

        def back_crossings(result: Any, *tensors: Any) -> None:
            if cpu and self._current is not None:  # one copy per tensor on a GPU; clones on the CPU
                self._current.copies["to_host"] += len(tensors)

        self._wrap(engine.decode_runner, "to_host", "to_host", back_crossings)
        platform = engine.decode_runner.life.plan.platform
        record_event = platform.record_event

        def counted_event(*args: Any, **kwargs: Any) -> Any:
            if self._current is not None:
                self._current.events[self._phase[-1] if self._phase else "engine"] += 1
            return record_event(*args, **kwargs)

        platform.record_event = counted_event
        self._undo.append(lambda: platform.__dict__.pop("record_event", None))
        self._wrap_module(engine_module, "sample_on_device", "sample")
        self._wrap_module(engine_module, "logprob_tensors", "sample")
        # Triton's launches are no aten ops: the greedy kernels (loaded once a step ran them) are counted by
        # hand, two launches a call, in the phase that called them (the forward's, when a decode step runs
        # eagerly; none in a replay, whose ops are the graph's).
        argmax = sys.modules.get("devgraph.reference.kernels.triton_argmax")
        if argmax is not None:
            self._count_launches(argmax, "argmax_rows", 2, "triton_argmax")

        original_step = engine.step

        def counted_step(*args: Any, **kwargs: Any) -> Any:
            self._current = StepCount()
            try:
                return original_step(*args, **kwargs)
            finally:
                self.steps.append(self._current)
                self._current = None

        engine.step = counted_step
        self._undo.append(lambda: engine.__dict__.pop("step", None))

    def _count_launches(self, module: Any, attribute: str, launches: int, name: str) -> None:
        """``launches`` kernels named ``name`` counted per call of ``module.attribute``, in the caller's
        phase."""
        original = getattr(module, attribute)
        census = self

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            phase = census._phase[-1] if census._phase else "engine"
            if census._current is not None and phase != "replay":
                for _ in range(launches):
                    census._current.add(phase, name, "kernel")
            return original(*args, **kwargs)

        setattr(module, attribute, counted)
        self._undo.append(lambda: setattr(module, attribute, original))

    def __enter__(self) -> StepOps:
        self._install()
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        while self._undo:
            self._undo.pop()()


def _crosses(args: Any, kwargs: Any) -> bool:
    """Whether a copy op's tensors are on more than one device type (a host <-> device copy)."""
    types = {a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
    device = kwargs.get("device")
    if device is not None:
        types.add(torch.device(device).type)
    return len(types) > 1
