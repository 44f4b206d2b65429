"""Compatibility rules: data that downgrades a phase's backend when an engine feature needs it.

Each rule names itself, so every downgrade in the log says which rule made it and why. Core ships only
vendor-neutral rules; a vendor's policy (ROCm's ``rocm-no-breakable``) lives in its plug-in and arrives
through the ``devgraph_compatibility_rules`` hook.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from devgraph.contract.modes import MODE_NAME_PATTERN, SPECIAL_MODES, Strategy
from devgraph.contract.phases import PHASES
from devgraph.errors import ConfigError, RegistrationError
from devgraph.messages import describe_error, shorten

__all__ = ["BUILTIN_RULES", "CompatibilityRule", "Downgrade", "RuleErrorHandler", "apply_rules", "check_rule"]

logger = logging.getLogger(__name__)

#: Called with the rule whose predicate raised and the exception (the registry records it on the plug-in).
RuleErrorHandler = Callable[["CompatibilityRule", BaseException], None]


@dataclass(frozen=True)
class CompatibilityRule:
    """If ``when(features)`` holds for a phase running one of ``backends``, use ``downgrade_to`` instead.

    ``features`` is the engine's feature mapping plus ``platform`` (the platform name) and ``phase``.
    ``phases`` / ``backends`` of ``None`` match every phase / backend.
    """

    name: str
    reason: str
    when: Callable[[Mapping[str, Any]], bool]
    downgrade_to: str
    phases: frozenset[str] | None = None
    backends: frozenset[str] | None = None

    def applies_to(self, phase: str, backend: str) -> bool:
        """Whether the rule's filters select ``backend`` in ``phase`` (the predicate is not asked)."""
        if self.phases is not None and phase not in self.phases:
            return False
        if self.backends is not None and backend not in self.backends:
            return False
        return backend != self.downgrade_to

    def matches(self, phase: str, backend: str, features: Mapping[str, Any]) -> bool:
        return self.applies_to(phase, backend) and bool(self.when(features))


@dataclass(frozen=True)
class Downgrade:
    """One applied rule: ``phase`` went from ``before`` to ``after`` because of ``rule``."""

    phase: str
    before: str
    after: str
    rule: str
    reason: str


def check_rule(rule: object) -> CompatibilityRule:
    """``rule`` if it is a well-formed :class:`CompatibilityRule`; :class:`RegistrationError` otherwise."""
    if not isinstance(rule, CompatibilityRule):
        raise RegistrationError(
            f"{shorten(rule)} is not a devgraph.CompatibilityRule; register CompatibilityRule(name=, "
            "reason=, when=, downgrade_to=, phases=, backends=) objects"
        )
    if not isinstance(rule.name, str) or not rule.name.strip():
        raise RegistrationError(f"compatibility rule {shorten(rule.name)}: name must be a non-empty string")
    if not callable(rule.when):
        raise RegistrationError(f"compatibility rule {rule.name!r}: when= must be callable(features) -> bool")
    target = rule.downgrade_to
    if not isinstance(target, str) or not (
        target == Strategy.EAGER.value
        or (MODE_NAME_PATTERN.fullmatch(target) and target not in SPECIAL_MODES)
    ):
        raise RegistrationError(
            f"compatibility rule {rule.name!r}: downgrade_to {shorten(target)} is not a backend name "
            "(eager, full, breakable, tc_piecewise or a registered name)"
        )
    for what, names, accepted in (
        ("phases", rule.phases, PHASES),
        ("backends", rule.backends, None),
    ):
        if names is None:
            continue
        if not isinstance(names, frozenset) or not all(isinstance(n, str) for n in names):
            raise RegistrationError(
                f"compatibility rule {rule.name!r}: {what} must be None or a frozenset of names, "
                f"got {shorten(names)}"
            )
        unknown = sorted(names - set(accepted)) if accepted is not None else []
        if unknown:
            raise RegistrationError(
                f"compatibility rule {rule.name!r}: unknown phases {unknown}; accepted: {', '.join(PHASES)}"
            )
    return rule


def _holds(rule: CompatibilityRule, features: Mapping[str, Any], on_error: RuleErrorHandler | None) -> bool:
    """The rule's predicate; a predicate that raises does not hold (the rule is skipped, the error kept)."""
    try:
        return bool(rule.when(features))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a plug-in's predicate must not decide (or break) the engine's start-up
        logger.warning(
            "devgraph: compatibility rule %r raised %s; the rule is skipped for this decision",
            rule.name,
            describe_error(exc),
        )
        if on_error is not None:
            on_error(rule, exc)
        return False


def apply_rules(
    phase: str,
    backend: str,
    features: Mapping[str, Any],
    rules: Iterable[CompatibilityRule],
    *,
    on_error: RuleErrorHandler | None = None,
) -> tuple[str, list[Downgrade]]:
    """Apply ``rules`` until none matches; returns the final backend and the downgrades made (logged).

    ``features`` should carry ``platform``; ``phase`` is added here. A predicate that raises is skipped
    for this decision, logged, and handed to ``on_error``; the backend stays as it was.
    """
    rules = list(rules)
    features = {**features, "phase": phase}
    applied: list[Downgrade] = []
    failed: set[int] = set()

    def on_failure(rule: CompatibilityRule, exc: BaseException) -> None:
        failed.add(id(rule))
        if on_error is not None:
            on_error(rule, exc)

    for _ in range(len(rules) + 1):
        rule = next(
            (
                r
                for r in rules
                if id(r) not in failed and r.applies_to(phase, backend) and _holds(r, features, on_failure)
            ),
            None,
        )
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
