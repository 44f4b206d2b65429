"""State a forward changes without declaring it, found before the first key's warm-ups.

``capture()`` and ``verify()`` run the forward several times; state it advances (a write position kept in
a 0-d device tensor, as Hugging Face's static cache does since transformers 5) moves with every run unless
it is declared (``state=``), and the user learns it from diverging tokens. Before the first key's warm-ups
:class:`StateProbe` rides on the first key's first two warm-ups (one more run where ``warmup_iters`` is 1;
none with 0): the same inputs, declared state put back in between, the first under a dispatch mode that
sees every in-place write (exact on the CPU simulator and on a device alike: warm-ups run eagerly; that
first one runs the plain forward, a compiled one compiles at the second). A tensor written by the forward
that is neither a static input, declared state nor allocated inside the step, and that holds other values
after the second run than after the first, is state the forward advances: the probe names it (shape,
dtype, and an attribute path where one reaches it) and with ``state="auto"`` adopts it, so capture and
verify restore it.

Only storages up to :data:`PROBED_BYTES` are compared: a KV cache is written at positions the inputs give
(the same values on both runs) and may be gigabytes; the counters that move are small.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from devgraph.runner.state import DeclaredState

__all__ = ["PROBED_BYTES", "Advancing", "StateProbe"]

logger = logging.getLogger(__name__)

#: Storages larger than this are not compared (a KV cache); the state that advances is small.
PROBED_BYTES = 1 << 20
#: At most this many bytes are saved in all (a forward writing thousands of small buffers).
PROBED_TOTAL_BYTES = 64 << 20


def _ptr(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return 0


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``tensor`` as a flat uint8 tensor (a view: writing it writes the storage)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes into, as its schema declares them (``add_``'s self, ``out=``, ...)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out: list[torch.Tensor] = []
    for index, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        out.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


class _WriteRecorder(TorchDispatchMode):
    """Records storages written in place that existed before the step, saving each one's bytes first."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = known
        self.allocated: set[int] = set()
        self.before: dict[int, torch.Tensor] = {}  # storage -> its bytes before the first write
        self.example: dict[int, torch.Tensor] = {}  # storage -> a tensor written into it
        self.saved = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Code the forward compiles itself (a fast path's regions: pure functions) runs as compiled under
        # this mode, instead of dynamo refusing to start a frame ("non-infra torch dispatch mode present").
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for tensor in _written(func, args, kwargs):
            ptr = _ptr(tensor)
            if not ptr or ptr in self.known or ptr in self.allocated or ptr in self.example:
                continue
            self.example[ptr] = tensor
            nbytes = tensor.untyped_storage().nbytes()
            if nbytes <= PROBED_BYTES and self.saved + nbytes <= PROBED_TOTAL_BYTES:
                self.before[ptr] = _bytes_of(tensor).clone()
                self.saved += nbytes
        out = func(*args, **kwargs)
        inputs = {_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                ptr = _ptr(tensor)
                if ptr and ptr not in inputs and ptr not in self.example:
                    self.allocated.add(ptr)  # made by the step: its own memory, not state
        return out


@dataclass(frozen=True)
class Advancing:
    """A tensor the forward advances without declaring it."""

    tensor: torch.Tensor
    name: str | None

    def describe(self) -> str:
        t = self.tensor
        shape = f"a 0-d {t.dtype}" if t.dim() == 0 else f"a {tuple(t.shape)} {t.dtype}"
        where = f" ({self.name})" if self.name else ""
        return f"{shape} tensor on {t.device}{where}"


def _roots(forward: Callable[..., Any]) -> list[tuple[str, Any]]:
    """Where the forward's state can be reached from: its module or bound object, its closure."""
    roots: list[tuple[str, Any]] = []
    owner = getattr(forward, "__self__", None)
    if owner is not None:
        roots.append(("self", owner))
    if isinstance(forward, torch.nn.Module):
        roots.append(("model", forward))
    code = getattr(forward, "__code__", None)
    cells = getattr(forward, "__closure__", None) or ()
    for name, cell in zip(getattr(code, "co_freevars", ()), cells, strict=False):
        try:
            roots.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    found = getattr(forward, "__globals__", {})
    roots.extend((name, found[name]) for name in getattr(code, "co_names", ()) if name in found)
    return roots


def _children(value: Any) -> Iterable[tuple[str, Any]]:
    if isinstance(value, dict):
        return ((f"[{k!r}]", v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ((f"[{i}]", v) for i, v in enumerate(value))
    attributes = getattr(value, "__dict__", None)
    if isinstance(value, torch.nn.Module):
        named = [*value._parameters.items(), *value._buffers.items(), *value._modules.items()]
        return ((f".{k}", v) for k, v in [*named, *(attributes or {}).items()] if not k.startswith("_"))
    if isinstance(attributes, dict) and not isinstance(value, type):
        return ((f".{k}", v) for k, v in attributes.items())
    return ()


def find_names(forward: Callable[..., Any], ptrs: set[int], budget: int = 20000) -> dict[int, str]:
    """An attribute path to a tensor on each storage in ``ptrs``, searched from the forward's roots."""
    names: dict[int, str] = {}
    queue = _roots(forward)
    seen: set[int] = set()
    while queue and budget > 0 and len(names) < len(ptrs):
        path, value = queue.pop(0)
        budget -= 1
        if id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool)):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            ptr = _ptr(value)
            if ptr in ptrs and ptr not in names:
                names[ptr] = path
            continue
        queue.extend((path + suffix, child) for suffix, child in _children(value))
    return names


class StateProbe:
    """Finds undeclared state once per runner (see the module's docstring)."""

    def __init__(self, forward: Callable[..., Any], state: DeclaredState, phase: str) -> None:
        self.forward = forward
        self.state = state
        self.phase = phase
        self.done = False
        self.found: list[Advancing] = []
        # Adopted under state="auto" after the runner saved its state for this capture: put back by
        # restore_adopted() when the capture ends (later captures and verify() save them with the rest).
        self._adopted: list[tuple[torch.Tensor, torch.Tensor]] = []

    def wanted(self, warmup_iters: int) -> bool:
        """Whether the next key's warm-ups should carry the probe (once; not with ``warmup_iters=0``, nor
        when save/restore hooks hold state the probe cannot see)."""
        return not self.done and warmup_iters > 0 and not self.state.hooks

    def first_run(
        self,
        inputs: Mapping[str, Any],
        static: Iterable[torch.Tensor],
        observed: Callable[[Mapping[str, Any]], bool] | None = None,
    ) -> bool:
        """The first warm-up: the plain forward (dynamo compiles nothing under a dispatch mode) under the
        write recorder. ``False``: the forward compiles code of its own that this torch will not run under
        a dispatch mode (nothing is probed; the warm-ups go on as usual). ``observed`` may run the plain
        forward itself (the address guard, under a mode of its own) and says whether it did."""
        self.done = True
        self._known = {_ptr(t) for t in (*static, *self.state.tensors.values())}
        self._declared = self.state.save()
        self._recorder = _WriteRecorder(self._known)
        try:
            with self._recorder:
                if observed is None or not observed(inputs):
                    self.forward(**inputs)
        except Exception as exc:
            if "dispatch mode" not in str(exc) and "no compiled frames" not in str(exc):
                raise
            logger.info("devgraph: state not probed: the forward's own compiled code refuses a dispatch mode")
            self.state.restore(self._declared)
            return False
        examples = self._recorder.example
        self._after_first = {ptr: _bytes_of(examples[ptr]).clone() for ptr in self._recorder.before}
        self.state.restore(self._declared)  # the second run starts where the first did, but for what moved
        return True

    def second_run(self, run: Callable[[], Any], extra: bool) -> list[str]:
        """The second warm-up on the same inputs; returns the report's notes. ``extra``: the runner asked for
        one warm-up only, so this run's writes are undone (state moves as many runs as it asked for)."""
        recorder = self._recorder
        run()
        examples = recorder.example
        after = self._after_first
        moved = [ptr for ptr, first in after.items() if not torch.equal(first, _bytes_of(examples[ptr]))]
        if extra:
            with torch.no_grad():
                for ptr, first in after.items():
                    _bytes_of(examples[ptr]).copy_(first)
        self._after_first = {}
        del self._recorder  # its saved bytes go; adopted tensors keep theirs below
        if not moved:
            return []
        moved.sort(key=lambda ptr: examples[ptr].untyped_storage().nbytes())
        names = find_names(self.forward, set(moved))
        found = [Advancing(examples[ptr], names.get(ptr)) for ptr in moved]
        self.found = found
        if self.state.auto:
            for index, (item, ptr) in enumerate(zip(found, moved, strict=True)):
                self.state.adopt(item.name or f"undeclared_{index}", _whole(item.tensor))
                self._adopted.append((_bytes_of(item.tensor), recorder.before[ptr]))
        return [self._report(found)]

    def restore_adopted(self) -> None:
        """Put the tensors adopted during this capture back as the probe found them."""
        with torch.no_grad():
            for storage, before in self._adopted:
                storage.copy_(before)
        self._adopted = []

    def _report(self, found: list[Advancing]) -> str:
        listed = "; ".join(a.describe() for a in found[:3])
        if found[3:]:
            listed += f"; and {len(found) - 3} more"
        if self.state.auto:
            message = (
                f"the {self.phase} forward advances state it does not declare: {listed}. state='auto' saves "
                "and restores it around capture() and verify()"
            )
            logger.info("devgraph: %s", message)
            return message
        message = (
            f"the {self.phase} forward advances state it does not declare: {listed} held other values after "
            "a second run on the same inputs. capture() and verify() run the forward several times, so "
            "they move it; declare it (state=[tensor, ...]) or pass state='auto', and the runner puts it "
            "back after them"
        )
        logger.warning("devgraph: %s", message)
        return message


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the whole storage of ``tensor`` with its dtype (what saving and restoring needs)."""
    storage = tensor.untyped_storage()
    count = storage.nbytes() // tensor.element_size()
    if tensor.dim() == 0 and count == 1:
        return tensor
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, 0, (count,), (1,))
