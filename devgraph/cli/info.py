"""``devgraph info``: platforms, plug-ins with their origin, backends per platform and phase, and why not."""

from __future__ import annotations

import json
import platform as host
from typing import Any

import torch

from devgraph import (
    PHASES,
    Availability,
    BackendUnavailableError,
    DeviceGraphBackend,
    __version__,
    get_registry,
)
from devgraph.contract.platform import ask_availability
from devgraph.flag.factory import auto_phases
from devgraph.registry.plugins import Registry

__all__ = ["collect_info", "run_info"]


def _platform_status(registry: Registry, name: str) -> tuple[Availability, str]:
    """A platform's availability (asked defensively: a plug-in's bug makes it unusable, with why)."""
    try:
        platform = registry.platform(name)
    except BackendUnavailableError as exc:
        return Availability(False, str(exc)), name
    availability = ask_availability(platform.availability)
    if not availability:
        return availability, name
    description = ask_availability(lambda: Availability(True, str(platform.describe())))
    return availability, description.reason if description else name


def _backend_status(registry: Registry, platform_name: str, cls: type[DeviceGraphBackend]) -> Availability:
    try:
        platform = registry.platform(platform_name)
    except BackendUnavailableError as exc:
        return Availability(False, str(exc))
    return ask_availability(lambda: cls.availability(platform))


def _owner_name(registry: Registry, rule: Any) -> str:
    owner = registry.rule_owner(rule)
    return owner.name if owner is not None else "direct"


def collect_info(registry: Registry | None = None) -> dict[str, Any]:
    """Everything ``devgraph info`` prints, as data."""
    registry = registry or get_registry()
    platforms = []
    for name, spec in sorted(registry.platforms.items()):
        availability, description = _platform_status(registry, name)
        platforms.append(
            {
                "name": name,
                "origin": spec.origin,
                "usable": availability.usable,
                "reason": availability.reason,
                "description": description,
            }
        )
    backends = []
    for (platform_name, name), backend_spec in sorted(registry.backends.items()):
        availability = _backend_status(registry, platform_name, backend_spec.cls)
        backends.append(
            {
                "platform": platform_name,
                "name": name,
                "phases": sorted(backend_spec.phases),
                "default_for": sorted(auto_phases(platform_name, name, registry)),
                "origin": backend_spec.origin,
                "usable": availability.usable,
                "reason": availability.reason,
                "class": backend_spec.cls.__qualname__,
            }
        )
    plugins = [
        {
            "name": p.name,
            "origin": p.origin,
            "status": p.status,
            "error": p.error,
            "provides": list(p.provides),
            "problems": list(p.problems),
        }
        for p in registry.plugins
    ]
    return {
        "devgraph": __version__,
        "torch": torch.__version__,
        "python": host.python_version(),
        "platforms": platforms,
        "backends": backends,
        "plugins": plugins,
        "rules": [r.name for r in registry.rules],
        "rule_origins": {r.name: _owner_name(registry, r) for r in registry.rules},
        "phases": list(PHASES),
    }


def run_info(*, as_json: bool = False) -> int:
    info = collect_info()
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"devgraph {info['devgraph']} on torch {info['torch']}, Python {info['python']}\n")
    print("Plug-ins:")
    for p in info["plugins"]:
        print(f"  {p['name']:<12} {p['status']:<8} {p['origin']}")
        if p["error"]:
            print(f"               error: {p['error']}")
        for problem in p["problems"]:
            print(f"               problem: {problem}")
    print("\nPlatforms:")
    width = max((len(p["name"]) for p in info["platforms"]), default=8)
    for p in info["platforms"]:
        state = "usable" if p["usable"] else f"unusable: {p['reason']}"
        print(f"  {p['name']:<{width}} {state}  [from {p['origin']}]")
    print("\nBackends (platform:mode  phases  default for):")
    for b in info["backends"]:
        state = "usable" if b["usable"] else f"unusable: {b['reason']}"
        default = ",".join(b["default_for"]) or "-"
        print(f"  {b['platform'] + ':' + b['name']:<25} {','.join(b['phases']):<24} {default:<16} {state}")
    print("  *:eager                  every phase (no graphs; selected by 'disabled')")
    rules = ", ".join(f"{name} ({info['rule_origins'][name]})" for name in info["rules"])
    print(f"\nCompatibility rules: {rules}")
    return 0
