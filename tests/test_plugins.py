"""The pluggy registry: built-ins, entry-point plug-ins, allow-list, failures, duplicates."""

from __future__ import annotations

import pytest
from conftest import write_distribution

from devgraph import RegistrationError, create_backend, register_backend
from devgraph.plugins import Registry
from devgraph.strategies import FullGraphBackend

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


def test_builtin_cpu_platform_and_strategies(registry):
    assert "cpu" in registry.platforms
    assert {"full", "breakable", "tc_piecewise"} <= {n for (p, n) in registry.backends if p == "cpu"}
    builtin = next(p for p in registry.plugins if p.name == "builtin")
    assert builtin.status == "loaded" and "platform cpu" in builtin.provides


def test_vendor_plugins_register_their_platforms(registry):
    for name in ("cuda", "rocm", "npu"):
        spec = registry.platforms[name]
        assert f"devgraph-{name}" in spec.origin


def test_loading_is_lazy_and_once():
    registry = Registry(entry_points=False)
    assert registry.platforms == {}
    registry.load()
    count = len(registry.backends)
    registry.load()
    assert len(registry.backends) == count


def test_third_party_distribution_backend_is_created(dist_dir):
    write_distribution(dist_dir, "devgraph-toy", {"devgraph_toy": TOY_PLUGIN}, {"toy": "devgraph_toy"})
    registry = Registry().load()
    record = next(p for p in registry.plugins if p.name == "toy")
    assert record.status == "loaded"
    assert "devgraph-toy 0.1" in record.origin
    backend = create_backend("cpu", "decode", "toy_full", registry=registry)
    assert type(backend).__name__ == "ToyFull"
    assert registry.backends[("cpu", "toy_full")].origin == record.origin


def test_broken_plugin_is_reported_and_others_work(dist_dir, caplog):
    write_distribution(
        dist_dir, "devgraph-broken", {"devgraph_broken": BROKEN_PLUGIN}, {"broken": "devgraph_broken"}
    )
    registry = Registry().load()
    record = next(p for p in registry.plugins if p.name == "broken")
    assert record.status == "failed"
    assert "libvendor.so" in record.error
    assert "broken" in caplog.text
    assert isinstance(create_backend("cpu", "decode", "full", registry=registry), FullGraphBackend)


def test_allow_list_skips_other_entry_points(dist_dir, monkeypatch):
    write_distribution(dist_dir, "devgraph-toy", {"devgraph_toy": TOY_PLUGIN}, {"toy": "devgraph_toy"})
    monkeypatch.setenv("DEVGRAPH_PLUGINS", "cuda")
    registry = Registry().load()
    states = {p.name: p.status for p in registry.plugins}
    assert states["toy"] == "skipped"
    assert states["cuda"] == "loaded"
    assert ("cpu", "toy_full") not in registry.backends


def test_duplicate_from_plugin_names_both_origins(dist_dir):
    write_distribution(dist_dir, "devgraph-dup", {"devgraph_dup": DUPLICATE_PLUGIN}, {"dup": "devgraph_dup"})
    registry = Registry().load()
    record = next(p for p in registry.plugins if p.name == "dup")
    assert record.status == "failed"
    assert "devgraph (built-in)" in record.error and "devgraph-dup 0.1" in record.error


def test_register_backend_as_call_and_decorator(monkeypatch):
    registry = Registry(entry_points=False).load()
    monkeypatch.setattr("devgraph.plugins._registry", registry)

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


def test_bad_registrations(monkeypatch):
    registry = Registry(entry_points=False).load()
    with pytest.raises(RegistrationError, match="not a DeviceGraphBackend"):
        registry.add_backend(object, name="x", platform="cpu", origin="test")  # type: ignore[arg-type]
    with pytest.raises(RegistrationError, match="unknown phases"):
        registry.add_backend(FullGraphBackend, name="x", platform="cpu", phases=("decod",), origin="test")
    with pytest.raises(RegistrationError, match="default for phase"):
        registry.add_backend(
            FullGraphBackend, name="x", platform="cpu", default_for=("decode",), origin="test"
        )
