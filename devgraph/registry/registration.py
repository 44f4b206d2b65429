"""What the registry accepts from plug-ins and what it records about them.

Checks on platform and backend classes and their names, the choice among entry points that share a name,
and the records (:class:`BackendSpec`, :class:`PlatformSpec`, :class:`PluginRecord`) the registry keeps.

A name a user types in ``--device-graph-mode`` or ``PLATFORM:NAME`` must survive that grammar
(:data:`~devgraph.contract.modes.MODE_NAME_PATTERN`) and must not be a special mode; a class must be complete
(no abstract method left), so a broken plug-in is refused when it registers, not when a runner starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.modes import MODE_NAME_PATTERN, SPECIAL_MODES
from devgraph.contract.phases import PHASES
from devgraph.contract.platform import GraphPlatform
from devgraph.errors import RegistrationError
from devgraph.messages import shorten
from devgraph.registry.rules import CompatibilityRule

__all__ = [
    "BackendSpec",
    "PlatformSpec",
    "PluginRecord",
    "RegistryState",
    "check_backend",
    "check_name",
    "check_platform",
    "dist_label",
    "isolated",
    "select_entry_points",
]

#: A plug-in's run-time problems kept for ``devgraph info`` (the oldest are dropped past this).
_MAX_PROBLEMS = 20


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend: mode ``name`` on ``platform``, usable for ``phases``."""

    name: str
    platform: str
    cls: type[DeviceGraphBackend]
    phases: frozenset[str]
    default_for: frozenset[str]
    origin: str


@dataclass(frozen=True)
class PlatformSpec:
    """A registered platform class and where it came from."""

    name: str
    cls: type[GraphPlatform]
    origin: str


@dataclass
class PluginRecord:
    """One plug-in as ``devgraph info`` shows it.

    ``status`` is ``loaded``, ``failed`` (``error`` says why; nothing of it stays registered) or
    ``skipped``. ``problems`` lists what went wrong after loading (a rule predicate that raised, a
    registration the plug-in caught and ignored).
    """

    name: str
    origin: str
    status: str
    error: str = ""
    provides: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def add_problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)
            del self.problems[:-_MAX_PROBLEMS]


def check_name(name: object, what: str, *, special_ok: bool = False) -> str:
    """``name`` if it is flag-safe (lowercase letters, digits, ``_``; a letter first; at most 64)."""
    if not isinstance(name, str) or not MODE_NAME_PATTERN.fullmatch(name):
        raise RegistrationError(
            f"{what} {shorten(name)} is not a valid name: names are strings of lowercase letters, digits "
            "and '_', starting with a letter, at most 64 characters (they are typed in --device-graph-mode "
            "and PLATFORM:NAME)"
        )
    if not special_ok and name in SPECIAL_MODES:
        raise RegistrationError(
            f"{what} {name!r} is reserved: {', '.join(SPECIAL_MODES)} mean something of their own in "
            "--device-graph-mode; register under a strategy name (full, breakable, tc_piecewise) or your own"
        )
    return name


def _abstract_left(cls: type) -> str:
    return ", ".join(sorted(getattr(cls, "__abstractmethods__", ()))) or "?"


def check_platform(cls: object) -> str:
    """The platform's name if ``cls`` is a complete :class:`GraphPlatform` subclass with a valid name."""
    if not (isinstance(cls, type) and issubclass(cls, GraphPlatform)):
        raise RegistrationError(
            f"{shorten(cls)} is not a devgraph.GraphPlatform subclass; platforms derive from it"
        )
    for attribute in ("name", "device_type"):
        if not isinstance(getattr(cls, attribute, None), str):
            raise RegistrationError(
                f"platform class {cls.__qualname__} must set the class attribute {attribute!r} (a string)"
            )
    name = check_name(cls.name, f"platform class {cls.__qualname__}: name")
    check_name(cls.device_type, f"platform {name!r}: device_type", special_ok=True)
    priority = getattr(cls, "priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RegistrationError(f"platform {name!r}: priority must be an int, got {shorten(priority)}")
    if inspect.isabstract(cls):
        raise RegistrationError(
            f"platform {name!r} ({cls.__qualname__}) is incomplete: abstract methods left: "
            f"{_abstract_left(cls)}"
        )
    return name


def _phase_set(value: object, what: str) -> frozenset[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise RegistrationError(f"{what} must be a list of phase names, got {shorten(value)}")
    names = list(value)
    unknown = [n for n in names if not isinstance(n, str) or n not in PHASES]
    if unknown:
        raise RegistrationError(
            f"{what} names unknown phases {shorten(unknown)}; accepted: {', '.join(PHASES)}"
        )
    return frozenset(names)


def check_backend(
    cls: object, name: object, platform: object, phases: object, default_for: object
) -> tuple[str, frozenset[str], frozenset[str]]:
    """``(name, phases, default_for)`` of a valid backend registration; :class:`RegistrationError` naming
    what is wrong otherwise."""
    if not (isinstance(cls, type) and issubclass(cls, DeviceGraphBackend)):
        raise RegistrationError(
            f"{shorten(cls)} is not a DeviceGraphBackend subclass; backends must derive from it"
        )
    name = cls.name if name is None else name
    platform = check_name(platform, f"backend {shorten(name)}: platform")
    name = check_name(name, f"backend name for platform {platform!r}:")
    label = f"backend {platform}:{name}"
    if inspect.isabstract(cls):
        raise RegistrationError(
            f"{label} ({cls.__qualname__}) is not a complete DeviceGraphBackend: abstract methods left: "
            f"{_abstract_left(cls)}"
        )
    phases_set = _phase_set(phases, f"{label} phases=")
    default_set = _phase_set(default_for, f"{label} default_for=")
    if not default_set <= phases_set:
        raise RegistrationError(
            f"{label} is default_for {sorted(default_set - phases_set)} but does not list those phases "
            "in phases="
        )
    return name, phases_set, default_set


@dataclass
class RegistryState:
    """Everything loading produced. Containers are replaced, never mutated, so readers need no lock."""

    platforms: dict[str, PlatformSpec] = field(default_factory=dict)
    backends: dict[tuple[str, str], BackendSpec] = field(default_factory=dict)
    rules: tuple[CompatibilityRule, ...] = ()
    rule_owners: dict[int, PluginRecord] = field(default_factory=dict)
    plugins: list[PluginRecord] = field(default_factory=list)

    def snapshot(self) -> tuple[Any, ...]:
        return self.platforms, self.backends, self.rules, self.rule_owners

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        self.platforms, self.backends, self.rules, self.rule_owners = snapshot


def isolated(exc: BaseException) -> bool:
    """Whether a plug-in's exception stays inside the plug-in (everything but Ctrl-C)."""
    return not isinstance(exc, KeyboardInterrupt)


def _dist_name(ep: Any) -> str | None:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    try:
        return str(getattr(dist, "name", None) or dist.metadata["Name"])
    except Exception:
        return None


def dist_label(ep: Any) -> str:
    """``"devgraph-toy 0.1 (entry point toy = devgraph_toy)"``: where an entry point comes from."""
    name = _dist_name(ep)
    if name is not None:
        return f"{name} {getattr(ep.dist, 'version', '?')} (entry point {ep.name} = {ep.value})"
    return f"entry point {ep.name} = {ep.value}"


def select_entry_points(
    eps: Iterable[Any], allowed: set[str] | None, reserved: Mapping[str, str]
) -> list[tuple[Any, str, str]]:
    """``(entry point, verdict, reason)`` for each distinct entry point, in load order.

    The verdict is ``load``, ``skipped`` (not in ``allowed``) or ``failed``: a name in ``reserved`` (the
    built-in plug-in's) or one an earlier entry point took (sorted by name, then distribution) shadows
    that one and is not loaded. The same distribution seen twice on ``sys.path`` is listed once.
    """
    ordered = sorted(eps, key=lambda e: (str(e.name), _dist_name(e) or "", str(e.value)))
    first: dict[str, Any] = {}
    verdicts: list[tuple[Any, str, str]] = []
    for ep in ordered:
        name = str(ep.name)
        winner = first.get(name)
        if name in reserved:
            verdicts.append((ep, "failed", f"shadows {name} from {reserved[name]}"))
        elif winner is not None:
            if (_dist_name(winner), winner.value) != (_dist_name(ep), ep.value):
                verdicts.append((ep, "failed", f"shadows {name} from {_dist_name(winner) or winner.value}"))
        else:
            first[name] = ep
            if allowed is not None and name not in allowed:
                verdicts.append((ep, "skipped", "not listed in DEVGRAPH_PLUGINS"))
            else:
                verdicts.append((ep, "load", ""))
    return verdicts
