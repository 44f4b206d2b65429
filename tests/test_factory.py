"""Resolution and construction: resolve_platform, resolve_phase, create_backend."""

from __future__ import annotations

import pytest
import torch

from devgraph import BackendOptions, BackendUnavailableError, ConfigError, DeviceGraphConfig, create_backend
from devgraph.flag.factory import ResolvedPhase, best_platform, resolve_phase, resolve_platform
from devgraph.platforms.sim.platform import CpuSimPlatform
from devgraph.registry.plugins import Registry
from devgraph.registry.rules import CompatibilityRule
from devgraph.strategies import BreakableBackend, EagerBackend, FullGraphBackend, TcPiecewiseBackend


def test_auto_picks_platform_defaults():
    assert type(create_backend("cpu", "decode")) is FullGraphBackend
    assert type(create_backend("cpu", "prefill")) is BreakableBackend


@pytest.mark.parametrize(
    ("mode", "cls"),
    [
        ("full", FullGraphBackend),
        ("breakable", BreakableBackend),
        ("tc_piecewise", TcPiecewiseBackend),
        ("disabled", EagerBackend),
        ("eager", EagerBackend),
    ],
)
def test_named_modes(mode, cls):
    backend = create_backend("cpu", "prefill", mode)
    assert type(backend) is cls
    assert backend.phase == "prefill" and backend.platform.name == "cpu"


def test_unknown_mode_lists_what_exists():
    with pytest.raises(BackendUnavailableError, match="available there: .*breakable"):
        create_backend("cpu", "decode", "warp")


def test_unknown_phase():
    with pytest.raises(ConfigError, match="accepted: decode, prefill, encode, verify"):
        create_backend("cpu", "decoding")


def test_options_map_to_typed_fields_and_extra():
    backend = create_backend(
        "cpu",
        "decode",
        "full",
        options={
            "compiler": "inductor",
            "inductor_mode": "max-autotune-no-cudagraphs",
            "on_recompile": "raise",
            "cache_dir": "/tmp/devgraph-cache",
            "host_update": True,
        },
    )
    assert backend.options == BackendOptions(
        compiler="inductor",
        inductor_mode="max-autotune-no-cudagraphs",
        on_recompile="raise",
        cache_dir="/tmp/devgraph-cache",
        extra={"host_update": True},
    )


@pytest.mark.parametrize(
    ("mode", "options", "fragment"),
    [
        ("tc_piecewise", {"compiler": "gcc"}, "compiler 'gcc'"),
        ("breakable", {"compiler": "inductor"}, "would be ignored: backend 'breakable'"),
        ("full", {"compiler": "inductor", "inductor_mode": "reduce-overhead"}, "nest inside devgraph's"),
        ("full", {"inductor_mode": "default"}, 'needs compiler "inductor"'),
        ("full", {"on_recompile": "shrug"}, "accepted: warn, raise"),
    ],
)
def test_bad_options_are_config_errors(mode, options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        create_backend("cpu", "prefill", mode, options=options)


def test_best_platform_on_this_machine_is_usable():
    assert best_platform().availability().usable


def test_unusable_platform_says_why(registry):
    cuda = registry.platform("cuda")
    if cuda.availability():
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(BackendUnavailableError, match="cannot run here: .*"):
        create_backend("cuda", "decode")


def test_unknown_device_type():
    with pytest.raises(BackendUnavailableError, match="no registered platform handles device 'meta'"):
        resolve_platform("meta")


def test_device_that_is_not_a_device():
    with pytest.raises(ConfigError, match="'bogus' is not a torch device; devices of registered platforms"):
        resolve_platform("bogus")
    with pytest.raises(ConfigError, match="must be a torch.device or a string"):
        resolve_platform(3)  # type: ignore[arg-type]


def test_npu_without_torch_npu_gives_the_install_hint(registry):
    if "npu" not in registry.platforms:
        pytest.skip("devgraph-npu is not installed")
    try:
        torch.device("npu")
        pytest.skip("torch knows the npu device type here")
    except RuntimeError:
        pass
    with pytest.raises(BackendUnavailableError) as info:
        resolve_platform("npu:0")
    info_reason = next(p for p in _info_platforms(registry) if p["name"] == "npu")["reason"]
    assert "platform 'npu' is unusable here" in str(info.value) and info_reason in str(info.value)


def _info_platforms(registry):
    from devgraph.cli.info import collect_info

    return collect_info(registry)["platforms"]


# -- resolve_phase: the one place auto, rules and compiler checks meet ------------------------------------
def test_resolve_auto_uses_platform_default():
    resolved = resolve_phase(DeviceGraphConfig.parse("auto"), "decode", "cpu")
    assert resolved == ResolvedPhase(
        "decode", "cpu", "full", DeviceGraphConfig.parse("auto").for_phase("decode")
    )
    assert resolve_phase(DeviceGraphConfig.parse("auto"), "prefill", "cpu").backend == "breakable"


def test_resolve_disabled_is_eager():
    assert resolve_phase(DeviceGraphConfig.parse("disabled"), "decode", "cpu").backend == "eager"


def test_resolve_applies_rules_and_logs_rule_name(caplog):
    resolved = resolve_phase(DeviceGraphConfig.parse("decode=full"), "decode", "cpu", {"dynamic_lora": True})
    assert resolved.backend == "breakable"
    assert [d.rule for d in resolved.downgrades] == ["dynamic-lora-needs-breaks"]
    assert "dynamic-lora-needs-breaks" in caplog.text


def test_auto_resolving_to_a_backend_that_ignores_compiler_is_an_error():
    config = DeviceGraphConfig.parse('{"prefill": {"compiler": "inductor"}}')
    with pytest.raises(ConfigError) as info:
        resolve_phase(config, "prefill", "cpu")
    message = str(info.value)
    assert "mode 'auto' resolves to backend 'breakable', which does not compile" in message
    assert "full, tc_piecewise" in message
    assert resolve_phase(config, "decode", "cpu").backend == "full"  # decode's default compiles


def test_a_rule_downgrade_drops_compiler_with_a_warning(caplog):
    config = DeviceGraphConfig.parse('{"decode": {"backend": "full", "compiler": "inductor"}}')
    resolved = resolve_phase(config, "decode", "cpu", {"dynamic_lora": True})
    assert resolved.backend == "breakable" and resolved.config.compiler is None
    assert resolved.backend_options() == {}
    assert "no longer apply" in caplog.text
    assert resolve_phase(config, "decode", "cpu").backend_options() == {"compiler": "inductor"}


def test_resolve_phase_skips_a_rule_whose_predicate_raises(caplog):
    registry = Registry(entry_points=False)

    def broken(features):
        raise RuntimeError("predicate bug")

    registry.add_rule(CompatibilityRule("broken-rule", "r", broken, "eager"), origin="test")
    resolved = resolve_phase(DeviceGraphConfig.parse("decode=full"), "decode", "cpu", registry=registry)
    assert resolved.backend == "full" and resolved.downgrades == ()
    assert "broken-rule" in caplog.text and "predicate bug" in caplog.text


def test_features_must_be_a_mapping():
    with pytest.raises(ConfigError, match="features must be a mapping"):
        resolve_phase(DeviceGraphConfig.parse("auto"), "decode", "cpu", ["lora"])  # type: ignore[arg-type]


# -- availability and matches() answered badly by a plug-in --------------------------------------------
class _BoolPlatform(CpuSimPlatform):
    name = "boolplat"
    device_type = "meta"
    priority = 1000

    def availability(self):  # type: ignore[override]
        return True


class _RaisingMatches(CpuSimPlatform):
    name = "badmatch"
    priority = 1000

    def matches(self, device):  # type: ignore[override]
        raise RuntimeError("matches bug")


def test_availability_returning_a_bool_is_unusable_everywhere():
    registry = Registry(entry_points=False)
    registry.add_platform(_BoolPlatform, origin="test")
    registry.add_backend(FullGraphBackend, name="full", platform="boolplat", origin="test")
    reason = "availability() returned True (a bool), not devgraph.Availability"
    assert best_platform(registry).name == "cpu"  # the higher priority is skipped, not trusted
    with pytest.raises(BackendUnavailableError) as info:
        create_backend("meta", "decode", "full", registry=registry)
    assert str(info.value) == f"backend boolplat:full cannot run here: {reason}"
    platform = next(p for p in _info_platforms(registry) if p["name"] == "boolplat")
    assert not platform["usable"] and platform["reason"] == reason


def test_matches_that_raises_does_not_hide_other_platforms():
    registry = Registry(entry_points=False)
    registry.add_platform(_RaisingMatches, origin="test")
    assert resolve_platform("cpu", registry).name == "cpu"
