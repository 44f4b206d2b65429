"""Compatibility rules as data; vendor policy lives in its plug-in."""

from __future__ import annotations

import pytest
from fakes_common import ensure_plugins_importable

from devgraph.errors import ConfigError, RegistrationError
from devgraph.registry.rules import BUILTIN_RULES, CompatibilityRule, apply_rules, check_rule

ensure_plugins_importable()

from devgraph_rocm import plugin as rocm_plugin  # noqa: E402
from devgraph_rocm.rules import ROCM_NO_BREAKABLE  # noqa: E402


def test_no_rule_matches():
    assert apply_rules("decode", "full", {"platform": "cpu"}, BUILTIN_RULES) == ("full", [])


def test_enforce_eager_downgrades_everything(caplog):
    backend, applied = apply_rules("prefill", "tc_piecewise", {"enforce_eager": True}, BUILTIN_RULES)
    assert backend == "eager"
    assert applied[0].rule == "enforce-eager"
    assert "enforce-eager" in caplog.text


def test_core_rules_hold_no_vendor_policy():
    assert "rocm-no-breakable" not in {r.name for r in BUILTIN_RULES}
    assert apply_rules("prefill", "breakable", {"platform": "rocm"}, BUILTIN_RULES) == ("breakable", [])


def test_rocm_plugin_registers_its_rule_through_the_hook():
    registered = []
    rocm_plugin.devgraph_compatibility_rules(register=registered.append)
    assert registered == [ROCM_NO_BREAKABLE]
    backend, applied = apply_rules("prefill", "breakable", {"platform": "rocm"}, registered)
    assert (backend, applied[0].rule) == ("tc_piecewise", "rocm-no-breakable")
    assert apply_rules("prefill", "breakable", {"platform": "cpu"}, registered) == ("breakable", [])


def test_chained_rules_apply_in_turn():
    rules = [
        CompatibilityRule("a", "first", lambda f: True, "breakable", backends=frozenset({"full"})),
        CompatibilityRule("b", "second", lambda f: True, "eager", backends=frozenset({"breakable"})),
    ]
    backend, applied = apply_rules("decode", "full", {}, rules)
    assert backend == "eager"
    assert [d.rule for d in applied] == ["a", "b"]


def test_phase_filter():
    rule = CompatibilityRule("x", "r", lambda f: True, "eager", phases=frozenset({"prefill"}))
    assert apply_rules("decode", "full", {}, [rule])[0] == "full"
    assert apply_rules("prefill", "full", {}, [rule])[0] == "eager"


def test_loop_is_an_error():
    rules = [
        CompatibilityRule("a", "r", lambda f: True, "breakable", backends=frozenset({"full"})),
        CompatibilityRule("b", "r", lambda f: True, "full", backends=frozenset({"breakable"})),
    ]
    with pytest.raises(ConfigError, match="loop"):
        apply_rules("decode", "full", {}, rules)


def test_predicate_sees_features_platform_and_phase():
    seen = []
    rule = CompatibilityRule("look", "r", lambda f: seen.append(dict(f)) or False, "eager")
    apply_rules("verify", "full", {"platform": "npu", "dynamic_lora": True}, [rule])
    assert seen == [{"platform": "npu", "dynamic_lora": True, "phase": "verify"}]


def test_a_predicate_that_raises_is_skipped_and_reported(caplog):
    def broken(features):
        raise KeyError("no_such_feature")

    errors = []
    rules = [
        CompatibilityRule("broken", "r", broken, "eager"),
        CompatibilityRule("lora", "r", lambda f: True, "breakable", backends=frozenset({"full"})),
    ]
    backend, applied = apply_rules(
        "decode", "full", {}, rules, on_error=lambda r, e: errors.append((r.name, e))
    )
    assert backend == "breakable" and [d.rule for d in applied] == ["lora"]  # the other rule still decided
    assert [(name, type(exc)) for name, exc in errors] == [("broken", KeyError)]  # asked once per decision
    assert "rule 'broken' raised KeyError" in caplog.text


def test_a_predicate_raising_system_exit_does_not_end_the_process():
    def exits(features):
        raise SystemExit(3)

    assert apply_rules("decode", "full", {}, [CompatibilityRule("exit", "r", exits, "eager")]) == ("full", [])


def test_keyboard_interrupt_in_a_predicate_propagates():
    def interrupted(features):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        apply_rules("decode", "full", {}, [CompatibilityRule("ctrl-c", "r", interrupted, "eager")])


@pytest.mark.parametrize(
    ("rule", "fragment"),
    [
        ("enforce-eager", "is not a devgraph.CompatibilityRule"),
        (CompatibilityRule("", "r", lambda f: True, "eager"), "name must be a non-empty string"),
        (CompatibilityRule("x", "r", True, "eager"), "when= must be callable"),  # type: ignore[arg-type]
        (CompatibilityRule("x", "r", lambda f: True, "auto"), "not a backend name"),
        (CompatibilityRule("x", "r", lambda f: True, "a,b=c"), "not a backend name"),
        (CompatibilityRule("x", "r", lambda f: True, "eager", phases=frozenset({"decod"})), "unknown phases"),
        (CompatibilityRule("x", "r", lambda f: True, "eager", backends={"full"}), "frozenset"),  # type: ignore[arg-type]
    ],
)
def test_check_rule_rejects_malformed_rules(rule, fragment):
    with pytest.raises(RegistrationError, match=fragment):
        check_rule(rule)
