"""Break ops: functions that always run eagerly, between graph segments.

``@devgraph.graph_break`` turns a function into a torch custom operator (so ``torch.compile`` keeps it
as one opaque node that ``tc_piecewise`` can split at) wrapped in a :class:`BreakOp`. While a
``breakable`` capture is in progress, calling the op hands control to the strategy, which ends the
current graph segment, runs the op eagerly and starts the next segment. Everywhere else the op simply
runs, so the same model code works in eager mode, under ``full`` capture and under ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, overload

import torch

from devgraph.errors import ConfigError

__all__ = [
    "BreakOp",
    "BreakHandler",
    "DefaultFake",
    "graph_break",
    "is_break_target",
    "break_handler",
    "running_compiled",
]


class BreakHandler(Protocol):
    """Called instead of a break op while a breakable capture is in progress."""

    def __call__(self, op: BreakOp, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


class _HandlerSlot(threading.local):
    handler: BreakHandler | None = None
    compiled: int = 0  # > 0 while code compiled by a devgraph strategy runs on this thread


_slot = _HandlerSlot()
_break_targets: set[Any] = set()
#: Op overload -> its BreakOp, so a replay plan can reach the Python function behind an FX call node.
_break_ops: dict[Any, BreakOp] = {}


class BreakOp:
    """A function registered as a break op. Call it like the function it wraps."""

    def __init__(self, fn: Callable[..., Any], op: Any) -> None:
        self.fn = fn
        self.name: str = op._qualname if hasattr(op, "_qualname") else str(op)
        self._op = op
        self.overload = op._opoverload
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", self.name)
        self.__wrapped__ = fn
        #: The fake devgraph derived from the declared result (``None`` once ``fake=`` is given).
        self.default_fake: DefaultFake | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # is_compiling() is constant-folded by dynamo, so tracing never reads the handler slot.
        if not torch.compiler.is_compiling():
            handler = _slot.handler
            if handler is not None:
                return handler(self, args, kwargs)
        return self._op(*args, **kwargs)

    def run_eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the op now, bypassing any installed handler. Break ops its body calls run inline, inside
        this one (a strategy sees one break: the outermost op)."""
        previous, _slot.handler = _slot.handler, None
        try:
            return self._op(*args, **kwargs)
        finally:
            _slot.handler = previous

    def replay_fn(self) -> Callable[..., Any]:
        """What a replay plan calls: the wrapped function itself, unless a device kernel overrides it.

        Going through torch's custom-op dispatcher costs tens of microseconds per call, paid at every
        break of every replayed step; at replay the op runs eagerly outside any mode, so the plain
        function computes the same thing. Capture still goes through :meth:`run_eager` (and torch's checks).
        """
        kernels = getattr(self._op, "_backend_fns", None)
        if kernels is not None and set(kernels) <= {None} and not getattr(self._op, "_disabled_kernel", None):
            return self.fn
        return self._op

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """Register the shape function ``torch.compile`` uses to trace through this op."""
        if self.default_fake is not None:
            self.default_fake.retired = True  # the user's fake decides shapes now: nothing to check
            self.default_fake = None
        return self._op.register_fake(fake)

    def __repr__(self) -> str:
        return f"BreakOp({self.name})"


def _auto_name(fn: Callable[..., Any]) -> str:
    module = re.sub(r"\W", "_", getattr(fn, "__module__", "user") or "user")
    qualname = re.sub(r"\W", "_", getattr(fn, "__qualname__", fn.__name__))
    return f"devgraph_user::{module}__{qualname}"


#: Result types a break op may not declare: a number computed at capture would be replayed as a constant.
_SCALAR_RESULTS = frozenset({"int", "float", "bool", "SymInt", "SymFloat", "SymBool", "Scalar", "str"})


def _results(fn: Callable[..., Any], mutates_args: tuple[str, ...], qualname: str) -> list[str]:
    """The declared result types of ``fn`` as torch reads its annotations (``[]``: returns ``None``)."""
    try:
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        returns = torch._C.parse_schema(f"devgraph_probe::op{schema}").returns
    except Exception as exc:  # torch explains which annotation it could not turn into a schema
        raise ConfigError(f"cannot register {qualname} as a graph_break op: {exc}") from exc
    types = [str(r.type) for r in returns]
    scalars = [t for t in types if t in _SCALAR_RESULTS]
    if scalars:
        raise ConfigError(
            f"graph_break op {qualname} declares a Python {scalars[0]} result: a graph replays the value the "
            "op returned at capture, so every later step would read that constant instead of the op's "
            "result. Return a tensor instead (torch.tensor(value, device=...)), or keep the value on the "
            "host and pass it in through devgraph.get_forward_context()"
        )
    return types


class DefaultFake:
    """The fake ``torch.compile`` traces with when ``fake=`` is not given, following the declared result:
    ``None`` for an op that returns nothing (it writes into its ``mutates_args``), and a tensor shaped like
    the op's first tensor argument for each declared tensor result. Once it has been used, every real run
    of the op checks that its results match that guess, so a wrong one is an error naming ``fake=``, never
    a compiled graph sized for the wrong shape."""

    def __init__(self, qualname: str, results: list[str]) -> None:
        self.qualname = qualname
        self.results = results
        self.used = False
        self.retired = False
        self.last_trace = 0  # the trace count (fake_trace_mark) when torch.compile last traced with it

    def _first_tensor(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                return value
        raise ConfigError(
            f"graph_break op {self.qualname} has no tensor argument to shape its result like: torch.compile "
            "needs fake=, a function of the arguments returning empty tensors of the result's shapes"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global _fake_traces
        self.used = True
        _fake_traces += 1
        self.last_trace = _fake_traces
        if not self.results:
            return None
        if any(t != "Tensor" for t in self.results):
            raise ConfigError(
                f"graph_break op {self.qualname} returns {' and '.join(self.results)}: torch.compile cannot "
                "guess those shapes. Pass fake=, a function of the arguments returning empty tensors of the "
                "result's shapes (torch.empty(..., device=x.device)), to @graph_break"
            )
        like = self._first_tensor(args, kwargs)
        fakes = [torch.empty_like(like) for _ in self.results]
        return fakes[0] if len(fakes) == 1 else tuple(fakes)

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """After a real run inside compiled code: the result must be what the fake said."""
        if not _slot.compiled or not self.used or self.retired or not self.results:
            return
        like = self._first_tensor(args, kwargs)
        got = list(result) if isinstance(result, (tuple, list)) else [result]
        for value in got:
            if not isinstance(value, torch.Tensor) or (value.shape, value.dtype) != (like.shape, like.dtype):
                what = (
                    f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else repr(value)
                )
                raise ConfigError(
                    f"graph_break op {self.qualname} returned {what}, but torch.compile traced it with the "
                    f"default fake (each result shaped like its first tensor argument: {tuple(like.shape)} "
                    f"{like.dtype}), so the compiled code around it is sized wrongly. Pass fake=, a function "
                    "of the arguments returning empty tensors of the result's shapes, to @graph_break"
                )


@overload
def graph_break(fn: Callable[..., Any], /) -> BreakOp: ...


@overload
def graph_break(
    name: str | None = None, /, *, mutates_args: Iterable[str] = (), fake: Callable[..., Any] | None = None
) -> Callable[[Callable[..., Any]], BreakOp]: ...


def graph_break(
    fn_or_name: Callable[..., Any] | str | None = None,
    /,
    *,
    mutates_args: Iterable[str] = (),
    fake: Callable[..., Any] | None = None,
) -> Any:
    """Mark a function as a break op.

    Use bare (``@graph_break``) or with options (``@graph_break("mylib::attn", mutates_args=("cache",))``).
    The function needs type annotations (torch derives the operator schema from them), must name every
    argument it writes in ``mutates_args``, and must return new tensors rather than views of its inputs.
    ``fake`` computes output shapes for ``torch.compile``; by default it follows the declared result:
    ``None`` for an op returning nothing (the copy-free form: it writes into an argument named in
    ``mutates_args``), and each declared tensor shaped like the first tensor argument (a run whose result
    differs raises, naming ``fake=``). A declared Python number (``-> int``) is refused: a graph would
    replay the value of the capture. Break ops may call other break ops: the inner ones run inside the
    outer one, under every strategy.

    A break op runs with the arguments it was captured with; per-batch state that is not in those
    tensors must come from :func:`devgraph.get_forward_context`.
    """

    def wrap(fn: Callable[..., Any], name: str | None) -> BreakOp:
        qualname = name or _auto_name(fn)
        if "::" not in qualname:
            raise ConfigError(f"graph_break name {qualname!r} must look like 'namespace::op_name'")
        mutated = tuple(mutates_args)
        results = _results(fn, mutated, qualname)
        default = None if fake is not None else DefaultFake(qualname, results)
        kernel = fn if default is None else _checked(fn, default)
        try:
            schema = torch.library.infer_schema(fn, mutates_args=mutated)
            op = torch.library.custom_op(qualname, kernel, mutates_args=mutated, schema=schema)
        except Exception as exc:  # a name registered twice, say
            raise ConfigError(f"cannot register {qualname} as a graph_break op: {exc}") from exc
        op.register_fake(fake if fake is not None else default)  # type: ignore[arg-type]
        break_op = BreakOp(fn, op)
        break_op.default_fake = default
        _break_targets.add(break_op.overload)
        _break_ops[break_op.overload] = break_op
        return break_op

    if callable(fn_or_name):
        return wrap(fn_or_name, None)
    return lambda fn: wrap(fn, fn_or_name)


def _checked(fn: Callable[..., Any], default: DefaultFake) -> Callable[..., Any]:
    """``fn`` as the op's kernel, checking its results against the default fake once that was traced."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        default.check(args, kwargs, result)
        return result

    return kernel


def break_op_for(target: Any) -> BreakOp | None:
    """The :class:`BreakOp` behind an FX node target (an op overload), or ``None``."""
    return _break_ops.get(target)


#: How many times torch.compile has traced a break op through its default fake, in this process.
_fake_traces = 0


def fake_trace_mark() -> int:
    """A mark to pass to :func:`traced_with_default_fake` for the default fakes traced after it."""
    return _fake_traces


def traced_with_default_fake(since: int = 0) -> list[str]:
    """The names of the break ops ``torch.compile`` has traced with their default fake (no ``fake=``
    given) after the mark ``since`` (:func:`fake_trace_mark`), for advice when a compile fails on shapes:
    an op another compile traced is no cause of this one's failure."""
    return sorted(
        op.default_fake.qualname
        for op in _break_ops.values()
        if op.default_fake is not None and op.default_fake.used and op.default_fake.last_trace > since
    )


def is_break_target(target: Any) -> bool:
    """Whether an FX node target is a registered break op (``tc_piecewise`` splits there)."""
    if target in _break_targets:
        return True
    packet = getattr(target, "_overloadpacket", None)
    return packet is not None and any(getattr(t, "_overloadpacket", None) is packet for t in _break_targets)


@contextlib.contextmanager
def running_compiled() -> Iterator[None]:
    """Marks code a strategy compiled as running on this thread: break ops traced with their default fake
    check their real results against it there (elsewhere the shapes they return are theirs to choose)."""
    _slot.compiled += 1
    try:
        yield
    finally:
        _slot.compiled -= 1


class break_handler:  # noqa: N801 - used like contextlib helpers
    """Context manager that routes break-op calls on this thread to ``handler``."""

    def __init__(self, handler: BreakHandler | None) -> None:
        self._handler = handler
        self._previous: BreakHandler | None = None

    def __enter__(self) -> None:
        self._previous = _slot.handler
        _slot.handler = self._handler

    def __exit__(self, *exc: object) -> None:
        _slot.handler = self._previous
