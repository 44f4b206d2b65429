"""Capturing a runner's keys: largest first, one pool, one stream, warm-ups on that stream, a report.

:func:`capture_keys` is the loop :meth:`GraphRunner.capture` (all keys at start-up) and the lazily
capturing encoder cache (one key on first sight) share. A failure is raised as one
:class:`~devgraph.errors.CaptureError` naming the key and the advice for its cause; the caller releases
what was captured.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.context import forward_context
from devgraph.contract.keys import GraphKey
from devgraph.contract.platform import GraphPlatform
from devgraph.errors import CaptureError
from devgraph.runner.capture.advice import diagnose
from devgraph.runner.capture.undeclared import StateProbe

__all__ = [
    "CaptureJob",
    "CaptureReport",
    "KeyReport",
    "Progress",
    "capture_keys",
    "frozen_gc",
    "show_progress",
]

logger = logging.getLogger(__name__)

#: How capture shows its progress: a bar (a terminal), a log line per key (a log file), or nothing.
Progress = Literal["bar", "log", "off"]


@dataclass(frozen=True)
class KeyReport:
    """One captured key: seconds the capture itself took (warm-ups not included), and the bytes the device
    allocator grew by."""

    key: GraphKey
    seconds: float
    bytes: int

    @property
    def size(self) -> int:
        """The key's token count (the "size" of a phase with a single axis)."""
        return self.key.tokens


@dataclass
class CaptureReport:
    """What ``capture()`` did: per key, seconds spent and device bytes the graph pool grew by."""

    phase: str
    backend: str
    platform: str
    keys: list[KeyReport] = field(default_factory=list)
    seconds: float = 0.0
    #: What the capture did differently from the plan, and why (a compile per size, undeclared state).
    notes: list[str] = field(default_factory=list)
    #: The fallback graph set's keys (a runner with a ``fallback`` mode), and the primary's keys whose
    #: capture failed (the fallback's graphs replay them), with the error.
    fallback: list[KeyReport] = field(default_factory=list)
    failed: dict[GraphKey, str] = field(default_factory=dict)

    @property
    def sizes(self) -> list[KeyReport]:
        """The per-key reports, smallest first (the name older callers use)."""
        return self.keys

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.keys) + sum(k.bytes for k in self.fallback)

    def table(self) -> str:
        lines = [
            f"{self.phase}: {self.backend} on {self.platform}, {len(self.keys)} graphs in "
            f"{self.seconds:.2f}s, {self.bytes / 2**20:.1f} MiB"
        ]
        lines += [
            f"  {str(k.key):<28} {k.seconds * 1e3:9.1f} ms  {k.bytes / 2**20:9.2f} MiB" for k in self.keys
        ]
        lines += [f"  note: {note}" for note in self.notes]
        lines += [
            f"  fallback {str(k.key):<19} {k.seconds * 1e3:9.1f} ms  {k.bytes / 2**20:9.2f} MiB"
            for k in self.fallback
        ]
        lines += [
            f"  {str(key):<28} failed, the fallback replays it: {why}" for key, why in self.failed.items()
        ]
        return "\n".join(lines)


@dataclass
class CaptureJob:
    """Everything the capture loop needs from a runner."""

    phase: str
    backend: DeviceGraphBackend
    platform: GraphPlatform
    forward: Callable[..., Any]
    inputs_for: Callable[[GraphKey], Mapping[str, torch.Tensor]]
    warmup_iters: int
    max_size: int
    capture_context: Callable[[GraphKey], Any] | None = None
    barrier: Callable[[], None] = lambda: None
    # Before each key's warm-ups, on every rank: the ranks check in, so a lost rank is found before any
    # warm-up issues a collective it would never join (devgraph.ranks).
    ready: Callable[[GraphKey], None] = lambda key: None
    on_captured: Callable[[GraphKey, Any], None] = lambda key, outputs: None
    # Runs inside the capture session after the last key (the runner learns its output layout here).
    finish: Callable[[GraphKey], None] = lambda key: None
    hook: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    # After each key, on every rank: raises if any rank failed that key (ranks fail together, never hang).
    agree: Callable[[GraphKey, BaseException | None], None] = lambda key, error: None
    progress: Progress = "off"
    shared_pool: bool = True
    # Finds state the forward advances without declaring it, on the first key's first two warm-ups.
    probe: StateProbe | None = None
    static: Callable[[], Iterable[torch.Tensor]] = lambda: ()
    # Notes for the capture report (what the probe found).
    notes: list[str] = field(default_factory=list)
    # May run a key's first warm-up itself, as the plain forward (the address guard observes it); True
    # when it did. With warmup_iters=1 that run comes before the warm-up, so a compiled forward still runs
    # (and compiles) once before its capture; with 0, nothing is observed.
    observe: Callable[[GraphKey, Mapping[str, Any]], bool] | None = None


@contextlib.contextmanager
def frozen_gc(collect: bool = True) -> Iterator[None]:
    """Objects alive now are never collected mid-capture, which keeps capture fast."""
    if collect:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _progress(keys: Sequence[GraphKey], job: CaptureJob) -> Iterable[GraphKey]:
    if job.progress != "bar" or len(keys) < 2:
        return keys
    from tqdm import tqdm

    return tqdm(keys, desc=f"capturing {job.phase} ({job.backend.name})", unit="graph", leave=False)


def show_progress(requested: bool | None, rank: int) -> Progress:
    """A bar on rank 0 when stderr is a terminal (or ``requested=True``); else, on rank 0, one INFO log
    line per captured key (``devgraph.runner.capture.job``), so a server's log shows a long start-up
    moving."""
    if requested or (requested is None and rank == 0 and sys.stderr.isatty()):
        return "bar"
    return "log" if rank == 0 else "off"


def capture_keys(job: CaptureJob, keys: Sequence[GraphKey]) -> list[KeyReport]:
    """Capture ``keys`` in order (callers pass largest first) on one stream; returns a report per key."""
    stream = job.platform.new_stream()
    reports = []
    hook = job.hook() if job.hook is not None else contextlib.nullcontext()
    with job.backend.capture_session(stream, shared_pool=job.shared_pool), hook:
        for key in _progress(keys, job):
            reports.append(_capture_one(job, key))
            if job.progress == "log":
                logger.info(
                    "captured %s graph %d/%d (%s, %s) in %.2f s",
                    job.phase,
                    len(reports),
                    len(keys),
                    key,
                    job.backend.name,
                    reports[-1].seconds,
                )
        if reports:
            job.finish(reports[0].key)
    return reports


def _capture_one(job: CaptureJob, key: GraphKey) -> KeyReport:
    try:
        report = _capture_key(job, key)
    except BaseException as exc:
        job.agree(key, exc)
        raise
    job.agree(key, None)
    return report


def _capture_key(job: CaptureJob, key: GraphKey) -> KeyReport:
    context = job.capture_context(key) if job.capture_context is not None else None
    job.ready(key)
    platform = job.platform
    try:
        with forward_context(context), torch.no_grad():
            _warm_up(job, key)
            job.barrier()
            before = platform.reserved_bytes()
            t0 = time.perf_counter()
            inputs = job.inputs_for(key)
            outputs = job.backend.capture_one(key, lambda: job.forward(**inputs))
            platform.synchronize()
            seconds = time.perf_counter() - t0
    except Exception as exc:
        raise capture_failure(exc, job, key) from exc
    job.on_captured(key, outputs)
    return KeyReport(key, seconds, max(0, platform.reserved_bytes() - before))


def _warm_up(job: CaptureJob, key: GraphKey) -> None:
    # Fresh aliases of the static buffers for every run: a forward that changes an input's metadata in place
    # (x.unsqueeze_(0)) changes only the aliases of that run.
    def run() -> None:
        job.forward(**job.inputs_for(key))

    runs = job.warmup_iters
    observe = job.observe if runs > 0 else None
    observed = False

    def observed_run(inputs: Mapping[str, Any]) -> bool:
        # The address guard runs the plain forward itself, under its observing mode (once).
        nonlocal observed
        observed = observe is not None and observe(key, inputs)
        return observed

    probe = job.probe
    if (
        probe is not None
        and probe.wanted(runs)
        and probe.first_run(job.inputs_for(key), job.static(), observed_run)
    ):
        # The probe's two runs are the first two warm-ups (the guard observed the first of them).
        job.notes.extend(probe.second_run(run, extra=runs == 1))
        runs = max(0, runs - 2)
    elif not observed and observed_run(job.inputs_for(key)) and runs > 1:
        # The observed run stands for a warm-up, never for the last: the backend's own forward (compiled,
        # for a compiling strategy) runs right before its capture.
        runs -= 1
    for _ in range(runs):
        run()


def capture_failure(exc: Exception, job: CaptureJob, key: GraphKey) -> CaptureError:
    """One :class:`CaptureError` naming the key, what failed and the advice for its cause."""
    translated = job.platform.translate_capture_error(exc, key.tokens)
    detail = str(translated) if translated is not None else f"{type(exc).__name__}: {exc}"
    cause = diagnose(exc, phase=job.phase, max_size=job.max_size, backend=job.backend.name)
    advice = cause.advice.rstrip(".")
    # An error that carries its own advice (a refused compile says what to do) gives it once, at the end.
    detail = detail.replace(advice, "").rstrip(" ;:,.") if advice and advice in detail else detail.rstrip(".")
    error = CaptureError(
        f"capturing the {job.phase} graph for {key} with backend {job.backend.name} on "
        f"{job.platform.name} failed: {detail}. What to do: {advice}. Graphs captured so far were released.",
        size=key.tokens,
        op=getattr(exc, "op", None),
    )
    error.key = key  # type: ignore[attr-defined]
    error.cause = cause.name  # type: ignore[attr-defined]
    return error
