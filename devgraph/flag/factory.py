"""Resolution and construction, in one place: device -> platform, (phase, flag, features) -> backend name
with its downgrades, and (platform, phase, name) -> a backend instance.

A runner calls :func:`resolve_platform` and :func:`resolve_phase` once, then :func:`create_backend`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.contract.backend import BackendOptions, DeviceGraphBackend
from devgraph.contract.modes import EAGER_MODES, SpecialMode
from devgraph.contract.phases import Phase, check_phase
from devgraph.contract.platform import Availability, GraphPlatform, ask_availability
from devgraph.errors import BackendUnavailableError, ConfigError
from devgraph.flag.config import FLAG, DeviceGraphConfig, PhaseConfig
from devgraph.flag.values import check_backend_options, compiler_ignored
from devgraph.messages import shorten
from devgraph.registry.plugins import Registry, get_registry
from devgraph.registry.rules import Downgrade, apply_rules
from devgraph.strategies.eager import EagerBackend

__all__ = [
    "PLATFORM_ENV",
    "ResolvedPhase",
    "auto_mode",
    "auto_phases",
    "best_platform",
    "build_backend",
    "create_backend",
    "platform_availability",
    "preferred_platform",
    "resolve_mode",
    "resolve_phase",
    "resolve_platform",
    "usable_platform",
]

logger = logging.getLogger(__name__)

#: Names the platform to prefer for the devices it handles over the one their priority picks
#: (``DEVGRAPH_PLATFORM=accelerator``: torch.accelerator graphs on a GPU a vendor plug-in also claims).
PLATFORM_ENV = "DEVGRAPH_PLATFORM"

#: The keys of ``create_backend(options=...)`` that :class:`BackendOptions` types; the rest go to ``extra``.
_TYPED_OPTIONS = ("compiler", "inductor_mode", "on_recompile", "cache_dir")


@dataclass(frozen=True)
class ResolvedPhase:
    """A phase's final choice after ``auto`` and the compatibility rules were applied.

    ``config`` is the phase's :class:`PhaseConfig`; when a rule moved the phase to a backend that does not
    compile, its ``compiler`` / ``inductor_mode`` are cleared here (the downgrade's warning says so).
    """

    phase: str
    platform: str
    backend: str
    config: PhaseConfig
    downgrades: tuple[Downgrade, ...] = ()
    #: Why ``auto`` chose no graphs (``None``: it chose a graph mode, or the flag named the mode).
    eager_reason: str | None = None

    def backend_options(self) -> dict[str, Any]:
        """What ``create_backend(options=...)`` takes for this phase."""
        return self.config.backend_options()


def platform_availability(platform: GraphPlatform) -> Availability:
    """``platform.availability()``, asked defensively (a bool or an exception is unusable, with why)."""
    return ask_availability(platform.availability)


def preferred_platform(registry: Registry) -> str | None:
    """The platform ``DEVGRAPH_PLATFORM`` names (``None`` when unset); a name no plug-in registered is a
    :class:`ConfigError`, never ignored."""
    name = os.environ.get(PLATFORM_ENV, "").strip()
    if not name:
        return None
    if name not in registry.platforms:
        raise ConfigError(
            f"{PLATFORM_ENV}={shorten(name)} names no registered platform (registered: "
            f"{', '.join(sorted(registry.platforms))}); name one of them or unset it"
        )
    return name


def best_platform(registry: Registry | None = None) -> GraphPlatform:
    """The usable platform with the highest priority (an accelerator if one is present, else ``cpu``), or
    the one ``DEVGRAPH_PLATFORM`` names, which must then be usable."""
    registry = registry or get_registry()
    preferred = preferred_platform(registry)
    if preferred is not None:
        platform = registry.platform(preferred)
        availability = platform_availability(platform)
        if not availability:
            raise BackendUnavailableError(
                f"{PLATFORM_ENV}={preferred}: platform {preferred!r} is unusable here: {availability.reason}"
            )
        return platform
    candidates = sorted(registry.platforms, key=lambda n: -registry.platforms[n].cls.priority)
    reasons = []
    for name in candidates:
        try:
            platform = registry.platform(name)
        except BackendUnavailableError as exc:  # a broken vendor platform must not hide the others
            reasons.append(f"{name}: {exc}")
            continue
        availability = platform_availability(platform)
        if availability:
            return platform
        reasons.append(f"{name}: {availability.reason}")
    raise BackendUnavailableError("no usable platform: " + "; ".join(reasons))


def _matches(platform: GraphPlatform, device: torch.device) -> bool:
    try:
        return bool(platform.matches(device))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a plug-in's broken matches() must not hide the other platforms
        logger.warning(
            "devgraph: platform %r: matches(%s) raised %s: %s", platform.name, device, type(exc), exc
        )
        return False


def _unknown_device(text: str, registry: Registry) -> Exception:
    """A device string torch does not know: a registered platform may still own its type (``npu`` before
    torch-npu is installed); then its availability reason (the install hint) says what to do."""
    device_type = text.split(":", 1)[0].strip()
    for name, spec in sorted(registry.platforms.items()):
        if getattr(spec.cls, "device_type", None) == device_type:
            try:
                availability = platform_availability(registry.platform(name))
            except BackendUnavailableError as exc:
                availability = Availability(False, str(exc))
            reason = availability.reason or "torch does not know this device type here"
            return BackendUnavailableError(
                f"device {shorten(text)}: platform {name!r} is unusable here: {reason}"
            )
    types = sorted({str(getattr(s.cls, "device_type", "?")) for s in registry.platforms.values()})
    return ConfigError(
        f"device {shorten(text)} is not a torch device; "
        f"devices of registered platforms: {', '.join(types)} (with an index: cuda:0)"
    )


def resolve_platform(device: torch.device | str | None, registry: Registry | None = None) -> GraphPlatform:
    """The platform that owns ``device`` (``None``: the best platform present).

    Each registered platform is asked ``matches(device)`` (ROCm owns ``cuda`` devices on a ROCm build of
    torch); the one ``DEVGRAPH_PLATFORM`` names wins among them, else the highest priority.
    :class:`ConfigError` when ``device`` is not a device at all, :class:`BackendUnavailableError` when no
    platform owns it.
    """
    registry = registry or get_registry()
    if device is None:
        return best_platform(registry)
    if not isinstance(device, torch.device):
        if not isinstance(device, str):
            raise ConfigError(
                f"device must be a torch.device or a string such as 'cuda:0', got {shorten(device)}"
            )
        text = device
        try:
            device = torch.device(text)
        except (RuntimeError, ValueError):
            raise _unknown_device(text, registry) from None
    matching = []
    for name in registry.platforms:
        try:
            platform = registry.platform(name)
        except BackendUnavailableError:
            continue
        if _matches(platform, device):
            matching.append(platform)
    if not matching:
        raise BackendUnavailableError(
            f"no registered platform handles device {str(device)!r} (platforms: "
            f"{', '.join(sorted(registry.platforms))}); install the vendor plug-in (e.g. devgraph-cuda) "
            "or run `devgraph info` to see which plug-ins failed to load"
        )
    preferred = preferred_platform(registry)
    chosen = [p for p in matching if p.name == preferred]
    return chosen[0] if chosen else max(matching, key=lambda p: p.priority)


def usable_platform(device: torch.device | str | None, *, flag: str = "--device") -> GraphPlatform:
    """:func:`resolve_platform`, then a check that the platform is usable here: one
    :class:`BackendUnavailableError` naming ``flag``, the platform and why not (the reason ``devgraph info``
    gives), before anything allocates on a device that cannot work (``cuda`` on a CPU-only torch)."""
    platform = resolve_platform(device)
    if device is None:
        return platform  # the best platform present, usable by construction
    availability = platform_availability(platform)
    if not availability:
        raise BackendUnavailableError(
            f"{flag} {shorten(str(device))}: platform {platform.name!r} is unusable here: "
            f"{availability.reason}"
        )
    return platform


def auto_mode(platform: str, phase: str, registry: Registry | None = None) -> tuple[str, str | None]:
    """What ``auto`` picks for ``phase`` on ``platform``, and why when that is ``eager`` (else ``None``).

    In order: the backend the platform's plug-in names the default for the phase (``default_for=``); the
    phase's :attr:`~devgraph.contract.phases.PhaseSpec.default_mode` where the platform registers it for
    the phase; then the same for the phase it is ``like`` (verify: decode). Only when none of them runs
    the phase here does ``auto`` mean no graphs, and the reason names what was looked for."""
    registry = registry or get_registry()
    wanted = Phase.parse(phase)
    looked: list[str] = []
    current: Phase | None = wanted
    while current is not None:
        named = registry.default_spec(platform, current.value)
        if named is not None and wanted.value in named.phases:
            return named.name, None
        mode = current.spec.default_mode
        spec = registry.backends.get((platform, mode))
        if spec is not None and wanted.value in spec.phases:
            return mode, None
        looked.append(f"{mode!r} ({current}'s default)")
        current = current.spec.like
    reason = (
        f"auto runs {wanted} eagerly on {platform}: no backend there takes the phase (looked for "
        f"{' and '.join(looked)}); name a mode that does (devgraph info lists them) or install its plug-in"
    )
    return SpecialMode.EAGER.value, reason


def auto_phases(platform: str, name: str, registry: Registry | None = None) -> list[str]:
    """The phases for which ``auto`` picks backend ``name`` on ``platform`` (``devgraph info`` shows them)."""
    return [p.value for p in Phase if auto_mode(platform, p.value, registry)[0] == name]


def resolve_mode(platform: str, phase: str, mode: str, registry: Registry | None = None) -> str:
    """The concrete backend name for ``mode`` (``auto`` -> :func:`auto_mode`)."""
    if mode in EAGER_MODES:
        return SpecialMode.EAGER.value
    if mode != SpecialMode.AUTO.value:
        return mode
    return auto_mode(platform, phase, registry)[0]


def resolve_phase(
    config: DeviceGraphConfig,
    phase: str,
    platform: str,
    features: Mapping[str, Any] | None = None,
    registry: Registry | None = None,
) -> ResolvedPhase:
    """Pick the concrete backend for ``phase`` on ``platform``: ``auto`` -> default, then the rules.

    Rule predicates see ``features`` plus ``platform`` and ``phase``; one that raises is skipped, logged
    and recorded against its plug-in. ``compiler`` / ``inductor_mode`` set for ``auto`` that resolves to
    a backend that does not compile is a :class:`ConfigError` naming that backend.
    """
    registry = registry or get_registry()
    phase = check_phase(phase)
    if features is not None and not isinstance(features, Mapping):
        raise ConfigError(f"features must be a mapping of feature names to values, got {shorten(features)}")
    phase_config = config.for_phase(phase)
    eager_reason = None
    if phase_config.backend == SpecialMode.AUTO.value:
        backend, eager_reason = auto_mode(platform, phase, registry)
        if eager_reason is not None:
            _say_once(eager_reason)
    else:
        backend = resolve_mode(platform, phase, phase_config.backend, registry)
    compiling = {k: getattr(phase_config, k) for k in ("compiler", "inductor_mode")}
    if registry.accepts_compiler(platform, backend) is False:
        for key, value in compiling.items():
            if value is not None:
                error = compiler_ignored(
                    backend,
                    f"{phase}.",
                    key,
                    value,
                    resolved_from=phase_config.backend,
                    compiling=registry.compiling_names(),
                )
                raise ConfigError(f"{FLAG} {shorten(config.source)} on platform {platform!r}: {error}")
    before = backend
    backend, downgrades = apply_rules(
        phase,
        backend,
        {**(features or {}), "platform": platform},
        registry.rules,
        on_error=registry.report_rule_error,
    )
    if (
        backend != before
        and not registry.accepts_compiler(platform, backend)
        and any(v is not None for v in compiling.values())
    ):
        logger.warning(
            "devgraph: %s phase: %s does not compile, so %s no longer apply after the downgrade",
            phase,
            backend,
            ", ".join(f"{k}={v!r}" for k, v in compiling.items() if v is not None),
        )
        phase_config = dataclasses.replace(phase_config, compiler=None, inductor_mode=None)
    return ResolvedPhase(phase, platform, backend, phase_config, tuple(downgrades), eager_reason)


_said: set[str] = set()


def _say_once(reason: str) -> None:
    """Log ``reason`` the first time this process meets it (every runner of the phase resolves it)."""
    if reason not in _said:
        _said.add(reason)
        logger.warning("devgraph: %s", reason)


def _backend_options(
    options: BackendOptions | Mapping[str, Any] | None, backend: str, compiles: bool
) -> BackendOptions | None:
    if options is None or isinstance(options, BackendOptions):
        return options
    if not isinstance(options, Mapping):
        raise ConfigError(f"backend options must be a mapping or BackendOptions, got {shorten(options)}")
    typed = check_backend_options(options, backend=backend, compiles=compiles)
    extra = {k: v for k, v in options.items() if k not in _TYPED_OPTIONS}
    return BackendOptions(**typed, extra=extra)


def create_backend(
    device: torch.device | str | None = None,
    phase: str = "decode",
    mode: str = "auto",
    *,
    options: BackendOptions | Mapping[str, Any] | None = None,
    registry: Registry | None = None,
) -> DeviceGraphBackend:
    """Build the backend for ``mode`` on ``device``'s platform for ``phase``.

    ``mode`` is ``auto`` (the platform's default for the phase), ``disabled``/``eager``, or a strategy
    name (``full``, ``breakable``, ``tc_piecewise``, or one a plug-in registered). ``options`` maps
    ``compiler``, ``inductor_mode``, ``on_recompile`` and ``cache_dir`` to :class:`BackendOptions`'s
    fields (checked as in the flag) and the rest to its ``extra``. Raises
    :class:`BackendUnavailableError` saying what is missing when the backend cannot run here.
    """
    registry = registry or get_registry()
    phase = check_phase(phase)
    return build_backend(resolve_platform(device, registry), phase, mode, options=options, registry=registry)


def build_backend(
    platform: GraphPlatform,
    phase: str,
    mode: str = "auto",
    *,
    options: BackendOptions | Mapping[str, Any] | None = None,
    registry: Registry | None = None,
) -> DeviceGraphBackend:
    """:func:`create_backend` on a platform resolved already (a runner resolves its platform once)."""
    registry = registry or get_registry()
    phase = check_phase(phase)
    name = resolve_mode(platform.name, phase, mode, registry)
    if name == SpecialMode.EAGER.value:
        return EagerBackend(
            platform, phase=phase, options=_backend_options(options, name, EagerBackend.accepts_compiler)
        )
    spec = registry.backends.get((platform.name, name))
    if spec is None:
        available = sorted(n for (p, n) in registry.backends if p == platform.name)
        everywhere = registry.backend_names()
        hint = "" if name in everywhere else f"; known modes anywhere: {', '.join(everywhere + ['eager'])}"
        raise BackendUnavailableError(
            f"no backend {shorten(name)} for platform {platform.name!r} (available there: "
            f"{', '.join(available + ['eager'])}){hint}"
        )
    backend_options = _backend_options(options, name, spec.cls.accepts_compiler)
    if phase not in spec.phases:
        raise ConfigError(
            f"backend {platform.name}:{name} does not support phase {phase!r} "
            f"(it supports {', '.join(sorted(spec.phases))})"
        )
    availability = ask_availability(lambda: spec.cls.availability(platform))
    if not availability:
        raise BackendUnavailableError(
            f"backend {platform.name}:{name} cannot run here: {availability.reason}"
        )
    return spec.cls(platform, phase=phase, options=backend_options)
