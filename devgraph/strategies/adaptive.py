"""One compile for every size, and compiles per size when dynamo cannot trace that one.

A dynamic compile (the leading dimension of the tensor arguments symbolic) serves every key with one
trace: it is what keeps a compiling strategy's warm-up short. Whether dynamo can trace a forward that way
depends on the model, the shapes and the torch release: a data-dependent guard ("Could not guard on
data-dependent expression Eq(64, u0)"), a forward that specialises on the batch size and runs into the
recompile limit, or a compiler that fails on a symbolic size. The same forward often compiles size by size
with static shapes, as ``torch.compile`` does by default. :class:`AdaptiveCompile` tries the dynamic
compile first and, when it fails, compiles each shape with static shapes on a code object of its own
(dynamo's recompile limit is per code object), bounded by :data:`MAX_STATIC_COMPILES`. It refuses only when
a static compile fails too, naming both causes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from devgraph.contract.breaks import fake_trace_mark, running_compiled, traced_with_default_fake
from devgraph.errors import CaptureError, DevGraphError, RecompileError
from devgraph.strategies.compile_time import StartupClock
from devgraph.strategies.precompile import Precompiled, aot_compile

__all__ = [
    "MAX_STATIC_COMPILES",
    "AdaptiveCompile",
    "compile_error_kind",
    "first_line",
    "trampoline",
]

logger = logging.getLogger(__name__)

#: At most this many shapes are compiled one by one after a dynamic compile failed.
MAX_STATIC_COMPILES = 64


def trampoline(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling ``forward`` on a code object of its own: dynamo's cache entries (and its recompile
    limit) live on the code object, so they go away with the owner of the trampoline."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    call.__code__ = call.__code__.replace()
    return call


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an error's message (dynamo's messages run to pages)."""
    for line in str(exc).strip().splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= 300 else f"{line[:297]}..."
    return type(exc).__name__


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not s for s in seen):
        seen.append(current)
        inner = getattr(current, "inner_exception", None)
        current = inner if isinstance(inner, BaseException) else (current.__cause__ or current.__context__)
    return seen


def compile_error_kind(exc: BaseException) -> str | None:
    """What kind of compile failure ``exc`` is, or ``None`` when it is not one (an error of the forward
    itself, raised while the compiled code ran, or devgraph's own :class:`RecompileError`).

    ``data_dependent``: a guard or a size on a value read from a tensor; ``recompile_limit``: the forward
    specialised on its shapes until dynamo's limit; ``graph_break``: code dynamo cannot trace;
    ``compiler``: the backend compiler (inductor) failed; ``trace``: any other tracing failure.
    """
    chain = _chain(exc)
    if any(isinstance(e, RecompileError) for e in chain):
        return None
    text = " ".join(str(e) for e in chain).lower()
    names = {type(e).__name__ for e in chain}
    modules = {type(e).__module__ or "" for e in chain}
    if not any(m.startswith(("torch._dynamo", "torch.fx", "torch._inductor")) for m in modules):
        return None
    if "data-dependent" in text or "GuardOnDataDependentSymNode" in names or "unbacked" in text:
        return "data_dependent"
    if "FailOnRecompileLimitHit" in names or "recompile_limit" in text or "cache_size_limit" in text:
        return "recompile_limit"
    if type(chain[-1]).__module__ == "builtins":
        return "trace"  # the forward raised while dynamo ran it on example tensors
    if "BackendCompilerFailed" in names:
        return "compiler"
    if "Unsupported" in names:
        return "graph_break"
    return "trace"


def _cause(kind: str, exc: BaseException) -> str:
    if kind == "recompile_limit":
        limit = torch._dynamo.config.recompile_limit
        return (
            f"dynamo compiled the forward again for each size until its recompile limit ({limit}): it "
            "specialises on the batch size"
        )
    return _message(exc)


def _message(exc: BaseException) -> str:
    """The first line of the innermost error when that is an ordinary Python one (what the forward raised
    under dynamo), else of ``exc``."""
    innermost = _chain(exc)[-1]
    return first_line(innermost if type(innermost).__module__ == "builtins" else exc)


def _unmarked(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and hasattr(value, "_dynamo_weak_dynamic_indices"):
        return value.detach()
    return value


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """What one static compile serves: the shapes, dtypes and devices of the tensor arguments, inside
    tuples, lists, dicts and dataclasses too (a paged-attention metadata object holds its tensors), and the
    other arguments' values (dynamo guards on all of them).

    Never a tensor's values: this runs inside a CUDA graph capture, where reading one (``repr`` of a
    dataclass holding tensors formats them with ``.item()``) is a host sync that fails the capture. An
    argument of any other unhashable type counts by its type. A container met again inside itself (a
    list holding itself, a dataclass pointing back at its owner) counts as a cycle, not walked again."""
    inside: set[int] = set()  # the containers on the way to the value being looked at

    def one(value: Any) -> Hashable:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.device.type)
        if isinstance(value, torch.nn.Module):  # a layer of a regional compile: its class, not which one
            return ("module", type(value).__qualname__)
        container = isinstance(value, (tuple, list, dict)) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        )
        if not container:
            return plain(value)
        if id(value) in inside:
            return ("cycle", type(value).__qualname__)
        inside.add(id(value))
        try:
            return walk(value)
        finally:
            inside.discard(id(value))

    def walk(value: Any) -> Hashable:
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(one(v) for v in value))
        if isinstance(value, dict):
            return (
                "dict",
                tuple(sorted(((repr(k), one(v)) for k, v in value.items()), key=lambda kv: kv[0])),
            )
        fields = tuple((f.name, one(getattr(value, f.name))) for f in dataclasses.fields(value))
        return (type(value).__qualname__, fields)

    def plain(value: Any) -> Hashable:
        try:
            hash(value)
            return value
        except TypeError:
            return ("object", type(value).__qualname__)

    return tuple(one(a) for a in args), tuple(sorted((k, one(v)) for k, v in kwargs.items()))


class AdaptiveCompile:
    """``fn`` compiled through ``backend``: dynamic first, then per shape (see the module's docstring).

    ``dynamic_args``: how many leading positional arguments get a dynamic first dimension (``None``: every
    tensor argument, keyword arguments included). ``what`` names the compiled thing in messages.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        backend: Callable[..., Any],
        what: str,
        *,
        dynamic_args: int | None = None,
    ) -> None:
        self.fn = fn
        self.backend = backend
        self.what = what
        self.dynamic_args = dynamic_args
        self._dynamic = torch.compile(trampoline(fn), backend=backend, dynamic=None, fullgraph=True)
        self._static: dict[Hashable, Callable[..., Any]] = {}
        self._served: set[Hashable] = set()
        #: Why the dynamic compile was given up (``None``: it serves every shape).
        self.fallback_cause: str | None = None
        self.fallback_kind: str | None = None
        #: Seconds spent on the static compiles (their first calls) and on the failed dynamic attempt.
        self.fallback_seconds = 0.0
        #: The dynamic compile as a saved, dynamo-free function (loaded from the artifact cache, or compiled
        #: ahead of time by this process when ``want_precompile`` is set; see :mod:`.precompile`).
        self.precompiled: Precompiled | None = None
        self.want_precompile = False
        #: Why this process's compile was not saved as a precompiled function (``None``: it was, or unasked).
        self.precompile_skipped: str | None = None
        #: Wall seconds of the first call that compiled (trace + compile), and where the time went.
        self.startup = StartupClock()

    @property
    def per_shape(self) -> bool:
        return self.fallback_cause is not None

    @property
    def static_compiles(self) -> int:
        return len(self._static)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        signature = _signature(args, kwargs)
        precompiled = self.precompiled
        if self.fallback_cause is None and precompiled is not None and precompiled.accepts(args, kwargs):
            with running_compiled():
                return precompiled(*args, **kwargs)
        if self.fallback_cause is None and self.want_precompile and self.precompiled is None:
            result = self._precompile(args, kwargs)
            if self.precompiled is not None:
                return result
        if self.fallback_cause is None or signature in self._served:
            start = time.perf_counter()
            try:
                with self.startup.timing():
                    result = self._run(self._dynamic, args, kwargs, dynamic=True)
            except Exception as exc:
                kind = compile_error_kind(exc)
                if kind is None:
                    raise
                self.fallback_kind = kind
                self.fallback_cause = _cause(kind, exc)
                self.fallback_seconds += time.perf_counter() - start
                logger.warning(
                    "devgraph: %s: one compile across sizes failed (%s: %s); compiling each size with static "
                    "shapes instead (at most %d)",
                    self.what,
                    kind,
                    self.fallback_cause,
                    MAX_STATIC_COMPILES,
                )
            else:
                # Shapes the dynamic compile served before it failed on another keep using it (graphs
                # captured from it already run that code).
                self._served.add(signature)
                return result
        return self._call_static(signature, args, kwargs)

    def _precompile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Compile the dynamic forward ahead of time (once); on failure the traced path takes over."""
        self.want_precompile = False
        try:
            marked_args, marked_kwargs = self._marked(args, kwargs, dynamic=True)
            with self.startup.timing(), self._patches(dynamic=True):
                self.precompiled = aot_compile(self._dynamic, marked_args, marked_kwargs)
        except RecompileError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch's ahead-of-time path is experimental: fall back
            self.precompile_skipped = f"ahead-of-time compile failed ({first_line(exc)})"
            logger.warning(
                "devgraph: %s: %s; compiling the usual way (a warm start will trace again)",
                self.what,
                self.precompile_skipped,
            )
            self.startup = StartupClock()
            return None
        with running_compiled():
            return self.precompiled(*args, **kwargs)

    def _call_static(self, signature: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        compiled = self._static.get(signature)
        if compiled is not None:
            return self._run(compiled, args, kwargs, dynamic=False)
        if len(self._static) >= MAX_STATIC_COMPILES:
            raise CaptureError(
                f"{self.what}: compiling each size with static shapes stopped at {MAX_STATIC_COMPILES} "
                f"shapes (the dynamic compile failed: {self.fallback_cause}); capture fewer sizes"
            )
        compiled = torch.compile(trampoline(self.fn), backend=self.backend, dynamic=False, fullgraph=True)
        start = time.perf_counter()
        mark = fake_trace_mark()  # the break ops this compile traces with a default fake, not earlier ones
        try:
            result = self._run(compiled, args, kwargs, dynamic=False)
        except Exception as exc:
            kind = compile_error_kind(exc)
            if kind is None:
                raise
            raise StaticCompileError(
                self.what, self.fallback_kind, self.fallback_cause, kind, exc, since=mark
            ) from exc
        self.fallback_seconds += time.perf_counter() - start
        self._static[signature] = compiled
        return result

    def _run(
        self, compiled: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, dynamic: bool
    ) -> Any:
        args, kwargs = self._marked(args, kwargs, dynamic=dynamic)
        with self._patches(dynamic=dynamic):
            return compiled(*args, **kwargs)

    def _marked(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, dynamic: bool
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if dynamic:
            # Only the rows of the step's inputs vary between keys: the leading dimension of the tensor
            # arguments is dynamic from the first trace, and nothing else is (a size-1 weight or mask in
            # the model must keep broadcasting as a constant 1).
            marked = args if self.dynamic_args is None else args[: self.dynamic_args]
            extra = kwargs.values() if self.dynamic_args is None else ()
            for value in (*marked, *extra):
                if isinstance(value, torch.Tensor) and value.dim():
                    torch._dynamo.maybe_mark_dynamic(value, 0)
        else:
            # Aliases without the marks a dynamic attempt may have left on these very tensors (the retry of
            # a failed call), which would make this compile dynamic again; they share the storage.
            args = tuple(_unmarked(a) for a in args)
            kwargs = {k: _unmarked(v) for k, v in kwargs.items()}
        return args, kwargs

    @staticmethod
    def _patches(*, dynamic: bool) -> contextlib.ExitStack:
        import torch.fx.experimental._config as fx_config

        stack = contextlib.ExitStack()
        # backed_size_oblivious: a size of 1 gets no specialised second compile; no duck shaping: a size
        # equal to a weight's width gets no guard of its own. Python floats of the model (an RMSNorm eps)
        # stay constants: as graph inputs they would reach ops that take a float through a host read.
        stack.enter_context(fx_config.patch(backed_size_oblivious=dynamic, use_duck_shape=False))  # type: ignore[attr-defined]
        stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
        stack.enter_context(running_compiled())
        return stack

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"startup": self.startup.describe()}
        if self.precompiled is not None:
            out["precompiled"] = {"calls": self.precompiled.calls, "rejected": self.precompiled.rejected}
        elif self.precompile_skipped:
            out["precompile_skipped"] = self.precompile_skipped
        if self.fallback_cause is None:
            return {"compile": "dynamic", **out}
        return {
            **out,
            "compile": "per_shape",
            "fallback_kind": self.fallback_kind,
            "fallback_cause": self.fallback_cause,
            "static_compiles": self.static_compiles,
            "fallback_seconds": round(self.fallback_seconds, 3),
        }

    def note(self) -> str | None:
        """One line for a capture report, when the dynamic compile was given up."""
        if self.fallback_cause is None:
            return None
        return (
            f"{self.what}: one compile across sizes failed ({self.fallback_kind}: {self.fallback_cause}); "
            f"compiled {self.static_compiles} sizes with static shapes instead, "
            f"{self.fallback_seconds:.1f} s of compiling"
        )


_ADVICE = {
    "data_dependent": (
        "the forward decides a shape or a branch from a value read out of a tensor: compute it on the host "
        "and pass it in (or read it from devgraph.get_forward_context()), move that code into a "
        "@devgraph.graph_break op, or use a mode without a compiler ('full' or 'breakable')"
    ),
    "graph_break": (
        "move the untraceable code into a @devgraph.graph_break op, or use a mode without a compiler "
        "('full' without 'compiler', or 'breakable')"
    ),
    "compiler": (
        "the compiler failed on code dynamo traced: try the 'eager' compiler (dynamo without code "
        "generation) to confirm, or drop the 'compiler' option"
    ),
    "recompile_limit": (
        "the forward recompiles for every call with the same shapes: keep the Python values it branches "
        "on fixed (TORCH_LOGS=recompiles shows the guard), or drop the 'compiler' option"
    ),
    "trace": (
        "dynamo could not run the forward on example tensors of this size: run the forward eagerly on "
        "these shapes to see whether it fails there too (then the forward itself is wrong), else move the "
        "offending code into a @devgraph.graph_break op or drop the 'compiler' option"
    ),
}


#: Compile failures a wrongly shaped break-op fake can cause (the code after the op traced on its guess).
_SHAPE_KINDS = frozenset({"trace", "compiler", "data_dependent"})


def _default_fake_advice(ops: list[str]) -> str:
    names = ", ".join(ops)
    return (
        f"the break op{'s' if len(ops) > 1 else ''} {names} {'were' if len(ops) > 1 else 'was'} traced with "
        "the default fake, which shapes each result like the op's first tensor argument; if a result is "
        "shaped otherwise, give the op fake=, a function of its arguments returning empty tensors of the "
        f'result\'s shapes: for an [n, 3] result of an [n, k] input, @devgraph.graph_break("{ops[0]}", '
        "fake=lambda x: x.new_empty(x.shape[0], 3))"
    )


class StaticCompileError(CaptureError):
    """Both the dynamic compile and a static compile of one size failed."""

    def __init__(
        self,
        what: str,
        dynamic_kind: str | None,
        dynamic_cause: str | None,
        kind: str,
        exc: BaseException,
        *,
        since: int = 0,
    ) -> None:
        self.kind = kind
        # An error of devgraph's own raised while tracing (a break op's fake, say) already says what to do.
        own = [e for e in _chain(exc) if isinstance(e, DevGraphError) and not isinstance(e, CaptureError)]
        self.advice = str(own[-1]) if own else _ADVICE[kind]
        guessed = traced_with_default_fake(since) if not own and kind in _SHAPE_KINDS else []
        if guessed:
            # A result shaped otherwise than the default fake's guess fails the trace of the code after the
            # op, far from the op: name it, and the fix.
            self.advice = f"{_default_fake_advice(guessed)}; otherwise: {self.advice}"
        #: The capture advice's name for the cause (a break op's fake is fixed in the op, not the compile).
        self.cause = "break_op_fake" if guessed or (own and "fake=" in self.advice) else "torch_compile"
        static = _message(exc)
        again = "the same error" if static == dynamic_cause else f"{kind}: {static}"
        super().__init__(
            f"torch.compile cannot compile the forward of {what}: one compile across sizes failed "
            f"({dynamic_kind}: {dynamic_cause}) and so did a compile of this size with static shapes "
            f"({again}); {self.advice}"
        )
