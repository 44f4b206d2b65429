"""``GraphRunner``: capture a phase's forward at start-up, replay it on every step."""

from __future__ import annotations

import gc
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.utils import _pytree as pytree

from devgraph._trees import clone_tree, max_abs, max_abs_diff
from devgraph.backend import Batch, DeviceGraphBackend
from devgraph.config import DeviceGraphConfig, ResolvedPhase
from devgraph.context import forward_context
from devgraph.errors import CaptureError, ConfigError, InputError
from devgraph.factory import create_backend, resolve_platform
from devgraph.phases import check_phase
from devgraph.sizes import SizeSchedule, resolve_sizes

__all__ = ["StaticInput", "SizeReport", "CaptureReport", "VerifyResult", "GraphRunner"]

logger = logging.getLogger("devgraph.runner")


@dataclass(frozen=True)
class StaticInput:
    """A per-step input the runner keeps in a static buffer of ``(max_size, *shape)``.

    ``fill`` is written into padding rows (choose a value that is harmless: token 0, a scratch KV slot).
    ``host=True`` keeps the buffer in host memory, for values break ops or host-side graph updates read.
    """

    dtype: torch.dtype
    shape: tuple[int, ...] = ()
    fill: int | float = 0
    host: bool = False


@dataclass(frozen=True)
class SizeReport:
    size: int
    seconds: float
    bytes: int


@dataclass
class CaptureReport:
    """What ``capture()`` did: per size, seconds spent and device bytes the graph pool grew by."""

    phase: str
    backend: str
    platform: str
    sizes: list[SizeReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.sizes)

    def table(self) -> str:
        lines = [
            f"{self.phase}: {self.backend} on {self.platform}, "
            f"{len(self.sizes)} sizes in {self.seconds:.2f}s, "
            f"{self.bytes / 2**20:.1f} MiB"
        ]
        lines += [
            f"  size {s.size:>6}  {s.seconds * 1e3:9.1f} ms  {s.bytes / 2**20:9.2f} MiB" for s in self.sizes
        ]
        return "\n".join(lines)


@dataclass(frozen=True)
class VerifyResult:
    """Graph output vs eager output for one step.

    ``max_abs_diff``: against eager run on the runner's own padded static buffers: same kernels, same
    shapes, so it is 0 unless the graph baked in state that eager reads afresh (an input the forward
    reads outside the runner, or host state such as a forward-context value under ``full``).
    ``max_abs_diff_unpadded``: against eager on the caller's ``n`` rows. This also catches staging bugs
    (an input not copied, padding leaking into real rows); kernels picked for a different row count may
    round differently. ``ok`` holds when both are within ``rtol * scale`` (``scale`` = max |eager|).
    """

    n: int
    size: int | None
    replayed: bool
    max_abs_diff: float
    max_abs_diff_unpadded: float
    scale: float
    rtol: float

    @property
    def ok(self) -> bool:
        bound = self.rtol * max(self.scale, 1e-30)
        return self.max_abs_diff <= bound and self.max_abs_diff_unpadded <= bound


def _default_rtol(outputs: Any) -> float:
    low_precision = any(
        isinstance(t, torch.Tensor) and t.element_size() <= 2 and t.is_floating_point()
        for t in pytree.tree_leaves(outputs)
    )
    return 2e-2 if low_precision else 1e-4


class GraphRunner:
    """Captures ``forward`` for a phase at a list of sizes and replays it, padding steps up to a size.

    ``forward(**inputs)`` takes one tensor per declared :class:`StaticInput` whose first dimension is the
    step's size (batch size for decode, token count for prefill) and returns a tensor or a
    tuple/list/dict of tensors; model state (weights, KV cache) is reached through the closure.
    Choose the backend with ``mode`` (a strategy name) or ``config`` (a parsed ``--device-graph-mode``).
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        *,
        phase: str,
        inputs: Mapping[str, StaticInput],
        sizes: Sequence[int] | None = None,
        max_size: int | None = None,
        device: torch.device | str | None = None,
        mode: str | None = None,
        config: DeviceGraphConfig | str | None = None,
        compiler: str | None = None,
        features: Mapping[str, Any] | None = None,
        warmup_iters: int = 2,
        capture_context: Callable[[int], Any] | None = None,
        process_group: Any = None,
        progress: bool | None = None,
        backend: DeviceGraphBackend | None = None,
    ) -> None:
        self.forward = forward
        self.phase = check_phase(phase)
        if not inputs:
            raise ConfigError("GraphRunner needs at least one StaticInput (the step's size is read from it)")
        if mode is not None and config is not None:
            raise ConfigError(
                "pass either mode= (one strategy name) or config= (a --device-graph-mode value)"
            )
        self.input_specs = dict(inputs)
        self.warmup_iters = warmup_iters
        self.capture_context = capture_context
        self.process_group = process_group
        self.progress = progress
        self._closed = False
        self._captured = False
        self.report: CaptureReport | None = None

        platform = backend.platform if backend is not None else resolve_platform(device)
        if isinstance(config, str):
            config = DeviceGraphConfig.parse(config)
        config = config or DeviceGraphConfig.parse(mode or "auto")
        self.resolved: ResolvedPhase = config.resolve(self.phase, platform.name, features)
        phase_config = self.resolved.config
        options = {"compiler": phase_config.compiler or compiler}
        self.backend = backend or create_backend(
            device or platform.default_device(), self.phase, self.resolved.backend, options=options
        )
        self.platform = self.backend.platform
        self.device = torch.device(device) if device is not None else self.platform.default_device()

        free = self._free_bytes()
        self.schedule: SizeSchedule = resolve_sizes(
            self.phase,
            phase_config.sizes or sizes,
            phase_config.max_size or max_size,
            free,
        )
        self._buffers = self._allocate_buffers()
        self._graph_forward = self.backend.wrap_forward(forward)
        self._check_can_run = type(self.backend).can_run is not DeviceGraphBackend.can_run

    # -- set-up ----------------------------------------------------------------------------------
    def _free_bytes(self) -> int | None:
        try:
            return self.platform.mem_get_info()[0]
        except Exception:
            return None

    def _allocate_buffers(self) -> dict[str, torch.Tensor]:
        top = self.schedule.max
        buffers = {}
        for name, spec in self.input_specs.items():
            device = torch.device("cpu") if spec.host else self.device
            buffers[name] = torch.full((top, *spec.shape), spec.fill, dtype=spec.dtype, device=device)
        return buffers

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.schedule.sizes

    @property
    def static_inputs(self) -> Mapping[str, torch.Tensor]:
        """The full static buffers (``max_size`` rows each)."""
        return self._buffers

    def _views(self, size: int) -> dict[str, torch.Tensor]:
        return {name: _leading_rows(buf, size) for name, buf in self._buffers.items()}

    # -- capture ---------------------------------------------------------------------------------
    def capture(self) -> CaptureReport:
        """Capture every size, largest first, into one pool on one stream; returns the report.

        Warm-up runs ``warmup_iters`` times on the capture stream before each capture; ranks of
        ``process_group`` synchronize and barrier between the last warm-up and the capture.
        On failure raises :class:`CaptureError` naming the size, after releasing what was captured.
        """
        self._check_open()
        report = CaptureReport(self.phase, self.backend.name, self.platform.name)
        if self._captured:
            return self.report or report
        if not self.backend.uses_graphs:
            self._captured = True
            self.report = report
            return report
        self.backend.prepare(self)
        stream = self.platform.new_stream()
        start = time.perf_counter()
        gc.collect()
        gc.freeze()  # objects alive now are never collected mid-capture, which keeps capture fast
        try:
            with self.backend.capture_session(stream):
                for size in self._progress(sorted(self.schedule.sizes, reverse=True)):
                    report.sizes.append(self._capture_size(size))
        except BaseException:
            self.backend.cleanup()
            raise
        finally:
            gc.unfreeze()
        report.sizes.sort(key=lambda s: s.size)
        report.seconds = time.perf_counter() - start
        self._captured = True
        self.report = report
        logger.info("%s", report.table())
        return report

    def _progress(self, sizes: list[int]) -> Any:
        show = self.progress if self.progress is not None else (self._rank() == 0 and sys.stderr.isatty())
        if not show:
            return sizes
        from tqdm import tqdm

        return tqdm(sizes, desc=f"capturing {self.phase} ({self.backend.name})", unit="size", leave=False)

    def _rank(self) -> int:
        if self.process_group is None or not torch.distributed.is_initialized():
            return 0
        return torch.distributed.get_rank(self.process_group)

    def _barrier(self) -> None:
        self.platform.synchronize()
        if self.process_group is not None and torch.distributed.is_initialized():
            torch.distributed.barrier(group=self.process_group)

    def _capture_size(self, size: int) -> SizeReport:
        forward = partial(self._graph_forward, **self._views(size))
        context = self.capture_context(size) if self.capture_context else None
        try:
            with forward_context(context):
                for _ in range(self.warmup_iters):
                    forward()
                self._barrier()
                before = self.platform.reserved_bytes()
                t0 = time.perf_counter()
                self.backend.capture_one(size, forward)
                self.platform.synchronize()
                seconds = time.perf_counter() - t0
        except Exception as exc:
            raise self._capture_failure(exc, size) from exc
        return SizeReport(size, seconds, max(0, self.platform.reserved_bytes() - before))

    def _capture_failure(self, exc: Exception, size: int) -> CaptureError:
        translated = self.platform.translate_capture_error(exc, size)
        if translated is not None:
            detail = str(translated)
        elif isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            detail = (
                f"out of device memory ({exc}). Lower max_size (now {self.schedule.max}) or capture fewer "
                "sizes, leave more memory free (a smaller KV cache), or disable graphs for this phase "
                f"with --device-graph-mode '{self.phase}=disabled'"
            )
        else:
            detail = (
                f"{type(exc).__name__}: {exc}. Lower the sizes, switch this phase to another mode "
                f"(--device-graph-mode '{self.phase}=breakable' or '{self.phase}=disabled'), or move the "
                "failing op into a @devgraph.graph_break op"
            )
        op = getattr(exc, "op", None)
        return CaptureError(
            f"capturing the {self.phase} graph for size {size} with backend {self.backend.name} on "
            f"{self.platform.name} failed: {detail}. Graphs captured so far were released.",
            size=size,
            op=op,
        )

    # -- run -------------------------------------------------------------------------------------
    def bucket(self, n: int) -> int | None:
        """The captured size a step of ``n`` rows pads up to (``None``: it runs eagerly)."""
        return self.schedule.bucket(n)

    def run(self, n: int | None = None, context: Any = None, **inputs: torch.Tensor) -> Any:
        """Run one step of ``n`` rows (default: the first input's length).

        Replays the graph of the smallest captured size >= ``n`` (padding rows get each input's fill)
        and returns outputs sliced to ``n`` rows. The returned tensors are views of static graph
        outputs: they are overwritten by the next ``run`` — copy what you keep. Runs ``forward``
        eagerly when ``n`` is past the largest size, before ``capture()``, or when ``can_run`` says no.
        """
        if n is None:
            n = next(iter(inputs.values())).shape[0] if inputs else 0
        size = self.schedule.bucket(n) if self._captured else None
        backend = self.backend
        if (
            size is None
            or not backend.has_shape(size)
            or (self._check_can_run and not backend.can_run(Batch(n, size, context)))
        ):
            return self._run_eager(context, inputs)
        self._stage(n, size, inputs)
        with forward_context(context), backend.runtime_session():
            outputs = backend.replay(size, self._buffers)
        return outputs if n == size else _slice_rows(outputs, n, size)

    def _run_eager(self, context: Any, inputs: Mapping[str, torch.Tensor]) -> Any:
        self._check_open()
        self._check_names(inputs)
        with forward_context(context):
            return self._graph_forward(**inputs)

    def _check_names(self, inputs: Mapping[str, torch.Tensor]) -> None:
        if inputs.keys() != self.input_specs.keys():
            missing = sorted(self.input_specs.keys() - inputs.keys())
            extra = sorted(inputs.keys() - self.input_specs.keys())
            raise InputError(
                f"{self.phase} runner inputs do not match its StaticInputs: missing {missing}, "
                f"unexpected {extra}; pass exactly {sorted(self.input_specs)}"
            )

    def _stage(self, n: int, size: int, inputs: Mapping[str, torch.Tensor]) -> None:
        """Validate every input, then copy them into the static buffers and fill padding rows."""
        self._check_names(inputs)
        buffers = self._buffers
        for name, value in inputs.items():
            buf = buffers[name]
            if (
                not isinstance(value, torch.Tensor)
                or value.dtype != buf.dtype
                or value.device != buf.device
                or value.shape[0] != n
                or value.shape[1:] != buf.shape[1:]
            ):
                raise self._input_error(name, value, n)
        for name, value in inputs.items():
            buf = buffers[name]
            buf[:n].copy_(value)
            if n < size:
                buf[n:size].fill_(self.input_specs[name].fill)

    def _input_error(self, name: str, value: Any, n: int) -> InputError:
        buf = self._buffers[name]
        expected = f"{buf.dtype} on {buf.device} with shape ({n}, {', '.join(map(str, buf.shape[1:]))})"
        got = (
            f"{value.dtype} on {value.device} with shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        return InputError(
            f"{self.phase} input {name!r}: expected {expected} (static buffer {tuple(buf.shape)}), "
            f"got {got}; nothing was written"
        )

    # -- checks ----------------------------------------------------------------------------------
    def verify(
        self, n: int | None = None, context: Any = None, *, rtol: float | None = None, **inputs: torch.Tensor
    ) -> VerifyResult:
        """Run the step through the graph and eagerly on the same inputs; report the largest differences.

        ``rtol`` bounds the unpadded difference relative to max |eager| (default 1e-4, or 2e-2 for
        16-bit outputs). Model state the forward mutates (a KV cache) is written twice with the same
        values, so checking a step does not change what later steps compute.
        """
        if n is None:
            n = next(iter(inputs.values())).shape[0]
        size = self.bucket(n) if self._captured else None
        graph_out = clone_tree(self.run(n, context, **inputs))
        unpadded = clone_tree(self._run_eager(context, inputs))
        replayed = size is not None and self.backend.has_shape(size)
        if replayed:
            with forward_context(context):
                padded = _slice_rows(self._graph_forward(**self._views(size)), n, size)
        else:
            padded = unpadded
        return VerifyResult(
            n,
            size,
            replayed,
            max_abs_diff(graph_out, padded),
            max_abs_diff(graph_out, unpadded),
            max_abs(unpadded),
            rtol if rtol is not None else _default_rtol(unpadded),
        )

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Release graphs, their pool and the static buffers. Call before destroying the process group."""
        if self._closed:
            return
        self.backend.cleanup()
        self._buffers = {}
        self._captured = False
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"this {self.phase} runner was closed; build a new GraphRunner")

    def __enter__(self) -> GraphRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GraphRunner(phase={self.phase!r}, backend={self.backend.name!r}, "
            f"platform={self.platform.name!r}, "
            f"sizes={list(self.schedule.sizes)}, captured={self._captured})"
        )


def _leading_rows(buf: torch.Tensor, size: int) -> torch.Tensor:
    """The first ``size`` rows of ``buf`` as a tensor sharing its storage but with no ``_base``.

    A plain slice is a view, and torch.compile guards on a view's base: every captured size (and the
    eager fallback with the caller's own tensors) would then recompile. An alias made with ``set_``
    looks like any other tensor to dynamo while still reading and writing the static buffer.
    """
    alias = torch.empty(0, dtype=buf.dtype, device=buf.device)
    alias.set_(buf.untyped_storage(), buf.storage_offset(), (size, *buf.shape[1:]), buf.stride())
    return alias


def _slice_rows(outputs: Any, n: int, size: int) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs[:n] if outputs.dim() and outputs.shape[0] == size else outputs
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_slice_rows(o, n, size) for o in outputs)
    if isinstance(outputs, dict):
        return {k: _slice_rows(v, n, size) for k, v in outputs.items()}
    return outputs
