"""What to do about a failed capture, by cause.

One table, not the same three suggestions for every failure: a break op that returns a view is fixed in
the op, not by lowering sizes; an out-of-memory capture is fixed by capturing less, not by moving an op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from devgraph.errors import CaptureError, ConfigError, RecompileError
from devgraph.messages import ADVICE_ATTRIBUTE, CAUSE_ATTRIBUTE, HOST_SYNC_ADVICE
from devgraph.strategies.adaptive import StaticCompileError

__all__ = ["Cause", "diagnose"]


@dataclass(frozen=True)
class Cause:
    """A recognised failure: a short name (for tests and logs) and the advice that applies to it."""

    name: str
    advice: str


def _text(exc: BaseException) -> str:
    return str(exc).lower()


#: How allocators say they ran out: CUDA and ROCm ("out of memory", hipErrorOutOfMemory), the CPU allocator
#: ("can't allocate memory", errno 12 "Cannot allocate memory"), Ascend ("NPU out of memory").
_OOM_TEXTS = ("out of memory", "outofmemory", "can't allocate memory", "cannot allocate memory")


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = _text(exc)
    return any(needle in text for needle in _OOM_TEXTS)


def _is_aliasing_break(exc: BaseException) -> bool:
    text = _text(exc)
    return "may not alias any inputs" in text or "must not also be an input to this custom operator" in text


def _is_dynamo(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    return module.startswith("torch._dynamo") or "torch.compile cannot trace" in _text(exc)


def _is_host_sync(exc: BaseException) -> bool:
    if isinstance(exc, CaptureError) and exc.op is not None:
        return True
    text = _text(exc)
    return any(
        needle in text
        for needle in (
            "syncs with the host",
            "data-dependent output shape",
            "operation not permitted when stream is capturing",
            "streamcaptureunsupported",
            "stream is capturing",
        )
    )


def _is_break_op_fake(exc: BaseException) -> bool:
    return isinstance(exc, ConfigError) and "fake=" in str(exc)


def _is_lazy_handle(exc: BaseException) -> bool:
    text = _text(exc)
    return any(n in text for n in ("cublas_status_not_initialized", "cublascreate", "hipblascreate"))


# Advice per cause: text with {phase} and {max_size} filled in, or a function of (phase, max_size, backend).
_WARM_UP = (
    "a library created a handle or workspace inside the capture: warm the forward up on the capture "
    "stream first (warmup_iters >= 1, or the flag's warmup_iters), so it happens before capture"
)
_OOM = (
    "capture fewer or smaller sizes (max_size is {max_size}: pass a lower max_size or an explicit "
    "sizes list), leave more device memory free (a smaller KV cache), or disable graphs for this phase "
    "with --device-graph-mode '{phase}=disabled'"
)
_ALIASING = (
    "a @devgraph.graph_break op returned a view of one of its inputs; break ops must return new "
    "tensors (return out.clone() or build the result with a new tensor). Changing sizes or modes "
    "does not help"
)
_DYNAMO = (
    "torch.compile could not trace the forward as one graph: move the untraceable code into a "
    "@devgraph.graph_break op, or use a mode that does not compile (--device-graph-mode "
    "'{phase}=breakable', or drop the 'compiler' option)"
)
_BREAK_OP_FAKE = (
    "give the @devgraph.graph_break op named above a fake= shape function (it returns empty tensors of "
    "the result's shapes, or None for an op that only writes into its arguments); sizes and modes without "
    "a compiler do not need it"
)
_RECOMPILE = (
    "keep every input in the runner's static buffers (same dtype, device and rank each step) and keep "
    "Python values the forward branches on fixed; run with TORCH_LOGS=recompiles to see the guard"
)


def _host_sync(phase: str, max_size: int, backend: str) -> str:
    return f"{HOST_SYNC_ADVICE}; read per-step host values from the forward context" + (
        " (already under breakable: the op itself must be the break op)"
        if backend == "breakable"
        else f" and use --device-graph-mode '{phase}=breakable' so it runs eagerly between graph segments"
    )


def _generic(phase: str, max_size: int, backend: str) -> str:
    return (
        "run the forward eagerly on the same inputs to see whether it fails outside capture too; if only "
        f"capture fails, switch this phase to another mode ({_other_modes(phase, backend)}) or move the "
        "failing op into a @devgraph.graph_break op"
    )


def _other_modes(phase: str, backend: str) -> str:
    """Modes to try instead of ``backend`` (never the one that just failed)."""
    options = [m for m in ("breakable", "disabled") if m != backend]
    return " or ".join(f"--device-graph-mode '{phase}={m}'" for m in options)


Advice = str | Callable[[str, int, str], str]

_TABLE: tuple[tuple[str, Callable[[BaseException], bool], Advice], ...] = (
    ("out_of_memory", _is_oom, _OOM),
    ("no_warm_up", _is_lazy_handle, _WARM_UP),
    ("break_op_returns_view", _is_aliasing_break, _ALIASING),
    ("break_op_fake", _is_break_op_fake, _BREAK_OP_FAKE),
    ("recompile", lambda exc: isinstance(exc, RecompileError), _RECOMPILE),
    ("torch_compile", _is_dynamo, _DYNAMO),
    ("host_sync", _is_host_sync, _host_sync),
)


def diagnose(exc: BaseException, *, phase: str, max_size: int, backend: str = "") -> Cause:
    """The cause of a capture failure and the advice that applies to it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:  # look through wrapped errors too
        seen.add(id(current))
        if isinstance(current, StaticCompileError):  # no compile can run it: the advice follows the cause
            return Cause(current.cause, current.advice)
        named = getattr(current, CAUSE_ATTRIBUTE, None)  # the platform recognised it (an OOM in disguise)
        own = getattr(current, ADVICE_ATTRIBUTE, None)  # the sanitizer's findings carry their own advice
        if isinstance(named, str) and isinstance(own, str):
            return Cause(named, own)
        for name, matches, advice in _TABLE:
            if name == named or matches(current):
                if isinstance(advice, str):
                    return Cause(name, advice.format(phase=phase, max_size=max_size))
                return Cause(name, advice(phase, max_size, backend))
        current = current.__cause__ or current.__context__
    return Cause("unknown", _generic(phase, max_size, backend))
