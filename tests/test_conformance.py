"""The conformance kit: every CPU backend passes it, NPU and ROCm pass it through their fakes, broken backends
fail the checks that describe their bug, and the pytest plug-in runs it from the command line."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import fakes_npu
import fakes_rocm
import pytest
from fakes_common import ensure_plugins_importable, plugin_registry

from devgraph.errors import BackendUnavailableError, ConfigError
from devgraph.strategies import BreakableBackend, FullGraphBackend
from devgraph.testing import (
    CHECKS,
    ConformanceFailure,
    KitOptions,
    check_names,
    parse_target,
    run_check,
    run_conformance,
)

ensure_plugins_importable()

from devgraph_npu import plugin as npu_plugin  # noqa: E402
from devgraph_rocm import plugin as rocm_plugin  # noqa: E402

CPU_TARGETS = ["cpu:full", "cpu:breakable", "cpu:tc_piecewise"]
#: Checks a target may skip, and why (anything else must pass).
MAY_SKIP = {
    # The simulator records torch.compile'd pieces whole (record_opaque), so a host sync inside one is
    # invisible to it; on a GPU the same .item() fails capture.
    ("cpu:tc_piecewise", "capture_errors"),
    ("rocm:tc_piecewise", "capture_errors"),
}


@pytest.mark.parametrize("check", check_names())
@pytest.mark.parametrize("target", CPU_TARGETS)
def test_cpu_backends_pass(target, check):
    result = run_check(target, check)
    if result.status == "skipped":
        assert (target, check) in MAY_SKIP, result.detail
    else:
        assert result.status == "passed", result.detail


@contextlib.contextmanager
def _fake(kind: str, monkeypatch: pytest.MonkeyPatch):
    module, plugin = {"npu": (fakes_npu, npu_plugin), "rocm": (fakes_rocm, rocm_plugin)}[kind]
    with module.install(monkeypatch):
        yield plugin_registry(plugin)


@pytest.mark.parametrize("target", ["npu:full", "rocm:full", "rocm:tc_piecewise"])
def test_vendor_backends_pass_through_their_fakes(target, monkeypatch):
    monkeypatch.delenv("DEVGRAPH_ROCM_ON_CUDA", raising=False)
    with _fake(target.split(":")[0], monkeypatch) as registry:
        report = run_conformance(target, registry=registry)
    assert report.platform == target.split(":")[0]
    report.raise_for_failures()
    skipped = {(target, r.check) for r in report.results if r.status == "skipped"}
    assert skipped <= MAY_SKIP, report.table()


def test_refused_backend_is_reported_with_its_reason(monkeypatch):
    with (
        _fake("rocm", monkeypatch) as registry,
        pytest.raises(BackendUnavailableError, match="refused on ROCm"),
    ):
        run_conformance("rocm:breakable", registry=registry)


def test_unknown_and_unusable_targets():
    with pytest.raises(BackendUnavailableError, match="no backend cpu:nope is registered"):
        run_conformance("cpu:nope")
    with pytest.raises(ConfigError, match="PLATFORM:NAME"):
        parse_target("full")
    with pytest.raises(ConfigError, match="unknown conformance check"):
        run_conformance("cpu:full", checks=["nope"])


def test_report_api():
    report = run_conformance("cpu:full", checks=["has_shape", "host_inputs"], options={"sizes": (2, 4, 8)})
    assert report.passed and [r.check for r in report.results] == ["has_shape", "host_inputs"]
    assert report.result("has_shape").detail.startswith("captured [2, 4, 8]")
    data = report.as_dict()
    assert data["target"] == "cpu:full" and data["passed"] and data["results"][0]["status"] == "passed"
    assert "2 passed" in report.table()
    report.raise_for_failures()
    with pytest.raises(ConfigError):
        KitOptions(sizes=(1, 2))


# -- the kit catches broken backends -------------------------------------------------------------------
class _PythonReplay:
    def __init__(self, forward_fn: Callable[[], Any]) -> None:
        self.forward_fn = forward_fn
        self.outputs = None

    def replay(self) -> Any:
        return self.forward_fn()  # "replays" by running Python again: new tensors, never stale

    def reset(self) -> None:
        self.forward_fn = None


class PythonReplayBackend(FullGraphBackend):
    """Captures nothing and re-runs the forward at replay."""

    def _capture(self, key, forward_fn):
        entry = _PythonReplay(forward_fn)
        entry.outputs = forward_fn()
        return entry


class LeakyBackend(FullGraphBackend):
    """Forgets to release its graphs on cleanup."""

    def cleanup(self) -> None:
        self.leaked = dict(self._entries)
        self._entries.clear()


class NoReplayFlagBackend(BreakableBackend):
    """Does not set is_replaying() around replays."""

    def runtime_session(self):
        return contextlib.nullcontext()


class GreedyHasShapeBackend(FullGraphBackend):
    def has_shape(self, key: int) -> bool:
        return True


@pytest.mark.parametrize(
    ("cls", "mode", "check", "fragment"),
    [
        (PythonReplayBackend, "captured", "static_addresses", "different addresses"),
        (PythonReplayBackend, "captured", "stale_inputs", "re-runs Python at replay"),
        (LeakyBackend, "captured", "cleanup", "still alive after close()"),
        (NoReplayFlagBackend, "eager", "runtime_session", "is_replaying() is False inside runtime_session()"),
        (NoReplayFlagBackend, "eager", "break_ops", "is_replaying() False at replay"),
        (GreedyHasShapeBackend, "captured", "has_shape", "before capture()"),
    ],
)
def test_kit_catches_broken_backends(cls, mode, check, fragment):
    registry = plugin_registry()
    registry.add_backend(cls, name="broken", platform="cpu", origin="tests")
    result = run_check("cpu:broken", check, options=KitOptions(break_ops=mode), registry=registry)
    assert result.status == "failed", result
    assert fragment in result.detail
    report = run_conformance(
        "cpu:broken", checks=[check], options=KitOptions(break_ops=mode), registry=registry
    )
    with pytest.raises(ConformanceFailure, match=check):
        report.raise_for_failures()


# -- the pytest plug-in --------------------------------------------------------------------------------
def _pytest(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    # Whether devgraph's pytest11 entry point is installed, as pytest sees it (every distribution on the
    # path, not only the first of each name). Naming the plug-in with -p when installed registers it twice.
    probe = (
        "import importlib.metadata as m; print(any(e.group == 'pytest11' and e.value == "
        "'devgraph.testing.pytest_plugin' for d in m.distributions() for e in d.entry_points))"
    )
    installed = (
        subprocess.run(
            [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60
        ).stdout.strip()
        == "True"
    )
    extra = [] if installed else ["-p", "devgraph.testing.pytest_plugin"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_pytest_plugin_runs_the_kit(tmp_path):
    run = _pytest(
        tmp_path,
        "--devgraph-backend",
        "cpu:full",
        "--devgraph-check",
        "has_shape",
        "--devgraph-check",
        "runtime_session",
        "-vv",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "devgraph-conformance::has_shape[cpu:full] PASSED" in run.stdout
    assert "2 passed" in run.stdout


def test_pytest_plugin_is_inert_without_the_option_and_adds_to_given_paths(tmp_path):
    (tmp_path / "test_own.py").write_text(
        textwrap.dedent("""
        def test_own():
            assert True
    """)
    )
    run = _pytest(tmp_path)
    assert run.returncode == 0 and "1 passed" in run.stdout and "devgraph" not in run.stdout, run.stdout
    run = _pytest(
        tmp_path, "test_own.py", "--devgraph-backend", "cpu:breakable", "--devgraph-check", "has_shape"
    )
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout + run.stderr


def test_pytest_plugin_reports_failures_and_usage_errors(tmp_path):
    run = _pytest(tmp_path, "--devgraph-backend", "cpu:nope", "--devgraph-check", "has_shape")
    assert run.returncode == 1 and "no backend cpu:nope is registered" in run.stdout, run.stdout
    run = _pytest(tmp_path, "--devgraph-backend", "cpu:full", "--devgraph-check", "nope")
    assert run.returncode == 4 and "unknown check" in run.stderr, run.stdout + run.stderr


def test_every_check_is_documented():
    for name, check in CHECKS.items():
        assert check.summary and check.run.__doc__, name
