"""``devgraph info``: platforms, plug-ins with their origin, backends per platform and phase, and why not."""

from __future__ import annotations

import json
from typing import Any

import torch

from devgraph.phases import PHASES
from devgraph.platform import Availability
from devgraph.plugins import Registry, get_registry

__all__ = ["collect_info", "run_info"]


def _platform_status(registry: Registry, name: str) -> tuple[Availability, str]:
    try:
        platform = registry.platform(name)
        availability = platform.availability()
        return availability, (platform.describe() if availability else name)
    except Exception as exc:
        return Availability(False, f"detection failed: {type(exc).__name__}: {exc}"), name


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
    for (platform_name, name), spec in sorted(registry.backends.items()):
        try:
            availability = spec.cls.availability(registry.platform(platform_name))
        except Exception as exc:
            availability = Availability(False, f"availability check failed: {type(exc).__name__}: {exc}")
        backends.append(
            {
                "platform": platform_name,
                "name": name,
                "phases": sorted(spec.phases),
                "default_for": sorted(spec.default_for),
                "origin": spec.origin,
                "usable": availability.usable,
                "reason": availability.reason,
                "class": spec.cls.__qualname__,
            }
        )
    plugins = [
        {"name": p.name, "origin": p.origin, "status": p.status, "error": p.error, "provides": p.provides}
        for p in registry.plugins
    ]
    return {
        "torch": torch.__version__,
        "platforms": platforms,
        "backends": backends,
        "plugins": plugins,
        "rules": [r.name for r in registry.rules],
        "phases": list(PHASES),
    }


def run_info(*, as_json: bool = False) -> int:
    info = collect_info()
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"devgraph on torch {info['torch']}\n")
    print("Plug-ins:")
    for p in info["plugins"]:
        line = f"  {p['name']:<12} {p['status']:<8} {p['origin']}"
        print(line + (f"\n               error: {p['error']}" if p["error"] else ""))
    print("\nPlatforms:")
    for p in info["platforms"]:
        state = "usable" if p["usable"] else f"unusable: {p['reason']}"
        print(f"  {p['name']:<8} {state}  [from {p['origin']}]")
    print("\nBackends (platform:mode  phases  default for):")
    for b in info["backends"]:
        state = "usable" if b["usable"] else f"unusable: {b['reason']}"
        default = ",".join(b["default_for"]) or "-"
        print(f"  {b['platform'] + ':' + b['name']:<24} {','.join(b['phases']):<24} {default:<16} {state}")
    print("  *:eager                 every phase (no graphs; selected by 'disabled')")
    print(f"\nCompatibility rules: {', '.join(info['rules'])}")
    return 0
