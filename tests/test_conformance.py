"""The conformance kit: NPU and ROCm backends pass it through their fakes, its report and options, when a
check may be skipped, and the pytest plug-in that runs it from the command line. (The CPU strategies
passing every check, and broken backends failing, are tests/test_kit_mutations.py.)"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import fakes_npu
import fakes_rocm
import pytest
from fakes_common import ensure_plugins_importable, plugin_registry

from devgraph.errors import BackendUnavailableError, ConfigError
from devgraph.platforms.sim.platform import CpuSimPlatform
from devgraph.strategies import FullGraphBackend
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

DOCS = Path(__file__).resolve().parents[1] / "docs" / "conformance.md"


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
    # The fakes capture through the CPU simulator, which detects host syncs: nothing may be skipped.
    assert all(r.status == "passed" for r in report.results), report.table()


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
    with pytest.raises(KeyError, match="no result for check 'cleanup'"):
        report.result("cleanup")
    with pytest.raises(ConfigError):
        KitOptions(sizes=(1, 2))
    with pytest.raises(ConfigError):
        KitOptions(phase="decod")


@pytest.mark.parametrize("phase", ["prefill", "verify"])
def test_the_kit_runs_in_other_phases(phase):
    checks = ["padding_rows", "stale_rows", "step_once", "has_shape"]
    report = run_conformance("cpu:full", checks=checks, options={"phase": phase})
    assert report.phase == phase
    assert [r.status for r in report.results] == ["passed"] * len(checks), report.table()


class _SwallowsCaptureError(FullGraphBackend):
    def capture_one(self, key, forward_fn):
        try:
            return super().capture_one(key, forward_fn)
        except Exception:
            return forward_fn()


def test_capture_errors_is_skipped_only_where_the_platform_cannot_detect(monkeypatch):
    registry = plugin_registry()
    registry.add_backend(_SwallowsCaptureError, name="swallows", platform="cpu", origin="tests")
    # The CPU simulator detects host syncs, so a capture that succeeds despite one is a failure.
    assert run_check("cpu:swallows", "capture_errors", registry=registry).status == "failed"
    # A platform that says it cannot detect them: the check does not apply, unless the user requires it.
    monkeypatch.setattr(CpuSimPlatform, "detects_host_sync", False)
    skipped = run_check("cpu:swallows", "capture_errors", registry=registry)
    assert skipped.status == "skipped" and "does not detect host syncs" in skipped.detail
    required = run_check(
        "cpu:swallows", "capture_errors", options={"require_sync_detection": True}, registry=registry
    )
    assert required.status == "failed"
    # A correct backend on that platform still passes: the capture does fail there.
    assert run_check("cpu:full", "capture_errors").status == "passed"


def test_a_failed_report_raises_with_every_failure():
    registry = plugin_registry()
    registry.add_backend(_SwallowsCaptureError, name="swallows", platform="cpu", origin="tests")
    report = run_conformance("cpu:swallows", checks=["capture_errors", "has_shape"], registry=registry)
    assert not report.passed and [r.check for r in report.failures] == ["capture_errors"]
    with pytest.raises(ConformanceFailure, match=r"1 conformance check\(s\) did not pass:\n- capture_errors"):
        report.raise_for_failures()


def test_every_check_is_documented():
    text = DOCS.read_text()
    headings = set(re.findall(r"^### `(\w+)`", text, flags=re.MULTILINE))
    assert headings == set(check_names())
    for name, check in CHECKS.items():
        assert check.summary and check.run.__doc__, name


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


def test_pytest_plugin_reports_a_failed_check_with_its_message(tmp_path):
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent("""
        import devgraph
        from devgraph.strategies import FullGraphBackend


        @devgraph.register_backend(name="greedy", platform="cpu")
        class Greedy(FullGraphBackend):
            def has_shape(self, key):
                return True
    """)
    )
    run = _pytest(tmp_path, "--devgraph-backend", "cpu:greedy", "--devgraph-check", "has_shape")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "cpu:greedy has_shape failed: has_shape() is true before capture()" in run.stdout, run.stdout


def test_pytest_plugin_usage_errors(tmp_path):
    for target, message in [("cpu:nope", "cpu:nope"), ("garbage", "expected PLATFORM:NAME")]:
        run = _pytest(tmp_path, "--devgraph-backend", target, "--devgraph-check", "has_shape")
        assert run.returncode == 4 and message in run.stderr and "INTERNALERROR" not in run.stderr, (
            run.stdout + run.stderr
        )
    run = _pytest(tmp_path, "--devgraph-backend", "cpu:full", "--devgraph-check", "nope")
    assert run.returncode == 4 and "unknown check" in run.stderr, run.stdout + run.stderr
