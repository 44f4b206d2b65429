"""The example third-party plug-in: pip-installed into a temporary target, it shows up in ``devgraph info``
and passes the conformance kit (through the pytest plug-in and from code)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from fakes_common import ROOT

from devgraph.testing import check_names

EXAMPLE = ROOT / "docs" / "examples" / "devgraph-example-plugin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example installed with pip into a fresh target directory; returns the environment to use it."""
    work = tmp_path_factory.mktemp("example")
    source = work / "src"
    shutil.copytree(EXAMPLE, source)  # build from a copy: pip's build artifacts stay out of the checkout
    target = work / "site"
    # No build isolation where setuptools is present (machines without network); else pip fetches it.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            *isolation,
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (target / "devgraph_example_plugin" / "plugin.py").exists()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("DEVGRAPH_PLUGINS", None)
    return {"env": env, "cwd": work}


def _run(installed, *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env=installed["env"],
        cwd=installed["cwd"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_backend_appears_in_devgraph_info(installed):
    run = _run(installed, "-m", "devgraph", "info", "--json")
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout)
    plugin = next(p for p in info["plugins"] if p["name"] == "example")
    assert plugin["status"] == "loaded" and "devgraph-example-plugin 0.1.0" in plugin["origin"]
    assert plugin["provides"] == ["backend cpu:example_full"]
    backend = next(b for b in info["backends"] if (b["platform"], b["name"]) == ("cpu", "example_full"))
    assert backend["usable"] and backend["phases"] == ["decode"] and backend["class"] == "ExampleFullBackend"
    text = _run(installed, "-m", "devgraph", "info").stdout
    assert "cpu:example_full" in text and "devgraph-example-plugin 0.1.0" in text


def test_passes_the_kit_through_pytest(installed):
    probe = (
        "import importlib.metadata as m; print(any(e.group == 'pytest11' and e.value == "
        "'devgraph.testing.pytest_plugin' for d in m.distributions() for e in d.entry_points))"
    )
    registered = _run(installed, "-c", probe).stdout.strip() == "True"
    extra = [] if registered else ["-p", "devgraph.testing.pytest_plugin"]
    run = _run(
        installed,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *extra,
        "--devgraph-backend",
        "cpu:example_full",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # One test per check of the kit, every one passed (none skipped: the CPU simulator can run them all).
    assert f"{len(check_names())} passed" in run.stdout, run.stdout
    assert "skipped" not in run.stdout and "failed" not in run.stdout, run.stdout


def test_backend_serves_a_runner_and_reports_its_counters(installed):
    """The backend implements the ABC a runner drives: keys are GraphKeys, and what describe_key adds
    (replays per key) shows up in inspect()."""
    code = (
        "import json, torch\n"
        "from devgraph import GraphRunner, StaticInput\n"
        "runner = GraphRunner(lambda x: x * 2 + 1, phase='decode', mode='example_full', device='cpu',\n"
        "                     inputs={'x': StaticInput(torch.float32, (3,))}, sizes=[2, 4], progress=False)\n"
        "runner.capture()\n"
        "for n in (1, 2, 3, 3, 5):\n"
        "    x = torch.arange(n * 3.0).reshape(n, 3)\n"
        "    assert torch.equal(runner.run(x=x), x * 2 + 1)\n"
        "info = runner.inspect()\n"
        "runner.close()\n"
        "print(json.dumps({'backend': type(runner.backend).__name__,\n"
        "                  'replays': {k: v['replays'] for k, v in info['keys'].items()},\n"
        "                  'after_close': len(runner.backend.replays)}))\n"
    )
    run = _run(installed, "-c", code)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # n=1 and n=2 replay the size-2 graph, n=3 twice the size-4 graph; n=5 is past the largest: eager.
    assert result == {
        "backend": "ExampleFullBackend",
        "replays": {"tokens=2": 2, "tokens=4": 2},
        "after_close": 0,
    }


def test_passes_the_kit_from_code(installed):
    code = (
        "from devgraph.testing import run_conformance\nreport = run_conformance('cpu:example_full', "
        "checks=['static_addresses', 'cleanup'])\nprint(report)\nreport.raise_for_failures()\nassert "
        "report.backend == 'ExampleFullBackend'\n"
    )
    run = _run(installed, "-c", code)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout
