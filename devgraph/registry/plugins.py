"""The backend and platform registry, fed by pluggy plug-ins.

Built-ins and entry-point plug-ins (group ``devgraph``) load the same way, lazily, once, on the first
question asked of the registry. Loading is atomic: other threads wait for the first load to finish, and
a load that fails leaves nothing half-visible. ``DEVGRAPH_PLUGINS=a,b`` limits which entry points load.

Each plug-in is isolated: whatever it does wrong (an import that raises, even ``SystemExit``; a
flag-unsafe or special name; an abstract class; a registration that clashes; a bad rule) fails that
plug-in alone, rolls back everything it had registered, and is reported (logged, and listed by
``devgraph info``). An entry point that shadows another's name is not loaded and says whose.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import pluggy

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.modes import EAGER_MODES
from devgraph.contract.phases import PHASES
from devgraph.contract.platform import GraphPlatform
from devgraph.errors import BackendUnavailableError, RegistrationError
from devgraph.messages import describe_error, shorten
from devgraph.registry import hookspecs
from devgraph.registry.registration import (
    BackendSpec,
    PlatformSpec,
    PluginRecord,
    RegistryState,
    check_backend,
    check_platform,
    dist_label,
    isolated,
    select_entry_points,
)
from devgraph.registry.rules import BUILTIN_RULES, CompatibilityRule, check_rule

__all__ = [
    "BackendSpec",
    "ENTRY_POINT_GROUP",
    "PlatformSpec",
    "PluginRecord",
    "Registry",
    "get_registry",
    "reset_registry",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "devgraph"
BUILTIN_NAME = "builtin"
_BUILTIN = "devgraph (built-in)"
_HOOKS = ("devgraph_register_platforms", "devgraph_register_backends", "devgraph_compatibility_rules")


class Registry:
    """Platforms, backends and compatibility rules from every plug-in.

    ``entry_points`` is ``True`` (the installed ``devgraph`` entry points), ``False`` (built-ins only) or
    a function returning entry-point-like objects (``name``, ``value``, ``dist``, ``load()``), which
    tests use to load hostile plug-ins in-process.
    """

    def __init__(self, *, entry_points: bool | Callable[[], Iterable[Any]] = True) -> None:
        self._entry_points = entry_points
        self._lock = threading.RLock()
        self._loaded = False
        self._loader: int | None = None
        self._state = RegistryState()
        self._instances: dict[str, GraphPlatform] = {}
        self._current: PluginRecord | None = None
        self.pm = self._new_plugin_manager()

    @staticmethod
    def _new_plugin_manager() -> pluggy.PluginManager:
        pm = pluggy.PluginManager("devgraph")
        pm.add_hookspecs(hookspecs)
        return pm

    # -- views (each loads first) ----------------------------------------------------------------
    @property
    def platforms(self) -> Mapping[str, PlatformSpec]:
        return MappingProxyType(self.load()._state.platforms)

    @property
    def backends(self) -> Mapping[tuple[str, str], BackendSpec]:
        return MappingProxyType(self.load()._state.backends)

    @property
    def rules(self) -> tuple[CompatibilityRule, ...]:
        return self.load()._state.rules

    @property
    def plugins(self) -> tuple[PluginRecord, ...]:
        return tuple(self.load()._state.plugins)

    @property
    def loaded(self) -> bool:
        """Whether the first load has finished (nothing is loaded before a question is asked)."""
        return self._loaded

    # -- loading ---------------------------------------------------------------------------------
    def load(self) -> Registry:
        """Load built-ins and entry-point plug-ins once; other threads wait until it is complete.

        A plug-in's hook that asks the registry while it loads (``register_backend()`` at import) sees
        the load in progress; if loading itself fails, the registry stays empty and a later call retries.
        """
        if self.loaded:
            return self
        with self._lock:
            if self._loaded or self._loader == threading.get_ident():
                return self
            self._loader = threading.get_ident()
            self._state = RegistryState()
            try:
                from devgraph.registry import builtin

                self._add_plugin(BUILTIN_NAME, _BUILTIN, lambda: builtin, BUILTIN_RULES)
                if self._entry_points:
                    self._load_entry_points()
            except BaseException:
                self._state = RegistryState()
                self._instances = {}
                self.pm = self._new_plugin_manager()
                raise
            finally:
                self._loader = None
            self._loaded = True
        return self

    def _list_entry_points(self) -> list[Any]:
        if callable(self._entry_points):
            return list(self._entry_points())
        return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))

    def _load_entry_points(self) -> None:
        try:
            eps = self._list_entry_points()
        except BaseException as exc:
            if not isolated(exc):
                raise
            record = PluginRecord("entry points", f"group {ENTRY_POINT_GROUP!r}", "failed")
            self._state.plugins.append(record)
            self._fail(record, f"listing entry points failed: {describe_error(exc)}", exc)
            return
        allowed_env = os.environ.get("DEVGRAPH_PLUGINS")
        allowed = None if allowed_env is None else {p.strip() for p in allowed_env.split(",") if p.strip()}
        for ep, verdict, reason in select_entry_points(eps, allowed, reserved={BUILTIN_NAME: _BUILTIN}):
            if verdict == "load":
                self._add_plugin(str(ep.name), dist_label(ep), ep.load)
            else:
                self._state.plugins.append(PluginRecord(str(ep.name), dist_label(ep), verdict, reason))

    def _add_plugin(
        self, name: str, origin: str, load: Callable[[], Any], rules: Iterable[CompatibilityRule] = ()
    ) -> None:
        """Load one plug-in as a unit: on any failure, everything it registered is rolled back."""
        record = PluginRecord(name, origin, "loaded")
        self._state.plugins.append(record)
        snapshot = self._state.snapshot()
        self._current = record
        step = "import"
        try:
            module = load()
            step = "hook validation"
            self.pm.register(module, name=name)
            implemented = 0
            for hook_name in _HOOKS:
                step = hook_name
                for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                    if impl.plugin_name == name:
                        implemented += 1
                        impl.function(register=self._register_callback(hook_name, origin, record))
            if not implemented and not rules and not record.provides:
                record.add_problem(f"implements none of the hooks {', '.join(_HOOKS)}; it provides nothing")
            step = "built-in rules"
            for rule in rules:
                self.add_rule(rule, origin=origin)
        except BaseException as exc:
            if not isolated(exc):
                raise
            self._state.restore(snapshot)
            self._instances = {k: v for k, v in self._instances.items() if k in self._state.platforms}
            record.provides.clear()
            record.problems.clear()
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            what = "import failed" if step == "import" else f"{step} failed"
            self._fail(record, f"{what}: {describe_error(exc, 500)}", exc)
        finally:
            self._current = None

    def _fail(self, record: PluginRecord, message: str, exc: BaseException) -> None:
        record.status = "failed"
        record.error = message
        logger.warning(
            "devgraph plug-in %r (%s) %s; nothing of it is registered, other plug-ins keep working",
            record.name,
            record.origin,
            message,
        )
        logger.debug("".join(traceback.format_exception(exc)))

    def _register_callback(self, hook_name: str, origin: str, record: PluginRecord) -> Callable[..., None]:
        """The ``register`` a hook receives; a rejected registration is kept on the record, then raised."""

        def register(*args: Any, **kwargs: Any) -> None:
            try:
                if hook_name == "devgraph_register_platforms":
                    self.add_platform(*args, origin=origin, **kwargs)
                elif hook_name == "devgraph_register_backends":
                    kwargs.setdefault("name", None)
                    self.add_backend(*args, origin=origin, **kwargs)
                else:
                    self.add_rule(*args, origin=origin, **kwargs)
            except TypeError as exc:  # wrong arguments to register()
                record.add_problem(f"registration rejected: register() {exc}")
                raise RegistrationError(f"{hook_name}: register() {exc}") from None
            except RegistrationError as exc:
                record.add_problem(f"registration rejected: {exc}")
                raise

        return register

    def _attribute(self, thing: str) -> None:
        """Note ``thing`` on the plug-in being loaded (registrations from its import-time decorators too)."""
        if self._current is not None and self._loader == threading.get_ident():
            self._current.provides.append(thing)

    # -- mutation (validated; containers are replaced so readers never see them change) ------------
    def add_platform(self, cls: type[GraphPlatform], *, origin: str) -> PlatformSpec:
        self.load()
        name = check_platform(cls)
        with self._lock:
            existing = self._state.platforms.get(name)
            if existing is not None:
                raise RegistrationError(
                    f"platform {name!r} is registered twice: by {existing.origin} and by {origin}; "
                    "uninstall one of them or limit plug-ins with DEVGRAPH_PLUGINS"
                )
            spec = PlatformSpec(name, cls, origin)
            self._state.platforms = {**self._state.platforms, name: spec}
            self._attribute(f"platform {name}")
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
        self.load()
        name, phases_set, default_set = check_backend(cls, name, platform, phases, default_for)
        with self._lock:
            existing = self._state.backends.get((platform, name))
            if existing is not None:
                raise RegistrationError(
                    f"backend {name!r} for platform {platform!r} is registered twice: by {existing.origin} "
                    f"and by {origin}; uninstall one of them or limit plug-ins with DEVGRAPH_PLUGINS"
                )
            for phase in sorted(default_set):
                clash = self.default_spec(platform, phase)
                if clash is not None:
                    raise RegistrationError(
                        f"backends {platform}:{clash.name} ({clash.origin}) and {platform}:{name} ({origin}) "
                        f"both claim to be the default for phase {phase!r}; only one may"
                    )
            spec = BackendSpec(name, platform, cls, phases_set, default_set, origin)
            self._state.backends = {**self._state.backends, (platform, name): spec}
            self._attribute(f"backend {platform}:{name}")
            return spec

    def add_rule(self, rule: CompatibilityRule, *, origin: str) -> CompatibilityRule:
        self.load()
        rule = check_rule(rule)
        with self._lock:
            clash = next((r for r in self._state.rules if r.name == rule.name), None)
            if clash is not None:
                owner = self._state.rule_owners.get(id(clash))
                raise RegistrationError(
                    f"compatibility rule {rule.name!r} is registered twice: by "
                    f"{owner.origin if owner else 'an earlier registration'} and by {origin}"
                )
            self._state.rules = (*self._state.rules, rule)
            if self._current is not None and self._loader == threading.get_ident():
                self._state.rule_owners = {**self._state.rule_owners, id(rule): self._current}
            self._attribute(f"rule {rule.name}")
            return rule

    # -- run-time reports ------------------------------------------------------------------------
    def report_rule_error(self, rule: CompatibilityRule, exc: BaseException) -> None:
        """Record a rule predicate that raised against the plug-in that registered it (``devgraph info``)."""
        owner = self._state.rule_owners.get(id(rule))
        message = f"rule {rule.name!r} raised {describe_error(exc)}; it was skipped"
        if owner is not None:
            owner.add_problem(message)

    # -- queries ---------------------------------------------------------------------------------
    def rule_owner(self, rule: CompatibilityRule) -> PluginRecord | None:
        """The plug-in that registered ``rule`` (``None`` for a direct ``add_rule``)."""
        return self.load()._state.rule_owners.get(id(rule))

    def default_spec(self, platform: str, phase: str) -> BackendSpec | None:
        return next(
            (s for s in self.backends.values() if s.platform == platform and phase in s.default_for), None
        )

    def platform(self, name: str) -> GraphPlatform:
        """The (cached) platform instance registered as ``name``."""
        spec = self.platforms.get(name)
        if spec is None:
            raise BackendUnavailableError(
                f"no plug-in provides platform {shorten(name)} "
                f"(known: {', '.join(sorted(self.platforms)) or 'none'}); "
                f"install devgraph-{name} or check `devgraph info` for plug-ins that failed to load"
            )
        instance = self._instances.get(name)
        if instance is None:
            with self._lock:
                instance = self._instances.get(name)
                if instance is None:
                    try:
                        instance = spec.cls()
                    except BaseException as exc:
                        if not isolated(exc):
                            raise
                        raise BackendUnavailableError(
                            f"platform {name!r} ({spec.origin}) failed to start: {describe_error(exc)}"
                        ) from None
                    self._instances = {**self._instances, name: instance}
        return instance

    def backend_names(self) -> list[str]:
        """Every mode name a backend is registered under, on any platform."""
        return sorted({name for _, name in self.backends})

    def compiling_names(self) -> list[str]:
        """The mode names whose registered backend, on some platform, runs the forward through
        ``torch.compile`` (its class's ``accepts_compiler``): where the flag accepts ``compiler``."""
        return sorted({name for (_, name), spec in self.backends.items() if spec.cls.accepts_compiler})

    def accepts_compiler(self, platform: str, name: str) -> bool | None:
        """Whether backend ``name`` on ``platform`` takes a compiler; ``None`` when none is registered there
        (creating it will say so). ``eager`` and ``disabled`` never do."""
        if name in EAGER_MODES:
            return False
        spec = self.backends.get((platform, name))
        return spec.cls.accepts_compiler if spec is not None else None


_registry: Registry | None = None
_registry_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, loaded on first use."""
    global _registry
    registry = _registry
    if registry is None:
        with _registry_lock:
            if _registry is None:
                _registry = Registry()
            registry = _registry
    return registry.load()


def reset_registry(registry: Registry | None = None) -> None:
    """Replace the process-wide registry (tests use this to reload plug-ins)."""
    global _registry
    with _registry_lock:
        _registry = registry
