"""Compatibility rules: data that downgrades a phase's backend when an engine feature needs it.

Each rule names itself, so every downgrade in the log says which rule made it and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from devgraph.errors import ConfigError

__all__ = ["CompatibilityRule", "Downgrade", "apply_rules", "BUILTIN_RULES"]

logger = logging.getLogger("devgraph.rules")


@dataclass(frozen=True)
class CompatibilityRule:
    """If ``when(features)`` holds for a phase running one of ``backends``, use ``downgrade_to`` instead.

    ``features`` is the engine's feature mapping plus ``platform`` (and ``phase``). ``phases`` /
    ``backends`` of ``None`` match every phase / backend.
    """

    name: str
    reason: str
    when: Callable[[Mapping[str, Any]], bool]
    downgrade_to: str
    phases: frozenset[str] | None = None
    backends: frozenset[str] | None = None

    def matches(self, phase: str, backend: str, features: Mapping[str, Any]) -> bool:
        if self.phases is not None and phase not in self.phases:
            return False
        if self.backends is not None and backend not in self.backends:
            return False
        return backend != self.downgrade_to and bool(self.when(features))


@dataclass(frozen=True)
class Downgrade:
    """One applied rule: ``phase`` went from ``before`` to ``after`` because of ``rule``."""

    phase: str
    before: str
    after: str
    rule: str
    reason: str


def apply_rules(
    phase: str, backend: str, features: Mapping[str, Any], rules: Iterable[CompatibilityRule]
) -> tuple[str, list[Downgrade]]:
    """Apply ``rules`` until none matches; returns the final backend and the downgrades made (logged)."""
    rules = list(rules)
    features = {**features, "phase": phase}
    applied: list[Downgrade] = []
    for _ in range(len(rules) + 1):
        rule = next((r for r in rules if r.matches(phase, backend, features)), None)
        if rule is None:
            return backend, applied
        step = Downgrade(phase, backend, rule.downgrade_to, rule.name, rule.reason)
        logger.warning(
            "devgraph: %s phase: %s -> %s (rule %r: %s)",
            phase,
            backend,
            rule.downgrade_to,
            rule.name,
            rule.reason,
        )
        applied.append(step)
        backend = rule.downgrade_to
    raise ConfigError(f"compatibility rules loop for phase {phase!r}: {[d.rule for d in applied]}")


BUILTIN_RULES: tuple[CompatibilityRule, ...] = (
    CompatibilityRule(
        name="enforce-eager",
        reason="the engine asked for eager execution (features['enforce_eager'])",
        when=lambda f: bool(f.get("enforce_eager")),
        downgrade_to="eager",
    ),
    CompatibilityRule(
        name="rocm-no-breakable",
        reason="breakable segments are not validated on ROCm (hipGraph capture/end churn); tc_piecewise "
        "gives the same piecewise replay there",
        when=lambda f: f.get("platform") == "rocm",
        downgrade_to="tc_piecewise",
        backends=frozenset({"breakable"}),
    ),
    CompatibilityRule(
        name="dynamic-lora-needs-breaks",
        reason="LoRA adapters that change per batch (features['dynamic_lora']) "
        "cannot be baked into one graph",
        when=lambda f: bool(f.get("dynamic_lora")),
        downgrade_to="breakable",
        backends=frozenset({"full"}),
    ),
    CompatibilityRule(
        name="torch-compile-unavailable",
        reason="torch.compile is unavailable here (features['torch_compile'] is False)",
        when=lambda f: f.get("torch_compile") is False,
        downgrade_to="breakable",
        backends=frozenset({"tc_piecewise"}),
    ),
)
