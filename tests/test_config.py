"""--device-graph-mode parsing: the grammar, the per-phase keys, hostile input, and the argparse hook.

Resolution (``auto``, rules) is the factory's job and is tested in test_factory.py.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import pytest

from devgraph import ConfigError, DeviceGraphConfig, PhaseConfig, add_device_graph_args
from devgraph.flag.config import MAX_FLAG_CHARS
from devgraph.registry.plugins import Registry
from devgraph.strategies import FullGraphBackend

CONFIG_PY = Path(__file__).resolve().parents[1] / "devgraph" / "flag" / "config.py"


def _error(value, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        DeviceGraphConfig.parse(value, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_auto_and_disabled():
    assert DeviceGraphConfig.parse("auto").for_phase("decode").backend == "auto"
    disabled = DeviceGraphConfig.parse("disabled")
    assert {disabled.for_phase(p).backend for p in ("decode", "prefill", "encode", "verify")} == {"disabled"}


def test_unnamed_phase_is_auto():
    config = DeviceGraphConfig.parse("decode=full")
    assert config.for_phase("prefill") == PhaseConfig()


def test_per_phase_pairs():
    config = DeviceGraphConfig.parse("decode=full, prefill=breakable, verify=eager")
    assert config.for_phase("decode").backend == "full"
    assert config.for_phase("prefill").backend == "breakable"
    assert config.for_phase("verify").backend == "eager"


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


def test_every_new_phase_key_is_parsed_into_typed_fields():
    text = json.dumps(
        {
            "decode": {
                "backend": "full",
                "compiler": "inductor",
                "inductor_mode": "max-autotune-no-cudagraphs",
                "on_recompile": "raise",
                "cache_dir": "/var/cache/devgraph",
                "warmup_iters": 1,
            },
            "encode": {"lazy": True, "max_graphs": 8, "max_graph_bytes": 0, "max_size": 4096},
        }
    )
    config = DeviceGraphConfig.parse(text)
    decode = config.for_phase("decode")
    assert (decode.backend, decode.compiler, decode.inductor_mode) == (
        "full",
        "inductor",
        "max-autotune-no-cudagraphs",
    )
    assert (decode.on_recompile, decode.cache_dir, decode.warmup_iters) == ("raise", "/var/cache/devgraph", 1)
    assert decode.backend_options() == {
        "compiler": "inductor",
        "inductor_mode": "max-autotune-no-cudagraphs",
        "on_recompile": "raise",
        "cache_dir": "/var/cache/devgraph",
    }
    encode = config.for_phase("encode")
    assert (encode.lazy, encode.max_graphs, encode.max_graph_bytes, encode.max_size) == (True, 8, 0, 4096)
    assert json.loads(json.dumps({p: c.to_json() for p, c in config.phases.items()})) == json.loads(text)


def test_compiler_is_accepted_for_full_and_auto():
    """Issue 10: {"decode": {"backend": "full", "compiler": "inductor"}} must be accepted and kept."""
    config = DeviceGraphConfig.parse('{"decode": {"backend": "full", "compiler": "inductor"}, "prefill": '
                                     '{"compiler": "eager"}}')  # fmt: skip
    assert config.for_phase("decode").compiler == "inductor"
    assert config.for_phase("prefill").compiler == "eager"


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
        ('{"prefill": {"backend": "tc_piecewise", "compiler": "gcc"}}', "compiler 'gcc'"),
        ('{"prefill": {"max_size": -4}}', "max_size must be an integer from 1 to"),
        ('{"prefill": {"sizes": [16, "x"]}}', "sizes entry must be an integer"),
        ('{"prefill": {"size": [16]}}', "did you mean 'sizes'"),
        ('{"decode": {"on_recompile": "ignore"}}', "accepted: warn, raise"),
        ('{"decode": {"cache_dir": ""}}', "cache_dir must be a directory path"),
        ('{"decode": {"warmup_iters": 17}}', "warmup_iters must be an integer from 0 to 16"),
        ('{"decode": {"warmup_iters": -1}}', "warmup_iters must be an integer from 0 to 16"),
        ('{"encode": {"max_graphs": 0}}', "max_graphs must be an integer from 1"),
        ('{"encode": {"max_graph_bytes": -1}}', "max_graph_bytes must be an integer from 0"),
        ('{"encode": {"lazy": "yes"}}', "lazy must be true or false"),
        ('{"encode": {"lazy": false, "max_graphs": 4}}', "lazy is false"),
        ('{"decode": NaN}', "NaN is not a number JSON accepts"),
    ],
)
def test_bad_values_raise_one_line_config_error_with_accepted(value, fragment):
    message = _error(value)
    assert fragment in message
    assert message.startswith("--device-graph-mode ")


# -- compiler and inductor_mode apply to compiling backends only ----------------------------------------
@pytest.mark.parametrize("backend", ["breakable", "eager", "disabled", "toy_plugin"])
def test_compiler_on_a_backend_that_ignores_it_is_an_error(backend):
    value = json.dumps({"prefill": {"backend": backend, "compiler": "inductor"}})
    message = _error(value, known_modes=["full", "breakable", "tc_piecewise", "toy_plugin"])
    assert "would be ignored" in message and f"backend {backend!r}" in message
    assert "full, tc_piecewise" in message


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_inductor_modes_with_their_own_cuda_graphs_are_refused_with_the_reason(mode):
    value = json.dumps({"decode": {"backend": "full", "compiler": "inductor", "inductor_mode": mode}})
    message = _error(value)
    assert "nest inside devgraph's" in message and "max-autotune-no-cudagraphs" in message


def test_inductor_mode_needs_compiler_inductor():
    for extra in ({}, {"compiler": "eager"}):
        value = json.dumps({"decode": {"backend": "full", "inductor_mode": "default", **extra}})
        assert 'needs decode.compiler "inductor"' in _error(value)


def test_inductor_mode_on_breakable_names_the_backend():
    value = '{"prefill": {"backend": "breakable", "inductor_mode": "default"}}'
    assert "inductor_mode 'default' would be ignored: backend 'breakable'" in _error(value)


# -- hostile input: each one ConfigError line, the value shortened, what is accepted ---------------------
def test_deeply_nested_json():
    value = '{"decode": ' * 5000 + '"full"' + "}" * 5000
    message = _error(value)
    assert "nests deeper than" in message and len(message) < 400


def test_five_thousand_digit_integer():
    message = _error('{"decode": {"max_size": ' + "9" * 5000 + "}}")
    assert "5000 digits" in message and "at most 20 digits" in message and len(message) < 400


@pytest.mark.parametrize(("phase", "cap"), [("decode", 65536), ("verify", 65536), ("prefill", 1 << 20)])
def test_max_size_past_the_hard_cap(phase, cap):
    message = _error(json.dumps({phase: {"max_size": 10**9}}))
    assert f"from 1 to {cap}" in message and "hard cap" in message and "free memory" in message
    assert DeviceGraphConfig.parse(json.dumps({phase: {"max_size": cap}})).for_phase(phase).max_size == cap


def test_duplicate_phase_keys():
    assert "phase 'decode' is given twice" in _error('{"decode": "full", "decode": "breakable"}')


def test_duplicate_keys_inside_a_phase():
    message = _error('{"decode": {"max_size": 8, "max_size": 16}}')
    assert "key 'max_size' is given twice in phase 'decode'" in message


def test_a_100_kb_bad_value_is_echoed_shortened():
    message = _error('{"decode": "' + "x" * 100_000 + '"}')
    assert len(message) < 300 and "xxxxxxxxxx" in message
    message = _error('{"decode": "' + "y" * 50_000 + '"}')  # under the length bound: the mode check
    assert len(message) < 400 and "mode 'yyyy" in message and "(50002 chars)" in message


def test_the_flag_text_is_bounded():
    message = _error(" " * (MAX_FLAG_CHARS + 1))
    assert f"at most {MAX_FLAG_CHARS}" in message


def test_non_string_phase_names_in_a_mapping():
    message = _error({7: "full"})
    assert "phase names are strings" in message and "7 (an int)" in message


def test_mapping_values_parse_like_json():
    config = DeviceGraphConfig.parse({"decode": {"backend": "full", "sizes": (1, 2)}})
    assert config.for_phase("decode").sizes == (1, 2)


@pytest.mark.parametrize("key", ["max_size", "warmup_iters", "max_graphs", "max_graph_bytes"])
def test_booleans_where_integers_are_expected(key):
    assert "(a boolean)" in _error(json.dumps({"encode": {key: True}}))


def test_floats_for_sizes():
    assert "got 16.0 (a float)" in _error('{"decode": {"sizes": [16.0]}}')
    assert "got 2048.0 (a float)" in _error('{"prefill": {"max_size": 2048.0}}')


def test_empty_size_list():
    assert "decode.sizes is empty" in _error('{"decode": {"sizes": []}}')


def test_size_lists_are_bounded():
    message = _error(json.dumps({"prefill": {"sizes": list(range(1, 2001))}}))
    assert "2000 entries; at most 1024" in message
    huge = json.dumps({"prefill": {"sizes": list(range(1, 100_001))}})
    assert "characters long" in _error(huge)


def test_non_string_flag_value():
    assert "must be a string" in _error(3.5)


# -- config only parses -----------------------------------------------------------------------------------
def test_config_imports_neither_factory_nor_plugins():
    tree = ast.parse(CONFIG_PY.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert not {"devgraph.flag.factory", "devgraph.registry.plugins", "devgraph.registry.rules"} & imported
    assert not hasattr(DeviceGraphConfig, "resolve")


def test_parse_checks_mode_names_against_the_registry(monkeypatch):
    registry = Registry(entry_points=False)
    monkeypatch.setattr("devgraph.registry.plugins._registry", registry)
    assert "mode 'toy_plugin' is not valid" in _error("decode=toy_plugin")

    class ToyPlugin(FullGraphBackend):
        pass

    registry.add_backend(ToyPlugin, name="toy_plugin", platform="cpu", origin="test")
    assert DeviceGraphConfig.parse("decode=toy_plugin").for_phase("decode").backend == "toy_plugin"


def test_known_modes_can_be_passed_in():
    config = DeviceGraphConfig.parse("decode=mine", known_modes=["mine"])
    assert config.for_phase("decode").backend == "mine"
    assert DeviceGraphConfig.parse("auto", known_modes=lambda: []).for_phase("decode").backend == "auto"


def test_phase_config_checks_direct_construction():
    with pytest.raises(ConfigError, match="max_size must be an integer"):
        PhaseConfig(max_size=10**9)
    with pytest.raises(ConfigError, match="would be ignored"):
        PhaseConfig(backend="breakable", compiler="inductor")


# -- argparse ---------------------------------------------------------------------------------------------
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
    err = capsys.readouterr().err
    assert "argument --device-graph-mode: '{\"decode\": \"ful\"}': mode 'ful'" in err
    assert "did you mean 'full'" in err


def test_capped_cuts_max_size_and_sizes_to_the_limit_and_says_what_was_asked() -> None:
    config = DeviceGraphConfig.parse('{"decode": {"backend": "full", "sizes": [1, 8, 64], "max_size": 512}}')
    capped, asked = config.capped("decode", 16)
    decode = capped.for_phase("decode")
    assert decode.max_size == 16
    assert decode.sizes == (1, 8, 16)
    assert decode.backend == config.for_phase("decode").backend
    assert "max_size 512" in asked and "(1, 8, 64)" in asked
    assert capped.for_phase("prefill") == config.for_phase("prefill")


def test_capped_returns_the_same_config_when_nothing_exceeds_the_limit() -> None:
    config = DeviceGraphConfig.parse('{"decode": {"backend": "full", "sizes": [1, 2], "max_size": 4}}')
    assert config.capped("decode", 4) == (config, "")
    assert DeviceGraphConfig.parse("auto").capped("prefill", 1) == (DeviceGraphConfig.parse("auto"), "")


# -- names are exact (lower case, as documented); every near miss names the one meant ------------------
@pytest.mark.parametrize(
    ("value", "meant"),
    [
        ("FULL", "full"),  # case alone: difflib on the raw names found nothing
        ("AUTO", "auto"),
        ("decode=FULL", "full"),
        ("DECODE=full", "decode"),
        ("Decode=full", "decode"),  # raw difflib suggested 'encode'
        ("TC-PIECEWISE", "tc_piecewise"),
        ("decode=tc-piecewise", "tc_piecewise"),
        ('{"Decode": "full"}', "decode"),
        ('{"decode": {"Backend": "full"}}', "backend"),
        ('{"decode": {"MAX-SIZE": 8}}', "max_size"),
        ('{"decode": {"backend": "full", "compiler": "INDUCTOR"}}', "inductor"),
        ('{"decode": {"on_recompile": "Raise"}}', "raise"),
        ('{"decode": {"backend": "full", "compiler": "inductor", "inductor_mode": "Default"}}', "default"),
        ("decode=ful", "full"),
    ],
)
def test_every_closed_set_of_names_hints_the_name_meant(value, meant):
    message = _error(value)
    assert f"(did you mean {meant!r}?)" in message and "; accepted: " in message


def test_names_far_from_every_accepted_one_get_no_hint():
    message = _error("decode=xyzzy")
    assert "did you mean" not in message and "accepted: auto, breakable" in message
