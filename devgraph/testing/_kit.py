"""The conformance kit's machinery: targets, options, results and the per-check context."""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from devgraph import (
    PHASES,
    BackendOptions,
    BackendUnavailableError,
    CaptureError,
    ConfigError,
    DeviceGraphBackend,
    GraphKey,
    GraphPlatform,
    GraphRunner,
    RecompileError,
    ReplayError,
    StaticInput,
    get_registry,
)
from devgraph.registry.plugins import BackendSpec, Registry
from devgraph.runner.outputs.trees import max_abs, max_abs_diff
from devgraph.testing._report import CheckResult, ConformanceFailure, ConformanceReport, Status

__all__ = [
    "Check",
    "ConformanceFailure",
    "CheckFailed",
    "CheckResult",
    "CheckSkipped",
    "ConformanceReport",
    "KitContext",
    "KitOptions",
    "Target",
    "detects_host_sync",
    "parse_target",
]

#: Errors a check's scenario only meets when the backend breaks its contract: reported as ``failed``.
BACKEND_ERRORS = (CaptureError, ReplayError, RecompileError)
BreakMode = Literal["auto", "eager", "captured"]


class CheckFailed(AssertionError):
    """A conformance check found the backend breaking the contract."""


class CheckSkipped(Exception):
    """A check does not apply to this backend or platform (the reason says why)."""


@dataclass(frozen=True)
class Target:
    """``PLATFORM:NAME``: the registered backend the kit runs against."""

    platform: str
    name: str

    def __str__(self) -> str:
        return f"{self.platform}:{self.name}"


def parse_target(text: str | Target) -> Target:
    """``"cpu:full"`` -> ``Target("cpu", "full")``; raises :class:`ConfigError` on anything else."""
    if isinstance(text, Target):
        return text
    platform, sep, name = str(text).strip().partition(":")
    if not sep or not platform or not name or ":" in name:
        raise ConfigError(
            f"conformance target {text!r} must look like PLATFORM:NAME (e.g. cpu:full, cuda:breakable)"
        )
    return Target(platform.strip(), name.strip())


@dataclass(frozen=True)
class KitOptions:
    """How the kit runs; the defaults suit every backend.

    * ``phase``: the phase the backends are built for (default: ``decode`` if the backend serves it,
      else its first phase). The kit's forwards are phase-agnostic.
    * ``sizes``: the sizes captured (largest first, as the runner does).
    * ``device``: the device tensors live on (default: the platform's default device).
    * ``compiler``: the ``compiler`` option handed to the backend (``tc_piecewise``: eager or inductor).
    * ``backend_options``: extra backend options (``BackendOptions.extra``).
    * ``break_ops``: what break ops do at replay: ``eager`` (run between segments, reading the live
      forward context: ``breakable``, ``tc_piecewise``), ``captured`` (inside the graph: ``full``) or
      ``auto`` (what the backend class declares in ``runs_breaks_eagerly``, else what it is seen doing).
    * ``require_sync_detection``: fail, instead of skip, the capture-error check on a platform that says
      it cannot notice a host sync during capture (where it says it can, the check never skips).
    * ``exact_atol``: allowed difference between a replay and eager on the same padded batch (0: same
      kernels on the same shapes must agree bit for bit). ``rtol``: relative tolerance (of max |eager|)
      where shapes differ (padded graph vs unpadded eager).
    """

    phase: str | None = None
    sizes: tuple[int, ...] = (1, 2, 4)
    device: torch.device | str | None = None
    compiler: str | None = None
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    break_ops: BreakMode = "auto"
    require_sync_detection: bool = False
    exact_atol: float = 0.0
    rtol: float = 1e-4

    def __post_init__(self) -> None:
        sizes = tuple(sorted(set(int(s) for s in self.sizes)))
        if len(sizes) < 3 or sizes[0] < 1:
            raise ConfigError(f"KitOptions.sizes needs at least three positive sizes, got {self.sizes!r}")
        object.__setattr__(self, "sizes", sizes)
        if self.break_ops not in ("auto", "eager", "captured"):
            raise ConfigError(f"KitOptions.break_ops must be auto, eager or captured, got {self.break_ops!r}")
        if self.phase is not None and self.phase not in PHASES:
            raise ConfigError(f"KitOptions.phase {self.phase!r} is unknown; accepted: {', '.join(PHASES)}")


@dataclass(frozen=True)
class Check:
    """One named check of the contract: ``run(ctx)`` raises :class:`CheckFailed` / :class:`CheckSkipped`,
    or returns a note for the report."""

    name: str
    summary: str
    run: Callable[[KitContext], str | None]


# -- the per-check context --------------------------------------------------------------------------
class KitContext:
    """What a check needs: the target's registry entry, fresh backends and runners, comparisons."""

    def __init__(self, target: Target, options: KitOptions, registry: Registry | None = None) -> None:
        self.target = target
        self.options = options
        self.registry = registry or get_registry()
        self.spec: BackendSpec = resolve_spec(self.registry, target)
        self.platform: GraphPlatform = self.registry.platform(target.platform)
        availability = self.spec.cls.availability(self.platform)
        if not availability:
            raise BackendUnavailableError(f"backend {target} cannot run here: {availability.reason}")
        self.phase = options.phase or (
            "decode" if "decode" in self.spec.phases else sorted(self.spec.phases)[0]
        )
        if self.phase not in self.spec.phases:
            raise ConfigError(
                f"backend {target} does not serve phase {self.phase!r} "
                f"(it serves {', '.join(sorted(self.spec.phases))})"
            )
        self.device = (
            torch.device(options.device) if options.device is not None else self.platform.default_device()
        )
        self._runners: list[GraphRunner] = []
        self._backends: list[DeviceGraphBackend] = []
        self._compiles = self.spec.cls.wrap_forward is not DeviceGraphBackend.wrap_forward

    # -- building -----------------------------------------------------------------------------------
    def new_backend(self) -> DeviceGraphBackend:
        """A fresh instance of the target backend (one backend serves one live runner); its graphs are
        released when the check ends."""
        options = BackendOptions(compiler=self.options.compiler, extra=dict(self.options.backend_options))
        backend = self.spec.cls(self.platform, phase=self.phase, options=options)
        self._backends.append(backend)
        return backend

    def runner(
        self,
        forward: Callable[..., Any],
        inputs: Mapping[str, StaticInput],
        *,
        sizes: Sequence[int] | None = None,
        backend: DeviceGraphBackend | None = None,
        **kwargs: Any,
    ) -> GraphRunner:
        """A runner over ``forward`` with the target backend; closed when the check ends.

        The kit's steps carry one token per request in every phase (``verify``: ``tokens_per_request=1``).
        """
        if self.phase == "verify":
            kwargs.setdefault("tokens_per_request", 1)
        runner = GraphRunner(
            forward,
            phase=self.phase,
            inputs=inputs,
            sizes=list(sizes or self.options.sizes),
            device=self.device,
            backend=backend or self.new_backend(),
            progress=False,
            **kwargs,
        )
        self._runners.append(runner)
        return runner

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.options.sizes

    @property
    def detects_host_sync(self) -> bool:
        """Whether the platform says a host sync during capture fails the capture."""
        return detects_host_sync(self.platform)

    def break_mode(self, observed_replay_calls: int | None = None) -> Literal["eager", "captured"]:
        """What break ops do at replay for this backend (see :attr:`KitOptions.break_ops`)."""
        if self.options.break_ops != "auto":
            return self.options.break_ops
        declared = self.spec.cls.runs_breaks_eagerly
        if declared is None:
            declared = bool(observed_replay_calls)
        return "eager" if declared else "captured"

    def randn(self, *shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(shape, generator=generator) * scale).to(self.device)

    # -- comparisons --------------------------------------------------------------------------------
    def assert_exact(self, got: Any, want: Any, what: str) -> None:
        """Replay vs eager on the same padded batch: equal up to ``exact_atol`` (0 by default)."""
        diff = max_abs_diff(got, want)
        if not diff <= self.options.exact_atol:
            raise CheckFailed(
                f"{what}: replay differs from eager on the same inputs by {diff:.3g} (allowed "
                f"{self.options.exact_atol:.3g})"
            )

    def assert_close(self, got: Any, want: Any, what: str) -> None:
        """Different row counts (padded graph vs unpadded eager): equal within ``rtol`` of max |eager|."""
        diff = max_abs_diff(got, want)
        bound = self.options.rtol * max(max_abs(want), 1.0)
        if not diff <= bound:
            raise CheckFailed(f"{what}: differs from eager by {diff:.3g} (allowed {bound:.3g})")

    def synchronize(self) -> None:
        self.platform.synchronize()

    # -- teardown -----------------------------------------------------------------------------------
    def close(self) -> None:
        for runner in self._runners:
            with contextlib.suppress(Exception):
                runner.close()
        self._runners.clear()
        for backend in self._backends:
            with contextlib.suppress(Exception):
                backend.cleanup()
        self._backends.clear()
        # Checks build fresh models each time; torch.compile caches per code object and guards on the
        # model instance, so compiled backends would hit dynamo's recompile limit across checks.
        if self._compiles:
            torch._dynamo.reset()
        # No gc.collect() here: every runner was closed and every backend cleaned up explicitly, and a full
        # collection costs ~0.1 s per check (the cleanup check collects where it measures memory).
        with contextlib.suppress(Exception):
            self.platform.synchronize()
            self.platform.empty_cache()


def resolve_spec(registry: Registry, target: Target) -> BackendSpec:
    registry.load()
    spec = registry.backends.get((target.platform, target.name))
    if spec is None:
        known = ", ".join(f"{p}:{n}" for p, n in sorted(registry.backends)) or "none"
        failed = [p.name for p in registry.plugins if p.status == "failed"]
        hint = f"; plug-ins that failed to load: {', '.join(failed)}" if failed else ""
        raise BackendUnavailableError(
            f"no backend {target} is registered (registered: {known}){hint}; install "
            "the plug-in that provides it and check `devgraph info`"
        )
    return spec


def detects_host_sync(platform: GraphPlatform) -> bool:
    """Whether ``platform`` says a host sync during capture fails the capture (``detects_host_sync``)."""
    return bool(platform.detects_host_sync)


@dataclass(frozen=True)
class ReplayCall:
    """One ``backend.replay`` call the runner made: the key and the static inputs it passed."""

    key: GraphKey
    static_inputs: Mapping[str, torch.Tensor]


@contextlib.contextmanager
def counting_replays(backend: DeviceGraphBackend) -> Iterator[list[ReplayCall]]:
    """Record every ``backend.replay`` call made inside the block (as the runner calls it)."""
    calls: list[ReplayCall] = []
    original = backend.replay

    def replay(key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        calls.append(ReplayCall(key, static_inputs))
        return original(key, static_inputs)

    backend.replay = replay  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del backend.replay  # back to the class's method


def run_checks(
    target: Target, checks: Iterable[Check], options: KitOptions, registry: Registry | None = None
) -> ConformanceReport:
    """Run ``checks`` against ``target``, each in a fresh :class:`KitContext`."""
    probe = KitContext(target, options, registry)
    report = ConformanceReport(str(target), probe.platform.name, probe.spec.cls.__qualname__, probe.phase)
    for check in checks:
        report.results.append(run_one(target, check, options, probe.registry))
    return report


def run_one(
    target: Target, check: Check, options: KitOptions, registry: Registry | None = None
) -> CheckResult:
    """Run one check and turn its outcome into a :class:`CheckResult`."""
    start = time.perf_counter()
    ctx = KitContext(target, options, registry)
    try:
        note = check.run(ctx)
        status: Status = "passed"
        detail = note or ""
    except CheckSkipped as exc:
        status, detail = "skipped", str(exc)
    except CheckFailed as exc:
        status, detail = "failed", str(exc)
    except BACKEND_ERRORS as exc:  # raised by the backend in a scenario a conforming backend handles
        status = "failed"
        detail = (
            f"the backend raised {type(exc).__name__} where a conforming backend does not: {exc}\n"
            f"{''.join(traceback.format_exception(exc))}"
        )
    except Exception as exc:
        status = "error"
        detail = f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}"
    finally:
        ctx.close()
    return CheckResult(check.name, status, detail, time.perf_counter() - start)
