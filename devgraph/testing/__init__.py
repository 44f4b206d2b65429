"""The conformance kit: one suite any devgraph backend runs to prove it keeps the capture/replay contract.

From code::

    from devgraph.testing import run_conformance

    report = run_conformance("cpu:full")          # or "cuda:breakable", "mychip:full", ...
    print(report)                                 # one line per check: passed / failed / skipped
    report.raise_for_failures()

From pytest (the plug-in is registered through the ``pytest11`` entry point of devgraph)::

    pytest --devgraph-backend cpu:full --devgraph-backend cpu:breakable

Each check (see :data:`CHECKS`) builds its own runner with a fresh instance of the backend on the
platform's default device: static output addresses, padding rows, stale rows past the bucket, one
execution per step, stale inputs, the eager fallback, break ops and the forward context, ``has_shape``,
failed captures, ``release``/``cleanup``, capture errors, ``is_replaying()`` under ``runtime_session``,
host-side inputs and ownership by one runner. The target is a registered ``PLATFORM:NAME``; plug-ins load
as usual. docs/conformance.md says what each check proves and when a check may be skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from devgraph.registry.plugins import Registry
from devgraph.testing._kit import (
    Check,
    CheckFailed,
    CheckResult,
    CheckSkipped,
    ConformanceFailure,
    ConformanceReport,
    KitContext,
    KitOptions,
    Target,
    parse_target,
    run_checks,
    run_one,
)
from devgraph.testing.checks import CHECKS, KIT_MODEL_CONFIG

__all__ = [
    "CHECKS",
    "Check",
    "CheckFailed",
    "CheckResult",
    "CheckSkipped",
    "ConformanceFailure",
    "ConformanceReport",
    "KIT_MODEL_CONFIG",
    "KitContext",
    "KitOptions",
    "Target",
    "check_names",
    "parse_target",
    "run_check",
    "run_conformance",
]


def check_names() -> list[str]:
    """The names of every check, in the order the kit runs them."""
    return list(CHECKS)


def _select(checks: Iterable[str] | None) -> list[Check]:
    if checks is None:
        return list(CHECKS.values())
    selected = []
    for name in checks:
        if name not in CHECKS:
            from devgraph import ConfigError

            raise ConfigError(f"unknown conformance check {name!r}; accepted: {', '.join(CHECKS)}")
        selected.append(CHECKS[name])
    return selected


def _options(options: KitOptions | Mapping[str, Any] | None) -> KitOptions:
    if options is None:
        return KitOptions()
    if isinstance(options, KitOptions):
        return options
    return KitOptions(**options)


def run_conformance(
    target: str | Target,
    *,
    checks: Iterable[str] | None = None,
    options: KitOptions | Mapping[str, Any] | None = None,
    registry: Registry | None = None,
) -> ConformanceReport:
    """Run the conformance kit against the registered backend ``target`` (``"PLATFORM:NAME"``).

    ``checks`` limits the run to some checks (names from :func:`check_names`); ``options`` is a
    :class:`KitOptions` (or a mapping of its fields). Returns a :class:`ConformanceReport` with one
    :class:`CheckResult` per check; it does not raise for failed checks (call
    ``report.raise_for_failures()``). Raises :class:`~devgraph.errors.BackendUnavailableError` when the
    backend is not registered or cannot run here, with the reason.
    """
    return run_checks(parse_target(target), _select(checks), _options(options), registry)


def run_check(
    target: str | Target,
    check: str,
    *,
    options: KitOptions | Mapping[str, Any] | None = None,
    registry: Registry | None = None,
) -> CheckResult:
    """Run one check against ``target``; see :func:`run_conformance`."""
    return run_one(parse_target(target), _select([check])[0], _options(options), registry)
