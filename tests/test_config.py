"""--device-graph-mode parsing, resolution and the argparse hook."""

from __future__ import annotations

import argparse

import pytest

from devgraph import ConfigError, DeviceGraphConfig, PhaseConfig, add_device_graph_args


def test_auto_and_disabled():
    assert DeviceGraphConfig.parse("auto").for_phase("decode").backend == "auto"
    disabled = DeviceGraphConfig.parse("disabled")
    assert {disabled.for_phase(p).backend for p in ("decode", "prefill", "encode")} == {"disabled"}


def test_unnamed_phase_is_auto():
    config = DeviceGraphConfig.parse("decode=full")
    assert config.for_phase("prefill") == PhaseConfig()


def test_per_phase_pairs():
    config = DeviceGraphConfig.parse("decode=full, prefill=breakable")
    assert config.for_phase("decode").backend == "full"
    assert config.for_phase("prefill").backend == "breakable"


def test_bare_mode_applies_to_every_phase():
    config = DeviceGraphConfig.parse("tc_piecewise")
    assert config.for_phase("encode").backend == "tc_piecewise"


def test_json_with_options():
    config = DeviceGraphConfig.parse(
        '{"decode": "full", "prefill": {"backend": "tc_piecewise", "max_size": 2048, "compiler": "eager", '
        '"sizes": [16, 64]}}'
    )
    assert config.for_phase("decode").backend == "full"
    assert config.for_phase("prefill") == PhaseConfig("tc_piecewise", (16, 64), 2048, "eager")


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ('{"decode": "ful"}', "did you mean 'full'"),
        ("{decode", "not valid JSON"),
        ("decode=fast", "mode 'fast' is not valid"),
        ("decod=full", "did you mean 'decode'"),
        ("decode=full,decode=eager", "given twice"),
        ("decode", "mode 'decode' is not valid"),
        ("decode=full=x", "is not phase=MODE"),
        ("", "is empty"),
        ("[1, 2]", "must be an object"),
        ('{"decode": 3}', "mode name or an object"),
        ('{"prefill": {"backend": "full", "compiler": "inductor"}}', "applies to tc_piecewise only"),
        ('{"prefill": {"backend": "tc_piecewise", "compiler": "gcc"}}', "compiler 'gcc'"),
        ('{"prefill": {"max_size": -4}}', "max_size must be a positive integer"),
        ('{"prefill": {"sizes": [16, "x"]}}', "sizes must be a non-empty list"),
        ('{"prefill": {"size": [16]}}', "did you mean 'sizes'"),
    ],
)
def test_bad_values_raise_config_error_with_accepted(value, fragment):
    with pytest.raises(ConfigError) as info:
        DeviceGraphConfig.parse(value)
    message = str(info.value)
    assert fragment in message
    assert "accepted" in message or "must" in message or "twice" in message or "applies" in message
    assert "\n" not in message


def test_resolve_auto_uses_platform_default():
    resolved = DeviceGraphConfig.parse("auto").resolve("decode", "cpu")
    assert resolved.backend == "full"
    assert DeviceGraphConfig.parse("auto").resolve("prefill", "cpu").backend == "breakable"


def test_resolve_disabled_is_eager():
    assert DeviceGraphConfig.parse("disabled").resolve("decode", "cpu").backend == "eager"


def test_resolve_applies_rules_and_logs_rule_name(caplog):
    resolved = DeviceGraphConfig.parse("decode=full").resolve("decode", "cpu", {"dynamic_lora": True})
    assert resolved.backend == "breakable"
    assert [d.rule for d in resolved.downgrades] == ["dynamic-lora-needs-breaks"]
    assert "dynamic-lora-needs-breaks" in caplog.text


def test_argparse_integration():
    parser = add_device_graph_args(argparse.ArgumentParser())
    args = parser.parse_args(["--device-graph-mode", "decode=full,prefill=tc_piecewise"])
    assert args.device_graph_mode.for_phase("prefill").backend == "tc_piecewise"
    assert parser.parse_args([]).device_graph_mode.source == "auto"


def test_argparse_rejects_bad_value(capsys):
    parser = add_device_graph_args(argparse.ArgumentParser(prog="server"))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--device-graph-mode", '{"decode": "ful"}'])
    assert info.value.code == 2
    assert "did you mean 'full'" in capsys.readouterr().err
