"""Where a compiling strategy's start-up seconds go: dynamo's trace, AOT autograd, inductor, the kernel
compiles, and loading saved artifacts.

torch times its own compile phases (``torch._dynamo.utils.compilation_time_metrics``, seconds per phase
name, kept for the process); :class:`StartupClock` reads the phases below before and after each call that
compiled, so the breakdown is this runner's alone. The phase names are torch's and may change between
releases: a phase torch no longer times reads 0, the wall seconds stay right.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["PHASES", "StartupClock"]

#: devgraph's name for a phase -> torch's timer names (summed: names of one phase never nest).
PHASES: dict[str, tuple[str, ...]] = {
    # The whole of a dynamo compile (a traced call or an ahead-of-time one).
    "compile_total_s": ("_compile.compile_inner", "fullgraph_capture"),
    # dynamo turning bytecode into an FX graph, and building the guards.
    "dynamo_trace_s": ("bytecode_tracing",),
    "guards_s": ("build_guards",),
    # The backend: AOT autograd (functionalisation, partitioning) with inductor inside it.
    "backend_s": ("create_aot_dispatcher_function",),
    "inductor_s": ("compile_fx_inner",),
    "inductor_codegen_s": ("GraphLowering.codegen",),
    # Compiling the generated kernels (Triton on a GPU, C++ on the CPU) and waiting for the workers.
    "kernel_compile_s": ("async_compile.wait",),
    "autotune_s": ("autotune_select_algorithm",),
}


def _metrics() -> dict[str, list[float]]:
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except Exception:  # noqa: BLE001 - an older torch without the timers: wall seconds only
        return {}
    return compilation_time_metrics


def _read() -> dict[str, float]:
    metrics = _metrics()
    out: dict[str, float] = {}
    for phase, names in PHASES.items():
        out[phase] = float(sum(sum(metrics.get(name, ())) for name in names))
    return out


class StartupClock:
    """Seconds of the calls that compiled, split by phase (see :data:`PHASES`)."""

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.compiling_calls = 0
        self.phases = dict.fromkeys(PHASES, 0.0)
        #: Seconds spent reading a saved compile (the artifact cache) before the first call.
        self.load_s = 0.0
        self.loaded_from: str | None = None

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        before = _read()
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            after = _read()
            grew = {phase: after[phase] - before[phase] for phase in PHASES}
            if grew["compile_total_s"] > 0:  # this call compiled (a call of compiled code adds nothing)
                self.compiling_calls += 1
                self.wall_s += elapsed
                for phase, seconds in grew.items():
                    self.phases[phase] += seconds

    def loaded(self, what: str, seconds: float) -> None:
        self.loaded_from = what
        self.load_s += seconds

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "compile_wall_s": round(self.wall_s, 3),
            "compiling_calls": self.compiling_calls,
            "load_s": round(self.load_s, 3),
            "loaded_from": self.loaded_from,
        }
        out.update({phase: round(seconds, 3) for phase, seconds in self.phases.items()})
        return out
