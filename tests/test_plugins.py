"""The pluggy registry: built-ins, entry-point plug-ins, allow-list, duplicates, hostile plug-ins, threads.

Hostile plug-ins are built in-process (module objects behind fake entry points) rather than installed;
two tests still install real distributions to cover importlib.metadata end to end.
"""

from __future__ import annotations

import contextlib
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import write_distribution

import devgraph
from devgraph import (
    DeviceGraphConfig,
    GraphRunner,
    RegistrationError,
    StaticInput,
    create_backend,
    register_backend,
)
from devgraph.cli.info import collect_info
from devgraph.contract.platform import GraphPlatform
from devgraph.flag.factory import best_platform, resolve_phase, resolve_platform
from devgraph.platforms.sim.platform import CpuSimPlatform
from devgraph.registry.plugins import Registry, get_registry
from devgraph.registry.rules import CompatibilityRule
from devgraph.strategies import BreakableBackend, FullGraphBackend

TOY_PLUGIN = """
import devgraph
from devgraph.strategies import FullGraphBackend


class ToyFull(FullGraphBackend):
    name = "toy_full"


@devgraph.hookimpl
def devgraph_register_backends(register):
    register(ToyFull, name="toy_full", platform="cpu", phases=("decode",))
"""

BROKEN_PLUGIN = "raise ImportError('libvendor.so: cannot open shared object file')\n"

DUPLICATE_PLUGIN = """
import devgraph
from devgraph.strategies import FullGraphBackend


@devgraph.hookimpl
def devgraph_register_backends(register):
    register(FullGraphBackend, name="full", platform="cpu")
"""


# -- in-process plug-ins behind fake entry points ----------------------------------------------------------
class FakeDist:
    def __init__(self, name: str) -> None:
        self.name = name
        self.version = "0.1"
        self.metadata = {"Name": name}


class FakeEntryPoint:
    """What importlib.metadata.EntryPoint offers the registry: name, value, dist, load()."""

    def __init__(self, name: str, load: Callable[[], Any], dist: str = "devgraph-fake") -> None:
        self.name = name
        self.value = f"{dist.replace('-', '_')}.plugin"
        self.dist = FakeDist(dist)
        self._load = load

    def load(self) -> Any:
        return self._load()


def plugin(name: str = "fake", **hooks: Callable[..., None]) -> types.ModuleType:
    """A plug-in module whose hooks are the given functions (``platforms=``, ``backends=``, ``rules=``)."""
    module = types.ModuleType(name)
    names = {
        "platforms": "devgraph_register_platforms",
        "backends": "devgraph_register_backends",
        "rules": "devgraph_compatibility_rules",
    }
    for key, function in hooks.items():
        setattr(module, names[key], devgraph.hookimpl(function, specname=names[key]))
    return module


def registry_with(*eps: FakeEntryPoint) -> Registry:
    return Registry(entry_points=lambda: list(eps)).load()


def record(registry: Registry, name: str):
    return next(p for p in registry.plugins if p.name == name)


class ToyFull(FullGraphBackend):
    name = "toy_full"


class MyChip(CpuSimPlatform):
    name = "mychip"
    device_type = "meta"


def good_plugin() -> FakeEntryPoint:
    def backends(register):
        register(ToyFull, name="toy_full", platform="cpu")

    return FakeEntryPoint("good", lambda: plugin(backends=backends), dist="devgraph-good")


def assert_isolated(registry: Registry, name: str, fragment: str) -> None:
    """The plug-in failed with ``fragment`` in its error, kept nothing, and nothing else broke."""
    failed = record(registry, name)
    assert failed.status == "failed" and fragment in failed.error, failed.error
    assert failed.provides == []
    assert not any(spec.origin.startswith("devgraph-bad") for spec in registry.backends.values())
    assert not any(spec.origin.startswith("devgraph-bad") for spec in registry.platforms.values())
    assert record(registry, "good").status == "loaded"
    assert ("cpu", "toy_full") in registry.backends
    assert DeviceGraphConfig.parse("decode=toy_full", known_modes=registry.backend_names())
    info = collect_info(registry)
    shown = next(p for p in info["plugins"] if p["name"] == name)
    assert shown["status"] == "failed" and fragment in shown["error"]
    assert isinstance(create_backend("cpu", "decode", "full", registry=registry), FullGraphBackend)


# -- the registry's ordinary behaviour -----------------------------------------------------------------
def test_builtin_cpu_platform_and_strategies(registry):
    assert "cpu" in registry.platforms
    assert {"full", "breakable", "tc_piecewise"} <= {n for (p, n) in registry.backends if p == "cpu"}
    builtin = record(registry, "builtin")
    assert builtin.status == "loaded" and "platform cpu" in builtin.provides
    assert "rule enforce-eager" in builtin.provides


def test_vendor_plugins_register_their_platforms(registry):
    for name in ("cuda", "rocm", "npu"):
        spec = registry.platforms[name]
        assert f"devgraph-{name}" in spec.origin


def test_rocm_policy_is_registered_by_the_rocm_plugin(registry):
    rule = next(r for r in registry.rules if r.name == "rocm-no-breakable")
    assert registry.rule_owner(rule).name == "rocm"


def test_loading_is_lazy_and_once():
    registry = Registry(entry_points=False)
    assert not registry.loaded
    count = len(registry.backends)  # the first question loads
    assert registry.loaded and count
    registry.load()
    assert len(registry.backends) == count


def test_views_are_read_only():
    registry = Registry(entry_points=False)
    with pytest.raises(TypeError):
        registry.backends[("cpu", "x")] = None  # type: ignore[index]
    with pytest.raises(AttributeError):
        registry.rules.append(None)  # type: ignore[attr-defined]


def test_third_party_distribution_backend_is_created(dist_dir):
    write_distribution(dist_dir, "devgraph-toy", {"devgraph_toy": TOY_PLUGIN}, {"toy": "devgraph_toy"})
    registry = Registry().load()
    toy = record(registry, "toy")
    assert toy.status == "loaded"
    assert "devgraph-toy 0.1" in toy.origin
    backend = create_backend("cpu", "decode", "toy_full", registry=registry)
    assert type(backend).__name__ == "ToyFull"
    assert registry.backends[("cpu", "toy_full")].origin == toy.origin


def test_broken_plugin_is_reported_and_others_work(dist_dir, caplog):
    write_distribution(
        dist_dir, "devgraph-broken", {"devgraph_broken": BROKEN_PLUGIN}, {"broken": "devgraph_broken"}
    )
    registry = Registry().load()
    broken = record(registry, "broken")
    assert broken.status == "failed"
    assert "libvendor.so" in broken.error
    assert "broken" in caplog.text
    assert isinstance(create_backend("cpu", "decode", "full", registry=registry), FullGraphBackend)


def test_allow_list_skips_other_entry_points(monkeypatch):
    monkeypatch.setenv("DEVGRAPH_PLUGINS", "other")
    registry = registry_with(good_plugin())
    assert record(registry, "good").status == "skipped"
    assert ("cpu", "toy_full") not in registry.backends


def test_duplicate_from_plugin_names_both_origins():
    def backends(register):
        register(FullGraphBackend, name="full", platform="cpu")

    registry = registry_with(FakeEntryPoint("dup", lambda: plugin(backends=backends), dist="devgraph-dup"))
    dup = record(registry, "dup")
    assert dup.status == "failed"
    assert "devgraph (built-in)" in dup.error and "devgraph-dup 0.1" in dup.error


def test_register_backend_as_call_and_decorator(monkeypatch):
    registry = Registry(entry_points=False).load()
    monkeypatch.setattr("devgraph.registry.plugins._registry", registry)

    class CallStyle(FullGraphBackend):
        pass

    assert register_backend(CallStyle, name="call_style", platform="cpu") is CallStyle

    @register_backend(name="deco_style", platform="cpu", phases=("decode",))
    class DecoStyle(FullGraphBackend):
        pass

    assert registry.backends[("cpu", "call_style")].cls is CallStyle
    assert registry.backends[("cpu", "deco_style")].phases == frozenset({"decode"})
    with pytest.raises(RegistrationError) as info:
        register_backend(CallStyle, name="deco_style", platform="cpu")
    assert "register_backend() in" in str(info.value) and "twice" in str(info.value)


def test_a_plugin_strategy_says_whether_it_compiles_and_the_flag_follows(monkeypatch):
    registry = Registry(entry_points=False).load()
    monkeypatch.setattr("devgraph.registry.plugins._registry", registry)

    class FusedFull(FullGraphBackend):  # a vendor's own compiling strategy, under its own name
        accepts_compiler = True

    class PlainSegments(BreakableBackend):  # a strategy that never compiles
        pass

    registry.add_backend(FusedFull, name="fused_full", platform="cpu", origin="test")
    registry.add_backend(PlainSegments, name="plain_segments", platform="cpu", origin="test")
    assert "fused_full" in registry.compiling_names() and "plain_segments" not in registry.compiling_names()

    flag = DeviceGraphConfig.parse('{"decode": {"backend": "fused_full", "compiler": "eager"}}')
    runner = GraphRunner(
        lambda x: x * 2,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (3,))},
        sizes=[1, 2],
        config=flag,
    )
    runner.capture()
    torch.testing.assert_close(runner.run(x=torch.ones(2, 3)), torch.full((2, 3), 2.0))
    facts = runner.inspect()
    assert isinstance(runner.backend, FusedFull) and facts["compiler"] == "eager" and facts["compiles"] >= 1
    runner.close()
    with pytest.raises(
        devgraph.ConfigError, match="would be ignored: backend 'plain_segments' does not compile"
    ):
        DeviceGraphConfig.parse('{"decode": {"backend": "plain_segments", "compiler": "eager"}}')
    with pytest.raises(devgraph.ConfigError, match="would be ignored"):
        create_backend("cpu", "decode", "plain_segments", options={"compiler": "eager"})


def test_bad_registrations():
    registry = Registry(entry_points=False).load()
    with pytest.raises(RegistrationError, match="not a DeviceGraphBackend"):
        registry.add_backend(object, name="x", platform="cpu", origin="test")  # type: ignore[arg-type]
    with pytest.raises(RegistrationError, match="unknown phases"):
        registry.add_backend(FullGraphBackend, name="x", platform="cpu", phases=("decod",), origin="test")
    with pytest.raises(RegistrationError, match="a list of phase names"):
        registry.add_backend(FullGraphBackend, name="x", platform="cpu", phases="decode", origin="test")
    registry.add_backend(FullGraphBackend, name="y", platform="cpu", default_for=("decode",), origin="test")
    with pytest.raises(RegistrationError, match="default for phase"):
        registry.add_backend(
            FullGraphBackend, name="x", platform="cpu", default_for=("decode",), origin="test"
        )


# -- hostile plug-ins: rejected or isolated, reported by info, nothing else breaks ---------------------------
@pytest.mark.parametrize("name", [7, "disabled", "auto", "eager", "a,b=c", "Full", ""])
def test_flag_unsafe_or_special_backend_names_are_rejected(name):
    def backends(register):
        register(FullGraphBackend, name="fine_first", platform="cpu")  # rolled back with the plug-in
        register(FullGraphBackend, name=name, platform="cpu")

    bad = FakeEntryPoint("bad", lambda: plugin(backends=backends), dist="devgraph-bad")
    registry = registry_with(good_plugin(), bad)
    assert_isolated(registry, "bad", "devgraph_register_backends failed: RegistrationError")
    assert ("cpu", "fine_first") not in registry.backends
    assert repr(name) in record(registry, "bad").error


def test_an_incomplete_backend_class_is_rejected():
    class Incomplete(devgraph.DeviceGraphBackend):
        name = "incomplete"

    def backends(register):
        register(Incomplete, name="incomplete", platform="cpu")

    registry = registry_with(
        good_plugin(), FakeEntryPoint("bad", lambda: plugin(backends=backends), "devgraph-bad")
    )
    assert_isolated(registry, "bad", "not a complete DeviceGraphBackend: abstract methods left: capture_one")


class _AbstractPlatform(GraphPlatform):
    name = "halfchip"
    device_type = "meta"


class _NamelessPlatform(CpuSimPlatform):
    name = None  # type: ignore[assignment]


class _NoDeviceType(CpuSimPlatform):
    name = "nodevice"
    device_type = None  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("cls", "fragment"),
    [
        (_AbstractPlatform, "abstract methods left: availability"),
        (_NamelessPlatform, "must set the class attribute 'name'"),
        (_NoDeviceType, "must set the class attribute 'device_type'"),
        (int, "is not a devgraph.GraphPlatform subclass"),
    ],
)
def test_incomplete_platform_classes_are_rejected(cls, fragment):
    def platforms(register):
        register(MyChip)  # rolled back with the plug-in
        register(cls)

    registry = registry_with(
        good_plugin(), FakeEntryPoint("bad", lambda: plugin(platforms=platforms), "devgraph-bad")
    )
    assert_isolated(registry, "bad", fragment)
    assert "mychip" not in registry.platforms


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (True, "availability() returned True (a bool), not devgraph.Availability"),
        ("yes", "availability() returned 'yes' (a str), not devgraph.Availability"),
        (RuntimeError("driver probe crashed"), "availability() raised RuntimeError: driver probe crashed"),
        (SystemExit(1), "availability() raised SystemExit: 1"),
    ],
)
def test_platform_availability_that_is_not_an_availability(answer, reason):
    class Liar(CpuSimPlatform):
        name = "liar"
        device_type = "meta"
        priority = 1000

        def availability(self):  # type: ignore[override]
            if isinstance(answer, BaseException):
                raise answer
            return answer

    def platforms(register):
        register(Liar)

    def backends(register):
        register(FullGraphBackend, name="full", platform="liar")

    liar = FakeEntryPoint("liar", lambda: plugin(platforms=platforms, backends=backends), "devgraph-liar")
    registry = registry_with(liar)
    shown = next(p for p in collect_info(registry)["platforms"] if p["name"] == "liar")
    assert (shown["usable"], shown["reason"]) == (False, reason)
    assert best_platform(registry).name == "cpu"
    with pytest.raises(devgraph.BackendUnavailableError, match="cannot run here"):
        create_backend("meta", "decode", "full", registry=registry)


def test_a_rule_predicate_that_raises_is_skipped_and_shown_by_info():
    def broken(features):
        raise ZeroDivisionError("division by zero in the vendor's predicate")

    def rules(register):
        register(CompatibilityRule("vendor-rule", "r", broken, "eager"))

    registry = registry_with(FakeEntryPoint("vendor", lambda: plugin(rules=rules), "devgraph-vendor"))
    resolved = resolve_phase(DeviceGraphConfig.parse("decode=full"), "decode", "cpu", registry=registry)
    assert resolved.backend == "full" and resolved.downgrades == ()
    shown = next(p for p in collect_info(registry)["plugins"] if p["name"] == "vendor")
    assert shown["status"] == "loaded"
    assert any("vendor-rule" in p and "ZeroDivisionError" in p for p in shown["problems"])


@pytest.mark.parametrize("where", ["import", "hook"])
def test_system_exit_in_a_plugin_is_isolated(where):
    def load():
        if where == "import":
            raise SystemExit("vendor library called exit()")

        def backends(register):
            register(FullGraphBackend, name="before_exit", platform="cpu")
            raise SystemExit(2)

        return plugin(backends=backends)

    registry = registry_with(good_plugin(), FakeEntryPoint("bad", load, "devgraph-bad"))
    assert_isolated(registry, "bad", "SystemExit")
    assert ("cpu", "before_exit") not in registry.backends


def test_keyboard_interrupt_is_not_swallowed_and_the_failed_load_is_not_half_visible():
    interrupts = [KeyboardInterrupt()]

    def load():
        if interrupts:
            raise interrupts.pop()
        return plugin()

    registry = Registry(entry_points=lambda: [good_plugin(), FakeEntryPoint("slowpoke", load, "devgraph-z")])
    with pytest.raises(KeyboardInterrupt):
        registry.load()
    assert not registry.loaded
    assert registry.load().loaded  # a second load starts from nothing: no "registered twice"
    assert {p.name: p.status for p in registry.plugins} == {
        "builtin": "loaded",
        "good": "loaded",
        "slowpoke": "loaded",
    }


def test_entry_point_shadowing_the_builtin_plugin():
    shadow = FakeEntryPoint("builtin", lambda: plugin(), dist="devgraph-evil")
    registry = registry_with(shadow)
    states = [(p.name, p.status, p.error) for p in registry.plugins]
    assert states[0] == ("builtin", "loaded", "")
    assert ("builtin", "failed", "shadows builtin from devgraph (built-in)") in states
    assert "cpu" in registry.platforms


def test_two_distributions_with_one_entry_point_name():
    def backends_from(name):
        def backends(register):
            register(ToyFull, name=name, platform="cpu")

        return backends

    later = FakeEntryPoint("toy", lambda: plugin(backends=backends_from("from_b")), dist="devgraph-b")
    first = FakeEntryPoint("toy", lambda: plugin(backends=backends_from("from_a")), dist="devgraph-a")
    registry = registry_with(later, first)
    toys = [p for p in registry.plugins if p.name == "toy"]
    assert [(p.status, p.origin.split()[0]) for p in toys] == [
        ("loaded", "devgraph-a"),
        ("failed", "devgraph-b"),
    ]
    assert toys[1].error == "shadows toy from devgraph-a"
    assert ("cpu", "from_a") in registry.backends and ("cpu", "from_b") not in registry.backends


def test_the_same_distribution_seen_twice_is_listed_once():
    registry = registry_with(good_plugin(), good_plugin())
    assert [p.status for p in registry.plugins if p.name == "good"] == ["loaded"]


def test_a_plugin_failing_after_registering_is_rolled_back():
    def platforms(register):
        register(MyChip)

    def backends(register):
        register(FullGraphBackend, name="full", platform="mychip", default_for=("decode",))
        raise RuntimeError("vendor runtime missing a symbol")

    def rules(register):  # never reached
        register(CompatibilityRule("late", "r", lambda f: True, "eager"))

    bad = FakeEntryPoint(
        "bad", lambda: plugin(platforms=platforms, backends=backends, rules=rules), "devgraph-bad"
    )
    registry = registry_with(good_plugin(), bad)
    assert_isolated(
        registry, "bad", "devgraph_register_backends failed: RuntimeError: vendor runtime missing"
    )
    assert "mychip" not in registry.platforms and ("mychip", "full") not in registry.backends
    assert "late" not in {r.name for r in registry.rules}
    assert not registry.pm.has_plugin("bad")


@pytest.mark.parametrize("rule", ["enforce-eager", {"name": "x"}, CompatibilityRule("x", "r", 3, "eager")])
def test_registering_something_that_is_not_a_rule(rule):
    def rules(register):
        register(rule)

    registry = registry_with(
        good_plugin(), FakeEntryPoint("bad", lambda: plugin(rules=rules), "devgraph-bad")
    )
    assert_isolated(registry, "bad", "devgraph_compatibility_rules failed: RegistrationError")


def test_a_rejection_the_plugin_swallows_is_still_shown():
    def backends(register):
        with contextlib.suppress(RegistrationError):
            register(FullGraphBackend, name="Bad Name", platform="cpu")
        register(ToyFull, name="toy_full", platform="cpu")

    registry = registry_with(FakeEntryPoint("sloppy", lambda: plugin(backends=backends), "devgraph-sloppy"))
    sloppy = record(registry, "sloppy")
    assert sloppy.status == "loaded" and sloppy.provides == ["backend cpu:toy_full"]
    assert any("'Bad Name'" in p for p in sloppy.problems)


def test_register_backend_called_while_the_registry_loads(monkeypatch):
    """A plug-in that registers at import through devgraph.register_backend(): no deadlock, no recursion."""

    def load():
        register_backend(ToyFull, name="import_time", platform="cpu")
        return plugin()

    registry = Registry(entry_points=lambda: [FakeEntryPoint("eager_import", load, "devgraph-ei")])
    monkeypatch.setattr("devgraph.registry.plugins._registry", registry)
    assert ("cpu", "import_time") in get_registry().backends
    assert record(registry, "eager_import").provides == ["backend cpu:import_time"]


def test_a_hook_with_the_wrong_signature_is_isolated():
    def devgraph_register_backends(registrar):  # pluggy refuses an argument the hookspec lacks
        pass

    module = types.ModuleType("wrong_signature")
    module.devgraph_register_backends = devgraph.hookimpl(devgraph_register_backends)  # type: ignore[attr-defined]
    registry = registry_with(good_plugin(), FakeEntryPoint("bad", lambda: module, "devgraph-bad"))
    assert_isolated(registry, "bad", "hook validation failed: PluginValidationError")


def test_an_entry_point_that_provides_nothing_says_so():
    registry = registry_with(FakeEntryPoint("empty", lambda: None, "devgraph-empty"))
    assert any("implements none of the hooks" in p for p in record(registry, "empty").problems)


# -- the start-up race: loading is atomic and once ----------------------------------------------------
def test_many_threads_asking_a_fresh_registry_at_once(monkeypatch):
    class SlowChip(CpuSimPlatform):
        name = "slowchip"
        device_type = "meta"

    def slow_load():
        time.sleep(0.2)  # a plug-in importing a vendor runtime
        return plugin(platforms=lambda register: register(SlowChip))

    loads = []

    def entry_points():
        loads.append(1)
        return [FakeEntryPoint("slow", slow_load, "devgraph-slow")]

    registry = Registry(entry_points=entry_points)
    monkeypatch.setattr("devgraph.registry.plugins._registry", registry)
    start = threading.Barrier(12)
    results: list[Any] = []

    def ask(kind: int) -> None:
        start.wait()
        try:
            if kind % 3 == 0:
                results.append(get_registry().platform("slowchip").name)
            elif kind % 3 == 1:
                results.append(get_registry().platform("cpu").name)
            else:
                results.append(resolve_platform("cpu").name)
        except Exception as exc:  # collected and asserted below
            results.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(map(str, results)) == sorted(["slowchip"] * 4 + ["cpu"] * 8)
    assert loads == [1]
