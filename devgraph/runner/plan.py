"""Set-up steps of a :class:`~devgraph.runner.graph_runner.GraphRunner` that run once: the flag and the
backend resolved, the inputs checked, the device and the warm-up count chosen."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.inputs import StaticInput
from devgraph.errors import ConfigError
from devgraph.flag.config import DeviceGraphConfig
from devgraph.flag.factory import ResolvedPhase, create_backend, resolve_phase, resolve_platform
from devgraph.messages import shorten
from devgraph.registry.plugins import get_registry

__all__ = ["check_inputs", "resolve_backend", "runner_device", "warmup_count"]


def resolve_backend(
    phase: str,
    device: torch.device | str | None,
    mode: str | None,
    config: DeviceGraphConfig | str | None,
    compiler: str | None,
    features: Mapping[str, Any] | None,
    backend: DeviceGraphBackend | None,
) -> tuple[DeviceGraphConfig, ResolvedPhase, DeviceGraphBackend]:
    """The runner's parsed flag, its phase's resolution (``auto`` and the rules applied, once) and its
    backend: the one given, or one built for the resolved mode on the device's platform."""
    if mode is not None and config is not None:
        raise ConfigError("pass either mode= (one strategy name) or config= (a --device-graph-mode value)")
    if backend is not None and not isinstance(backend, DeviceGraphBackend):
        raise ConfigError(f"backend= must be a DeviceGraphBackend instance, got {shorten(backend)}")
    platform = backend.platform if backend is not None else resolve_platform(device)
    if not isinstance(config, DeviceGraphConfig):
        config = DeviceGraphConfig.parse(config if config is not None else (mode or "auto"))
    resolved = resolve_phase(config, phase, platform.name, features)
    if backend is None:
        options = resolved.backend_options()
        compiles = get_registry().accepts_compiler(platform.name, resolved.backend)
        if compiler is not None and "compiler" not in options and compiles:
            options["compiler"] = compiler
        backend = create_backend(
            device or platform.default_device(), phase, resolved.backend, options=options
        )
    return config, resolved, backend


def check_inputs(phase: str, inputs: Any, reserved: frozenset[str]) -> dict[str, StaticInput]:
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
    return dict(inputs)


def runner_device(device: torch.device | str | None, platform: Any) -> torch.device:
    default = platform.default_device()
    if device is None:
        return default
    chosen = torch.device(device)
    if chosen.index is None and chosen.type == default.type:
        return default
    return chosen


def warmup_count(configured: int | None, given: int | None, platform: Any) -> int:
    value = configured if configured is not None else given
    if value is None:
        return int(getattr(platform, "warmup_iters", 2))
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 16:
        raise ConfigError(f"warmup_iters must be an int in [0, 16], got {shorten(value)}")
    return value
