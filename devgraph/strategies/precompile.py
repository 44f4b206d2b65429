"""Warm starts without re-tracing: the dynamic compile of ``full`` saved as a whole, dynamo's part included.

torch's cache-artifact API (what :mod:`devgraph.strategies.artifacts` saved first) skips inductor's code
generation, but dynamo still traces the forward in every process (3.4 s of a 9.3 s warm start on the
reference model). torch's ahead-of-time compile of a ``torch.compile`` wrapper (``fn.aot_compile(...)``,
``torch._dynamo.aot_compile``) returns the traced and compiled function together with its guards, and
serialises all of it: a later process rebuilds the function from bytes and calls it without running dynamo
at all. It is chosen over the alternatives because

* ``torch.export`` + AOTInductor compiles a second way (its own tracer and a C++ wrapper, not the code
  devgraph captures cold) so warm outputs could differ from cold ones bit for bit;
* the cache-artifact API (mega-cache) is what devgraph had: it still traces.

It is used only where it is sound: the forward is a bound method of an ``nn.Module`` (the module is handed
to torch as *external data*, so weights are never written into the file and a restarted process runs its
own), and torch's serialiser takes external data (``AOTCompiledFunction.serialize(fn, external_data)``,
as torch 2.13's does; the earlier form pickles the module itself, weights included, and is not used).
Anything else, or an ahead-of-time compile that fails, falls back to the traced path with the
cache-artifact file, as before.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Precompiled", "precompile_support", "serialize", "deserialize"]

logger = logging.getLogger(__name__)

_MODEL = "devgraph_model"


def precompile_support(forward: Callable[..., Any]) -> str | None:
    """``None`` when ``forward`` can be precompiled with this torch, else why not (for ``inspect()``)."""
    if not isinstance(getattr(forward, "__self__", None), torch.nn.Module):
        return "the forward is not a method of an nn.Module"
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction
    except Exception:  # noqa: BLE001 - any import failure means the feature is absent
        return f"torch {torch.__version__} has no torch._dynamo.aot_compile"
    try:
        saves = inspect.signature(AOTCompiledFunction.serialize).parameters
        loads = inspect.signature(AOTCompiledFunction.deserialize).parameters
    except (TypeError, ValueError):
        return "torch's AOTCompiledFunction has no inspectable serialize/deserialize"
    if "external_data" not in saves or "external_closure_data" not in loads:
        return f"torch {torch.__version__} cannot keep the model out of a precompiled file (no external_data)"
    if not getattr(torch._dynamo.config, "enable_aot_compile", True):
        return "torch._dynamo.config.enable_aot_compile is off"
    if not hasattr(torch.compile(_identity, fullgraph=True), "aot_compile"):
        # torch 2.11 has the module, enable_aot_compile off by default, and torch.compile wrappers without
        # aot_compile (an H100 run): turning the flag on there must not break a start.
        return f"torch {torch.__version__}'s torch.compile wrappers have no aot_compile"
    return None


def _identity(x: Any) -> Any:
    return x


class Precompiled:
    """A loaded or freshly compiled ahead-of-time function: called only for inputs its guards accept."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        # accepts() checks the guards before every call; torch's own check in __call__ would run them twice.
        disable = getattr(fn, "disable_guard_check", None)
        if callable(disable):
            disable()
        self.calls = 0
        self.rejected = 0

    def accepts(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        try:
            ok = bool(self.fn.guard_check(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - a guard that cannot even run rejects the inputs
            logger.debug("precompiled guard check raised: %s", exc)
            ok = False
        if not ok:
            self.rejected += 1
        return ok

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


def aot_compile(compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Precompiled:
    """Trace and compile ``compiled`` (a ``torch.compile`` wrapper, ``fullgraph=True``) ahead of time on
    these example inputs (their dynamic marks decide the symbolic sizes)."""
    return Precompiled(compiled.aot_compile((args, kwargs)))


def serialize(precompiled: Precompiled, forward: Callable[..., Any]) -> bytes:
    """The bytes of ``precompiled``, the module of ``forward`` left out (it is passed again at load)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    result = AOTCompiledFunction.serialize(precompiled.fn, {_MODEL: forward.__self__})  # type: ignore[attr-defined]
    data = getattr(result, "serialized_data", result)
    if not isinstance(data, bytes):
        raise TypeError(f"torch's AOTCompiledFunction.serialize returned {type(data).__name__}, not bytes")
    return data


def deserialize(data: bytes, forward: Callable[..., Any]) -> Precompiled:
    """The function saved by :func:`serialize`, bound to this process's module (its weights)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    model = forward.__self__  # type: ignore[attr-defined]
    return Precompiled(AOTCompiledFunction.deserialize(data, None, {_MODEL: model}))
