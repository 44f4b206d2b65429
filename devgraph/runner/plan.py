"""A runner's plan: the flag and the constructor's arguments resolved once, typed and frozen.

:func:`plan_runner` checks every argument the way the flag's values are checked (a compiler the strategy
would ignore, or one that does not exist, is a :class:`~devgraph.errors.ConfigError` naming what is
accepted), lets the flag win over an argument wherever both give a value (:func:`flag_over_arguments`, the
one place that rule is written), resolves ``auto`` and the compatibility rules, builds the backend and the
key schedule. The runner and its parts read the :class:`RunnerPlan`; nothing reads the flag again.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.inputs import StaticInput
from devgraph.contract.keys import GraphKey
from devgraph.contract.modes import SpecialMode
from devgraph.contract.phases import Phase
from devgraph.contract.platform import GraphPlatform
from devgraph.errors import ConfigError
from devgraph.flag.config import DeviceGraphConfig, PhaseConfig
from devgraph.flag.factory import ResolvedPhase, create_backend, resolve_phase, resolve_platform
from devgraph.flag.values import check_field
from devgraph.messages import shorten
from devgraph.runner.outputs.layout import check_output_axes
from devgraph.runner.schedule import AxisSizes, KeySchedule, schedule_for
from devgraph.runner.state import DeclaredState, as_state

__all__ = [
    "FLAG_KEYS",
    "CapturePlan",
    "LazyPolicy",
    "RunnerPlan",
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
class RunnerPlan:
    """Everything a runner resolved once. ``flag`` is ``--device-graph-mode`` as given (``mode=`` is a flag
    naming one mode); ``resolved`` is the phase's backend after ``auto`` and the compatibility rules, with
    its settings (``resolved.config``: the flag over the arguments)."""

    phase: str
    inputs: Mapping[str, StaticInput]
    platform: GraphPlatform
    device: torch.device
    flag: DeviceGraphConfig
    resolved: ResolvedPhase
    schedule: KeySchedule
    capture: CapturePlan
    output_axes: Sequence[str | None] | Mapping[str, str | None] | None
    state: DeclaredState
    process_group: Any
    check_lockstep: bool
    single_thread: bool
    #: The second graph set's mode (``None``: steps the backend declines run eagerly).
    fallback: str | None = None
    #: The data-parallel group whose ranks agree on one key per step (``None``: none).
    dp_group: Any = None
    #: Whether the address guard watches the memory the graphs use.
    address_guard: bool = True

    @property
    def tokens_per_request(self) -> int | None:
        return self.schedule.tokens_per_request


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


def plan_runner(
    *,
    phase: str,
    inputs: Any,
    reserved: frozenset[str],
    device: torch.device | str | None,
    backend: DeviceGraphBackend | None,
    features: Mapping[str, Any] | None,
    mode: str | None,
    config: DeviceGraphConfig | str | None,
    arguments: Mapping[str, Any],
    axes: Mapping[str, AxisSizes] | None,
    tokens_per_request: int | None,
    variants: Mapping[str, Sequence[Hashable]] | None,
    capture_context: Callable[[GraphKey], Any] | None,
    capture_hook: Callable[[], Any] | None,
    progress: bool | None,
    process_group: Any,
    state: Any,
    output_axes: Any,
    check_lockstep: bool,
    single_thread: bool,
    dp_group: Any = None,
    address_guard: bool = True,
) -> tuple[RunnerPlan, DeviceGraphBackend, DeviceGraphBackend | None]:
    """The plan of a runner, its backend (the one given, or one built for the resolved mode) and the
    fallback graph set's backend (``None`` without a fallback)."""
    step_phase = Phase.parse(phase)
    phase = step_phase.value
    specs = _inputs(phase, inputs, reserved)
    flag = _flag(mode, config)
    given = _arguments(phase, arguments)
    _check("progress", progress, progress is None or isinstance(progress, bool), "True, False or None")
    _check("check_lockstep", check_lockstep, isinstance(check_lockstep, bool), "True or False")
    _check("single_thread", single_thread, isinstance(single_thread, bool), "True or False")
    _check("address_guard", address_guard, isinstance(address_guard, bool), "True or False")
    for name, hook in (("capture_context", capture_context), ("capture_hook", capture_hook)):
        _check(name, hook, hook is None or callable(hook), "a callable or None")
    if backend is not None:
        _check("backend", backend, isinstance(backend, DeviceGraphBackend), "a DeviceGraphBackend instance")
        if "compiler" in given:
            raise ConfigError(
                "compiler= applies to the backend the runner builds; a backend= given is built already "
                "(pass the compiler in its options: devgraph.create_backend(..., options={'compiler': ...}))"
            )
    platform = backend.platform if backend is not None else resolve_platform(device)
    settings = flag_over_arguments(flag.for_phase(phase), given)
    try:
        resolved = resolve_phase(
            DeviceGraphConfig({**flag.phases, phase: settings}, flag.source), phase, platform.name, features
        )
    except ConfigError as exc:  # say which of the settings it names came from the runner's arguments
        from_arguments = {k: v for k, v in given.items() if getattr(flag.for_phase(phase), k) is None}
        joined = ", ".join(f"{k}={v!r}" for k, v in from_arguments.items() if k in str(exc))
        if not joined:
            raise
        raise ConfigError(f"{exc} (the runner's arguments set {joined})") from None
    if backend is None:
        target = device or platform.default_device()
        backend = create_backend(target, phase, resolved.backend, options=resolved.backend_options())
    chosen = resolved.config
    fallback = _fallback_backend(phase, resolved, backend, device or platform.default_device())
    warmups = chosen.warmup_iters if chosen.warmup_iters is not None else int(platform.warmup_iters)
    plan = RunnerPlan(
        phase=phase,
        inputs=specs,
        platform=platform,
        device=_device(device, platform),
        flag=flag,
        resolved=resolved,
        schedule=schedule_for(step_phase, specs, platform, chosen, axes, tokens_per_request, variants),
        capture=CapturePlan(
            warmup_iters=warmups,
            context=capture_context,
            hook=capture_hook,
            progress=progress,
            lazy=bool(chosen.lazy),
            lazy_policy=LazyPolicy(chosen.max_graphs, chosen.max_graph_bytes),
        ),
        output_axes=check_output_axes(output_axes),
        state=as_state(state),
        process_group=process_group,
        check_lockstep=check_lockstep,
        single_thread=single_thread,
        fallback=fallback.name if fallback is not None else None,
        dp_group=dp_group,
        address_guard=address_guard,
    )
    return plan, backend, fallback


def _fallback_backend(
    phase: str, resolved: ResolvedPhase, backend: DeviceGraphBackend, device: Any
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
    return create_backend(device, phase, name, options=options)
