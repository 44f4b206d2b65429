"""pytest plug-in of the conformance kit, registered through devgraph's ``pytest11`` entry point.

``pytest --devgraph-backend PLATFORM:NAME`` (repeatable) adds one test item per check and target.
Given without test paths it runs only the kit (the project's own tests are not collected); given with
paths (``pytest tests/ --devgraph-backend cuda:full``) it runs both. Without the option the plug-in
does nothing. ``--devgraph-check NAME`` (repeatable) limits the checks; ``--devgraph-require-sync``
fails, instead of skips, the capture-error check where the platform cannot detect host syncs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

OPTION = "--devgraph-backend"
MARKER = "devgraph_conformance"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("devgraph", "devgraph conformance kit")
    group.addoption(
        OPTION,
        action="append",
        default=[],
        metavar="PLATFORM:NAME",
        dest="devgraph_backends",
        help="run the devgraph conformance kit against this registered backend (repeatable), "
        "e.g. cpu:full, cuda:breakable",
    )
    group.addoption(
        "--devgraph-check",
        action="append",
        default=[],
        metavar="CHECK",
        dest="devgraph_checks",
        help="run only this conformance check (repeatable)",
    )
    group.addoption(
        "--devgraph-phase",
        default=None,
        metavar="PHASE",
        dest="devgraph_phase",
        help="phase the backend is built for (default: decode if it serves decode)",
    )
    group.addoption(
        "--devgraph-require-sync",
        action="store_true",
        default=False,
        dest="devgraph_require_sync",
        help="fail the capture-error check where the platform does not detect host syncs",
    )


def _targets(config: pytest.Config) -> list[str]:
    return list(config.getoption("devgraph_backends", default=None) or [])


def _kit_only(config: pytest.Config) -> bool:
    """No test paths on the command line: run the kit alone."""
    source = getattr(config, "args_source", None)
    args_source = getattr(pytest.Config, "ArgsSource", None)
    if source is not None and args_source is not None:
        return source != args_source.ARGS
    return not any(
        Path(str(a).split("::")[0]).exists()
        for a in config.invocation_params.args
        if not str(a).startswith("-")
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: a check of the devgraph conformance kit (--devgraph-backend)"
    )
    if _targets(config):
        _check_options(config)


def _check_options(config: pytest.Config) -> None:
    """Bad kit options are usage errors, reported before collection (never an INTERNALERROR)."""
    from devgraph import ConfigError, get_registry
    from devgraph.contract.modes import MODE_NAME_PATTERN
    from devgraph.contract.phases import check_phase
    from devgraph.messages import shorten

    registered = sorted(f"{platform}:{name}" for platform, name in get_registry().backends)
    known = f"registered targets: {', '.join(registered) or 'none'} (`devgraph info` lists them)"
    for target in _targets(config):
        platform, sep, name = str(target).strip().partition(":")
        if not (
            sep
            and MODE_NAME_PATTERN.fullmatch(platform.strip())
            and MODE_NAME_PATTERN.fullmatch(name.strip())
        ):
            raise pytest.UsageError(
                f"{OPTION} {shorten(target)}: expected PLATFORM:NAME (e.g. cpu:full, cuda:breakable); {known}"
            )
        if f"{platform.strip()}:{name.strip()}" not in registered:
            raise pytest.UsageError(f"{OPTION} {shorten(target)} is not a registered backend; {known}")
    phase = config.getoption("devgraph_phase")
    if phase:
        try:
            check_phase(phase)
        except ConfigError as exc:
            raise pytest.UsageError(f"--devgraph-phase: {exc}") from None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if _targets(config) and _kit_only(config):
        return True
    return None


class KitCheckFailed(Exception):
    """A failed or errored conformance check (reported without a traceback into the kit)."""


class KitItem(pytest.Item):
    """One conformance check against one target."""

    def __init__(self, *, target: str, check: str, options: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target
        self.check = check
        self.options = options
        self.add_marker(MARKER)

    def runtest(self) -> None:
        from devgraph import DevGraphError
        from devgraph.testing import run_check

        try:
            result = run_check(self.target, self.check, options=self.options)
        except DevGraphError as exc:  # not registered, unusable here, bad options: say so in one line
            raise KitCheckFailed(f"{self.target}: {type(exc).__name__}: {exc}") from exc
        self.user_properties.append(("devgraph_result", result.status))
        if result.status == "skipped":
            pytest.skip(f"{self.target} {self.check}: {result.detail}")
        if result.status != "passed":
            raise KitCheckFailed(f"{self.target} {self.check} {result.status}: {result.detail}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, KitCheckFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"devgraph conformance {self.target} {self.check}"


class KitCollector(pytest.Collector):
    """The kit's items for every ``--devgraph-backend`` target."""

    def __init__(
        self, *, targets: list[str], checks: list[str], options: dict[str, Any], **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.targets = targets
        self.checks = checks
        self.options = options

    def collect(self) -> Iterator[KitItem]:
        for target in self.targets:
            for check in self.checks:
                yield KitItem.from_parent(
                    self, name=f"{check}[{target}]", target=target, check=check, options=self.options
                )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    targets = _targets(config)
    if not targets:
        return
    from devgraph.testing import check_names, parse_target

    for target in targets:
        parse_target(target)  # a malformed target is a usage error, reported before anything runs
    checks = list(config.getoption("devgraph_checks") or []) or check_names()
    unknown = sorted(set(checks) - set(check_names()))
    if unknown:
        raise pytest.UsageError(
            f"--devgraph-check: unknown check(s) {unknown}; accepted: {', '.join(check_names())}"
        )
    options: dict[str, Any] = {"require_sync_detection": bool(config.getoption("devgraph_require_sync"))}
    phase = config.getoption("devgraph_phase")
    if phase:
        options["phase"] = phase
    collector = KitCollector.from_parent(
        session,
        name="devgraph-conformance",
        nodeid="devgraph-conformance",
        targets=targets,
        checks=checks,
        options=options,
    )
    items.extend(collector.collect())
