"""A runner's options: the keywords ``GraphRunner`` takes, resolved once into a typed, frozen plan.

The front door is ``GraphRunner(forward, phase=, inputs=, **options)``: :class:`RunnerOptions` types every
keyword (a ``TypedDict``, so a type checker checks each caller's keywords as it would a long signature, and
an engine passes the ones it needs). :func:`plan_runner` checks every option the way the flag's values are
checked (a compiler the strategy would ignore, or one that does not exist, is a
:class:`~devgraph.errors.ConfigError` naming what is accepted), lets the flag win over an option wherever
both give a value (:func:`flag_over_arguments`, the one place that rule is written), resolves the platform
once, ``auto`` and the compatibility rules, builds the backends and the key schedule, and groups the rest
(:class:`CapturePlan`, :class:`Distributed`, :class:`Safety`). The runner and its parts read the
:class:`RunnerPlan`; nothing reads the flag or the options again.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import types
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.inputs import StaticInput
from devgraph.contract.keys import GraphKey
from devgraph.contract.modes import SpecialMode
from devgraph.contract.phases import Phase
from devgraph.contract.platform import GraphPlatform
from devgraph.errors import ConfigError
from devgraph.flag.config import DeviceGraphConfig, PhaseConfig
from devgraph.flag.factory import ResolvedPhase, build_backend, resolve_phase, usable_platform
from devgraph.flag.values import check_field
from devgraph.messages import shorten
from devgraph.runner.outputs.layout import check_output_axes
from devgraph.runner.schedule import AxisSizes, KeySchedule, schedule_for
from devgraph.runner.state import DeclaredState, as_state

if TYPE_CHECKING:
    from devgraph.runner.shared_pool import GraphPool

__all__ = [
    "FLAG_KEYS",
    "RESERVED_NAMES",
    "CapturePlan",
    "Distributed",
    "LazyPolicy",
    "RunnerOptions",
    "RunnerPlan",
    "Safety",
    "check_signature",
    "flag_over_arguments",
    "plan_runner",
]

logger = logging.getLogger(__name__)

#: The runner's arguments that are also keys of a phase in ``--device-graph-mode``.
FLAG_KEYS: tuple[str, ...] = (
    "sizes",
    "max_size",
    "compiler",
    "warmup_iters",
    "lazy",
    "max_graphs",
    "max_graph_bytes",
    "fallback",
)

#: Keywords of run() and verify(): an input may not use these names.
RESERVED_NAMES = frozenset({"n", "context", "counts", "variant", "copy", "out", "rtol", "self", "agreement"})


class RunnerOptions(TypedDict, total=False):
    """Every keyword of ``GraphRunner`` besides ``forward``, ``phase`` and ``inputs`` (docs/user-guide.md).

    What the flag resolves to: ``device``, ``mode`` (one strategy name) or ``config`` (a parsed or textual
    ``--device-graph-mode``), ``features`` (for the compatibility rules), ``backend`` (one built already).
    The flag's own keys, as the engine's defaults (the flag wins where it sets one): ``sizes``,
    ``max_size``, ``compiler``, ``warmup_iters``, ``lazy``, ``max_graphs``, ``max_graph_bytes``,
    ``fallback``. The step's shape: ``axes``, ``tokens_per_request``, ``variants``, ``output_axes``.
    Hooks: ``capture_context``, ``capture_hook``, ``progress``, ``record_steps``. Distributed:
    ``process_group``, ``dp_group``, ``check_lockstep``. Safety: ``state``, ``address_guard``,
    ``single_thread``, ``pool``.
    """

    device: torch.device | str | None
    mode: str | None
    config: DeviceGraphConfig | str | None
    features: Mapping[str, Any] | None
    backend: DeviceGraphBackend | None
    sizes: Sequence[int] | None
    max_size: int | None
    compiler: str | None
    warmup_iters: int | None
    lazy: bool | None
    max_graphs: int | None
    max_graph_bytes: int | None
    fallback: str | None
    axes: Mapping[str, AxisSizes] | None
    tokens_per_request: int | None
    variants: Mapping[str, Sequence[Hashable]] | None
    output_axes: Sequence[str | None] | Mapping[str, str | None] | None
    capture_context: Callable[[GraphKey], Any] | None
    capture_hook: Callable[[], Any] | None
    progress: bool | None
    record_steps: bool
    process_group: Any
    dp_group: Any
    check_lockstep: bool
    state: Any
    address_guard: bool
    single_thread: bool
    pool: GraphPool | None


#: The keywords :class:`RunnerOptions` names, for the error that refuses any other.
OPTION_NAMES: tuple[str, ...] = tuple(RunnerOptions.__annotations__)


@dataclass(frozen=True)
class LazyPolicy:
    """Bounds of a lazily capturing runner (``None``: unbounded)."""

    max_graphs: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, low in (("max_graphs", 1), ("max_bytes", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"{name} must be an int >= {low} or None, got {shorten(value)}")


@dataclass(frozen=True)
class CapturePlan:
    """How keys are captured: warm-ups per key, the engine's hooks, progress, and the lazily captured cache
    (``lazy``: each key on first sight, within ``lazy_policy``'s bounds, instead of all at start-up)."""

    warmup_iters: int
    context: Callable[[GraphKey], Any] | None
    hook: Callable[[], Any] | None
    progress: bool | None
    lazy: bool
    lazy_policy: LazyPolicy


@dataclass(frozen=True)
class Distributed:
    """The ranks a runner steps with: ``process_group`` (tensor parallel: ranks capture each key together
    and, with ``check_lockstep``, check each step replays the same key) and ``dp_group`` (data parallel:
    ranks agree on one key per step)."""

    process_group: Any = None
    dp_group: Any = None
    check_lockstep: bool = False

    @property
    def groups(self) -> list[Any]:
        """Each group once (``destroy_process_group()`` closes the runners built with it first)."""
        return list({id(g): g for g in (self.process_group, self.dp_group) if g is not None}.values())


@dataclass(frozen=True)
class Safety:
    """What keeps a runner's results right: the declared ``state`` its capture and ``verify()`` leave as
    found, the address guard, and the lock (``single_thread``: none, for one calling thread)."""

    state: DeclaredState
    address_guard: bool = True
    single_thread: bool = False


@dataclass(frozen=True)
class RunnerPlan:
    """Everything a runner resolved once. ``flag`` is ``--device-graph-mode`` as given (``mode=`` is a flag
    naming one mode); ``resolved`` is the phase's backend after ``auto`` and the compatibility rules, with
    its settings (``resolved.config``: the flag over the options). ``retune()`` replaces the plan with one
    of another schedule (the graph life owns the current one)."""

    phase: str
    inputs: Mapping[str, StaticInput]
    platform: GraphPlatform
    device: torch.device
    flag: DeviceGraphConfig
    resolved: ResolvedPhase
    schedule: KeySchedule
    capture: CapturePlan
    output_axes: Sequence[str | None] | Mapping[str, str | None] | None
    distributed: Distributed
    safety: Safety
    #: The fallback graph set's mode (``None``: steps the backend declines run eagerly).
    fallback: str | None = None

    @property
    def tokens_per_request(self) -> int | None:
        return self.schedule.tokens_per_request

    @property
    def process_group(self) -> Any:
        return self.distributed.process_group

    @property
    def dp_group(self) -> Any:
        return self.distributed.dp_group

    @property
    def state(self) -> DeclaredState:
        return self.safety.state


def flag_over_arguments(flag: PhaseConfig, arguments: Mapping[str, Any]) -> PhaseConfig:
    """A phase's settings: each key the flag sets, else the runner's argument for it. An operator's
    ``--device-graph-mode`` overrides what the engine's code asked for; this is the one place that rule is
    written. The result is checked as the flag is (``compiler`` on a strategy that does not compile)."""
    chosen = {key: value for key, value in arguments.items() if value is not None}
    chosen.update({f.name: getattr(flag, f.name) for f in fields(flag) if getattr(flag, f.name) is not None})
    return PhaseConfig(**chosen)


def _arguments(phase: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The runner's flag-like arguments, each checked as the flag's value for that key is."""
    unknown = sorted(set(given) - set(FLAG_KEYS))
    if unknown:
        raise ConfigError(f"{unknown} are not keys of a phase; the runner takes {', '.join(FLAG_KEYS)}")
    return {
        key: check_field(key, value, f"{phase} {key}", phase, None, python=True)
        for key, value in given.items()
        if value is not None
    }


def _flag(mode: str | None, config: DeviceGraphConfig | str | None) -> DeviceGraphConfig:
    if mode is not None and config is not None:
        raise ConfigError("pass either mode= (one strategy name) or config= (a --device-graph-mode value)")
    if mode is not None and not isinstance(mode, str):
        raise ConfigError(f"mode= must be a strategy name such as 'full', got {shorten(mode)}")
    return DeviceGraphConfig.parse(config if config is not None else (mode or "auto"))


def _inputs(phase: str, inputs: Any, reserved: frozenset[str]) -> Mapping[str, StaticInput]:
    if not isinstance(inputs, Mapping) or not inputs:
        raise ConfigError(
            f"the {phase} runner needs inputs={{name: StaticInput(...)}} with at least one input, "
            f"got {shorten(inputs)}"
        )
    for name, spec in inputs.items():
        if not isinstance(name, str) or not name.isidentifier() or name in reserved:
            raise ConfigError(
                f"input name {shorten(name)} must be a Python identifier other than run()'s own keywords "
                f"({', '.join(sorted(reserved))})"
            )
        if not isinstance(spec, StaticInput):
            raise ConfigError(f"input {name!r} must be a devgraph.StaticInput, got {shorten(spec)}")
    return types.MappingProxyType(dict(inputs))


def check_signature(forward: Callable[..., Any], names: Sequence[str], phase: str) -> None:
    """The runner calls ``forward(**inputs, **variant)``: every name must be a parameter it takes by keyword
    (or it takes ``**kwargs``), and every parameter it requires must be among them. Checked when the runner
    is built, so a misspelt input is reported as one, not as whatever a compile makes of it."""
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):  # a builtin or an extension type: nothing to check against
        return
    params = list(signature.parameters.values())
    by_keyword = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    unknown = [n for n in names if n not in by_keyword and not takes_any]
    required = [
        p.name
        for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in names
    ]
    if not unknown and not required:
        return
    problems = []
    if unknown:
        problems.append(f"it takes no parameter named {', '.join(map(repr, unknown))}")
    if required:
        problems.append(f"it requires {', '.join(map(repr, required))}, which no input or variant provides")
    raise ConfigError(
        f"the {phase} runner calls forward(**inputs, **variant) with {', '.join(map(repr, names))}, but "
        f"{' and '.join(problems)} (its signature is {getattr(forward, '__name__', 'forward')}{signature}); "
        "name each StaticInput after a parameter of the forward"
    )


def _device(device: torch.device | str | None, platform: GraphPlatform) -> torch.device:
    default = platform.default_device()
    if device is None:
        return default
    chosen = torch.device(device)
    return default if chosen.index is None and chosen.type == default.type else chosen


def _check(name: str, value: Any, ok: bool, wanted: str) -> None:
    if not ok:
        raise ConfigError(f"{name}= must be {wanted}, got {shorten(value)}")


def _options(phase: str, options: Mapping[str, Any]) -> None:
    """Refuse a keyword :class:`RunnerOptions` does not name, with the nearest one."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        near = difflib.get_close_matches(unknown[0], OPTION_NAMES, n=1)
        hint = f"; did you mean {near[0]!r}" if near else ""
        raise ConfigError(
            f"the {phase} GraphRunner got unknown keyword(s) {', '.join(map(repr, unknown))}{hint}; it takes "
            f"forward, phase=, inputs= and {', '.join(OPTION_NAMES)} (docs/user-guide.md)"
        )


def _flags(name: str, value: Any) -> bool:
    _check(name, value, isinstance(value, bool), "True or False")
    return bool(value)


def plan_runner(
    forward: Callable[..., Any], phase: str, inputs: Any, options: RunnerOptions
) -> tuple[RunnerPlan, DeviceGraphBackend, DeviceGraphBackend | None]:
    """The plan of a runner of ``forward``, its backend (the one given, or one built for the resolved mode)
    and the fallback graph set's backend (``None`` without a fallback)."""
    if not callable(forward):
        raise ConfigError(f"GraphRunner forward must be callable, got {shorten(forward)}")
    step_phase = Phase.parse(phase)
    phase = step_phase.value
    _options(phase, options)
    by_name: Mapping[str, Any] = options  # the keywords looked up by a name held in a variable
    specs = _inputs(phase, inputs, RESERVED_NAMES)
    flag = _flag(options.get("mode"), options.get("config"))
    given = _arguments(phase, {key: by_name.get(key) for key in FLAG_KEYS})
    progress = options.get("progress")
    _check("progress", progress, progress is None or isinstance(progress, bool), "True, False or None")
    lockstep = _flags("check_lockstep", options.get("check_lockstep", False))
    _flags("record_steps", options.get("record_steps", False))
    distributed = Distributed(options.get("process_group"), options.get("dp_group"), lockstep)
    safety = Safety(
        as_state(options.get("state")),
        _flags("address_guard", options.get("address_guard", True)),
        _flags("single_thread", options.get("single_thread", False)),
    )
    hooks = {name: by_name.get(name) for name in ("capture_context", "capture_hook")}
    for name, hook in hooks.items():
        _check(name, hook, hook is None or callable(hook), "a callable or None")
    backend = options.get("backend")
    if backend is not None:
        _check("backend", backend, isinstance(backend, DeviceGraphBackend), "a DeviceGraphBackend instance")
        if "compiler" in given:
            raise ConfigError(
                "compiler= applies to the backend the runner builds; a backend= given is built already "
                "(pass the compiler in its options: devgraph.create_backend(..., options={'compiler': ...}))"
            )
    device = options.get("device")
    # The one resolution; a device no platform can use here (cuda on a CPU-only torch) is refused by name.
    platform = backend.platform if backend is not None else usable_platform(device, flag="device")
    settings = flag_over_arguments(flag.for_phase(phase), given)
    try:
        resolved = resolve_phase(
            DeviceGraphConfig({**flag.phases, phase: settings}, flag.source),
            phase,
            platform.name,
            options.get("features"),
        )
    except ConfigError as exc:  # say which of the settings it names came from the runner's options
        from_arguments = {k: v for k, v in given.items() if getattr(flag.for_phase(phase), k) is None}
        joined = ", ".join(f"{k}={v!r}" for k, v in from_arguments.items() if k in str(exc))
        if not joined:
            raise
        raise ConfigError(f"{exc} (the runner's arguments set {joined})") from None
    target = _device(device, platform)
    if backend is None:
        backend = build_backend(platform, phase, resolved.backend, options=resolved.backend_options())
    chosen = resolved.config
    fallback = _fallback_backend(phase, resolved, backend, platform)
    warmups = chosen.warmup_iters if chosen.warmup_iters is not None else int(platform.warmup_iters)
    shape = (options.get("axes"), options.get("tokens_per_request"), options.get("variants"))
    schedule = schedule_for(step_phase, specs, platform, chosen, *shape)
    plan = RunnerPlan(
        phase=phase,
        inputs=specs,
        platform=platform,
        device=target,
        flag=flag,
        resolved=resolved,
        schedule=schedule,
        capture=CapturePlan(
            warmup_iters=warmups,
            context=hooks["capture_context"],
            hook=hooks["capture_hook"],
            progress=progress,
            lazy=bool(chosen.lazy),
            lazy_policy=LazyPolicy(chosen.max_graphs, chosen.max_graph_bytes),
        ),
        output_axes=check_output_axes(options.get("output_axes")),
        distributed=distributed,
        safety=safety,
        fallback=fallback.name if fallback is not None else None,
    )
    check_signature(forward, [*plan.inputs, *plan.schedule.variants], plan.phase)
    return plan, backend, fallback


def _fallback_backend(
    phase: str, resolved: ResolvedPhase, backend: DeviceGraphBackend, platform: GraphPlatform
) -> DeviceGraphBackend | None:
    """The second graph set's backend: the flag's ``fallback`` mode, unless the phase resolved to it
    (or to no graphs at all). It gets the phase's options but the compiler (a fallback runs uncompiled)."""
    name = resolved.config.fallback
    if name is None:
        return None
    if not backend.uses_graphs or name == backend.name or name == SpecialMode.EAGER.value:
        logger.info(
            "devgraph: %s: fallback %s dropped, the phase runs %s (downgrades: %s)",
            phase,
            name,
            backend.name,
            ", ".join(d.rule for d in resolved.downgrades) or "none",
        )
        return None
    options = {k: v for k, v in resolved.backend_options().items() if k not in ("compiler", "inductor_mode")}
    return build_backend(platform, phase, name, options=options)
