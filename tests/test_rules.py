"""Compatibility rules as data."""

from __future__ import annotations

import pytest

from devgraph.errors import ConfigError
from devgraph.rules import BUILTIN_RULES, CompatibilityRule, apply_rules


def test_no_rule_matches():
    assert apply_rules("decode", "full", {"platform": "cpu"}, BUILTIN_RULES) == ("full", [])


def test_enforce_eager_downgrades_everything(caplog):
    backend, applied = apply_rules("prefill", "tc_piecewise", {"enforce_eager": True}, BUILTIN_RULES)
    assert backend == "eager"
    assert applied[0].rule == "enforce-eager"
    assert "enforce-eager" in caplog.text


def test_rocm_breakable_becomes_tc_piecewise():
    backend, applied = apply_rules("prefill", "breakable", {"platform": "rocm"}, BUILTIN_RULES)
    assert (backend, applied[0].rule) == ("tc_piecewise", "rocm-no-breakable")


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
