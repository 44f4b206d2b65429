"""The backend and platform registry, fed by pluggy plug-ins.

Built-ins and entry-point plug-ins (group ``devgraph``) load the same way, lazily, once, on the first
question asked of the registry. ``DEVGRAPH_PLUGINS=a,b`` limits which entry points load. A plug-in
that fails to import or to register is reported (logged, and listed by ``devgraph info``) and the rest
keep working. Two registrations of one (platform, name) fail, naming both origins.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import pluggy

from devgraph import hookspecs
from devgraph.backend import DeviceGraphBackend
from devgraph.errors import RegistrationError
from devgraph.phases import PHASES
from devgraph.platform import GraphPlatform
from devgraph.rules import BUILTIN_RULES, CompatibilityRule

__all__ = [
    "BackendSpec",
    "PlatformSpec",
    "PluginRecord",
    "Registry",
    "get_registry",
    "register_backend",
    "reset_registry",
    "ENTRY_POINT_GROUP",
]

logger = logging.getLogger("devgraph.plugins")

ENTRY_POINT_GROUP = "devgraph"
_BUILTIN = "devgraph (built-in)"

B = TypeVar("B", bound=type[DeviceGraphBackend])


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
    """One plug-in as ``devgraph info`` shows it."""

    name: str
    origin: str
    status: str  # "loaded" | "failed" | "skipped"
    error: str = ""
    provides: list[str] = field(default_factory=list)


def _dist_label(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is not None:
        return f"{dist.metadata['Name']} {dist.version} (entry point {ep.name} = {ep.value})"
    return f"entry point {ep.name} = {ep.value}"


class Registry:
    """Platforms, backends and compatibility rules from every plug-in."""

    def __init__(self, *, entry_points: bool = True) -> None:
        self.platforms: dict[str, PlatformSpec] = {}
        self.backends: dict[tuple[str, str], BackendSpec] = {}
        self.rules: list[CompatibilityRule] = list(BUILTIN_RULES)
        self.plugins: list[PluginRecord] = []
        self._instances: dict[str, GraphPlatform] = {}
        self._use_entry_points = entry_points
        self._loaded = False
        self._lock = threading.RLock()
        self.pm = pluggy.PluginManager("devgraph")
        self.pm.add_hookspecs(hookspecs)

    # -- loading ---------------------------------------------------------------------------------
    def load(self) -> Registry:
        """Load built-ins and entry-point plug-ins once; later calls return at once."""
        if self._loaded:
            return self
        with self._lock:
            if self._loaded:
                return self
            self._loaded = True
            from devgraph import _builtin

            self._add_plugin("builtin", _BUILTIN, lambda: _builtin)
            if self._use_entry_points:
                self._load_entry_points()
        return self

    def _load_entry_points(self) -> None:
        allowed_env = os.environ.get("DEVGRAPH_PLUGINS")
        allowed = None if allowed_env is None else {p.strip() for p in allowed_env.split(",") if p.strip()}
        eps = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        seen: set[str] = set()
        for ep in eps:
            if ep.name in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(ep.name)
            if allowed is not None and ep.name not in allowed:
                self.plugins.append(
                    PluginRecord(ep.name, _dist_label(ep), "skipped", "not listed in DEVGRAPH_PLUGINS")
                )
                continue
            self._add_plugin(ep.name, _dist_label(ep), ep.load)

    def _add_plugin(self, name: str, origin: str, load: Callable[[], Any]) -> None:
        record = PluginRecord(name, origin, "loaded")
        self.plugins.append(record)
        try:
            module = load()
            self.pm.register(module, name=name)
        except Exception as exc:
            self._fail(record, f"import failed: {type(exc).__name__}: {exc}", exc)
            return
        for hook_name, register in (
            ("devgraph_register_platforms", self._platform_register(origin, record)),
            ("devgraph_register_backends", self._backend_register(origin, record)),
            ("devgraph_compatibility_rules", self._rule_register(record)),
        ):
            hook = getattr(self.pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                if impl.plugin_name != name:
                    continue
                try:
                    impl.function(register=register)
                except Exception as exc:
                    self._fail(record, f"{hook_name} failed: {type(exc).__name__}: {exc}", exc)

    def _fail(self, record: PluginRecord, message: str, exc: BaseException) -> None:
        record.status = "failed"
        record.error = f"{record.error}; {message}" if record.error else message
        logger.warning(
            "devgraph plug-in %r (%s) %s; other plug-ins keep working", record.name, record.origin, message
        )
        logger.debug("".join(traceback.format_exception(exc)))

    # -- register callbacks handed to hooks ------------------------------------------------------
    def _platform_register(self, origin: str, record: PluginRecord) -> Callable[[type[GraphPlatform]], None]:
        def register(cls: type[GraphPlatform]) -> None:
            self.add_platform(cls, origin=origin)
            record.provides.append(f"platform {cls.name}")

        return register

    def _backend_register(self, origin: str, record: PluginRecord) -> Callable[..., None]:
        def register(
            cls: type[DeviceGraphBackend],
            *,
            name: str | None = None,
            platform: str,
            phases: Iterable[str] = PHASES,
            default_for: Iterable[str] = (),
        ) -> None:
            spec = self.add_backend(
                cls, name=name, platform=platform, phases=phases, default_for=default_for, origin=origin
            )
            record.provides.append(f"backend {spec.platform}:{spec.name}")

        return register

    def _rule_register(self, record: PluginRecord) -> Callable[[CompatibilityRule], None]:
        def register(rule: CompatibilityRule) -> None:
            self.rules.append(rule)
            record.provides.append(f"rule {rule.name}")

        return register

    # -- mutation --------------------------------------------------------------------------------
    def add_platform(self, cls: type[GraphPlatform], *, origin: str) -> PlatformSpec:
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise RegistrationError(f"platform class {cls!r} must set a non-empty class attribute 'name'")
        with self._lock:
            existing = self.platforms.get(name)
            if existing is not None:
                raise RegistrationError(
                    f"platform {name!r} is registered twice: by {existing.origin} and by {origin}; "
                    "uninstall one of them or limit plug-ins with DEVGRAPH_PLUGINS"
                )
            spec = PlatformSpec(name, cls, origin)
            self.platforms[name] = spec
            return spec

    def add_backend(
        self,
        cls: type[DeviceGraphBackend],
        *,
        name: str | None,
        platform: str,
        phases: Iterable[str] = PHASES,
        default_for: Iterable[str] = (),
        origin: str,
    ) -> BackendSpec:
        if not (isinstance(cls, type) and issubclass(cls, DeviceGraphBackend)):
            raise RegistrationError(
                f"{cls!r} is not a DeviceGraphBackend subclass; backends must derive from it"
            )
        name = name or cls.name
        phases_set = frozenset(phases)
        default_set = frozenset(default_for)
        unknown = (phases_set | default_set) - set(PHASES)
        if unknown:
            raise RegistrationError(
                f"backend {platform}:{name} names unknown phases {sorted(unknown)}; "
                f"accepted: {', '.join(PHASES)}"
            )
        if not default_set <= phases_set:
            raise RegistrationError(
                f"backend {platform}:{name} is default_for {sorted(default_set - phases_set)} "
                "but does not list those phases in phases="
            )
        with self._lock:
            existing = self.backends.get((platform, name))
            if existing is not None:
                raise RegistrationError(
                    f"backend {name!r} for platform {platform!r} is registered twice: "
                    f"by {existing.origin} and "
                    f"by {origin}; uninstall one of them or limit plug-ins with DEVGRAPH_PLUGINS"
                )
            for phase in default_set:
                clash = self.default_spec(platform, phase)
                if clash is not None:
                    raise RegistrationError(
                        f"backends {platform}:{clash.name} ({clash.origin}) and "
                        f"{platform}:{name} ({origin}) both "
                        f"claim to be the default for phase {phase!r}; only one may"
                    )
            spec = BackendSpec(name, platform, cls, phases_set, default_set, origin)
            self.backends[(platform, name)] = spec
            return spec

    # -- queries ---------------------------------------------------------------------------------
    def default_spec(self, platform: str, phase: str) -> BackendSpec | None:
        return next(
            (s for s in self.backends.values() if s.platform == platform and phase in s.default_for), None
        )

    def platform(self, name: str) -> GraphPlatform:
        """The (cached) platform instance registered as ``name``."""
        self.load()
        spec = self.platforms.get(name)
        if spec is None:
            from devgraph.errors import BackendUnavailableError

            raise BackendUnavailableError(
                f"no plug-in provides platform {name!r} "
                f"(known: {', '.join(sorted(self.platforms)) or 'none'}); "
                f"install devgraph-{name} or check `devgraph info` for plug-ins that failed to load"
            )
        instance = self._instances.get(name)
        if instance is None:
            instance = self._instances[name] = spec.cls()
        return instance

    def backend_names(self) -> list[str]:
        self.load()
        return sorted({name for _, name in self.backends})


_registry: Registry | None = None
_registry_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, loaded on first use."""
    global _registry
    if _registry is None:
        with _registry_lock:
            if _registry is None:
                _registry = Registry()
    return _registry.load()


def reset_registry(registry: Registry | None = None) -> None:
    """Replace the process-wide registry (tests use this to reload plug-ins)."""
    global _registry
    with _registry_lock:
        _registry = registry


@overload
def register_backend(
    cls: B,
    /,
    *,
    name: str | None = ...,
    platform: str,
    phases: Iterable[str] = ...,
    default_for: Iterable[str] = ...,
) -> B: ...


@overload
def register_backend(
    cls: None = None,
    /,
    *,
    name: str | None = ...,
    platform: str,
    phases: Iterable[str] = ...,
    default_for: Iterable[str] = ...,
) -> Callable[[B], B]: ...


def register_backend(
    cls: B | None = None,
    /,
    *,
    name: str | None = None,
    platform: str,
    phases: Iterable[str] = PHASES,
    default_for: Iterable[str] = (),
) -> Any:
    """Register a backend directly, as a call or as a class decorator.

    ``register_backend(MyBackend, name="full", platform="mychip")`` or::

        @devgraph.register_backend(platform="mychip", phases=("decode",), default_for=("decode",))
        class MyBackend(FullGraphBackend): ...

    Plug-ins load first, so a clash with an installed plug-in is reported here, naming both origins.
    """

    def apply(target: B) -> B:
        origin = f"register_backend() in {target.__module__}"
        get_registry().add_backend(
            target, name=name, platform=platform, phases=phases, default_for=default_for, origin=origin
        )
        return target

    return apply(cls) if cls is not None else apply
