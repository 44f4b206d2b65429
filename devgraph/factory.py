"""``create_backend``: the one place that turns (device, phase, mode) into a backend instance."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from devgraph.backend import BackendOptions, DeviceGraphBackend
from devgraph.errors import BackendUnavailableError, ConfigError
from devgraph.phases import check_phase
from devgraph.platform import GraphPlatform
from devgraph.plugins import Registry, get_registry
from devgraph.strategies.eager import EagerBackend

__all__ = ["create_backend", "resolve_platform", "best_platform", "resolve_mode"]

#: Modes that mean "no graphs" on every platform.
EAGER_MODES = ("eager", "disabled")


def best_platform(registry: Registry | None = None) -> GraphPlatform:
    """The usable platform with the highest priority (an accelerator if one is present, else ``cpu``)."""
    registry = registry or get_registry()
    candidates = sorted(registry.platforms, key=lambda n: -registry.platforms[n].cls.priority)
    reasons = []
    for name in candidates:
        try:
            platform = registry.platform(name)
            availability = platform.availability()
        except Exception as exc:  # a broken vendor platform must not hide the others
            reasons.append(f"{name}: {exc}")
            continue
        if availability:
            return platform
        reasons.append(f"{name}: {availability.reason}")
    raise BackendUnavailableError("no usable platform: " + "; ".join(reasons))


def resolve_platform(device: torch.device | str | None, registry: Registry | None = None) -> GraphPlatform:
    """The platform that owns ``device`` (``None``: the best platform present)."""
    registry = registry or get_registry()
    if device is None:
        return best_platform(registry)
    device = torch.device(device)
    matching = []
    for name in registry.platforms:
        try:
            platform = registry.platform(name)
            if platform.matches(device):
                matching.append(platform)
        except Exception:
            continue
    if not matching:
        raise BackendUnavailableError(
            f"no registered platform handles device {str(device)!r} (platforms: "
            f"{', '.join(sorted(registry.platforms))}); install the vendor plug-in (e.g. devgraph-cuda) "
            "or run `devgraph info` to see which plug-ins failed to load"
        )
    return max(matching, key=lambda p: p.priority)


def resolve_mode(platform: str, phase: str, mode: str, registry: Registry | None = None) -> str:
    """The concrete backend name for ``mode`` (``auto`` -> the platform's default for ``phase``)."""
    registry = registry or get_registry()
    if mode in EAGER_MODES:
        return "eager"
    if mode != "auto":
        return mode
    spec = registry.default_spec(platform, phase)
    return spec.name if spec is not None else "eager"


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
    name (``full``, ``breakable``, ``tc_piecewise``, or one a plug-in registered). Raises
    :class:`BackendUnavailableError` saying what is missing when the backend cannot run here.
    """
    registry = registry or get_registry()
    check_phase(phase)
    platform = resolve_platform(device, registry)
    if isinstance(options, Mapping):
        known = {"compiler"}
        options = BackendOptions(
            compiler=options.get("compiler"), extra={k: v for k, v in options.items() if k not in known}
        )
    name = resolve_mode(platform.name, phase, mode, registry)
    if name == "eager":
        return EagerBackend(platform, phase=phase, options=options)
    spec = registry.backends.get((platform.name, name))
    if spec is None:
        available = sorted(n for (p, n) in registry.backends if p == platform.name)
        everywhere = registry.backend_names()
        hint = "" if name in everywhere else f"; known modes anywhere: {', '.join(everywhere + ['eager'])}"
        raise BackendUnavailableError(
            f"no backend {name!r} for platform {platform.name!r} (available there: "
            f"{', '.join(available + ['eager'])}){hint}"
        )
    if phase not in spec.phases:
        raise ConfigError(
            f"backend {platform.name}:{name} does not support phase {phase!r} "
            f"(it supports {', '.join(sorted(spec.phases))})"
        )
    availability = spec.cls.availability(platform)
    if not availability:
        raise BackendUnavailableError(
            f"backend {platform.name}:{name} cannot run here: {availability.reason}"
        )
    return spec.cls(platform, phase=phase, options=options)
