"""The set-up the README's two commands do: constraints/ci.txt pins every distribution they install, the
declared version ranges agree with what was tested, `make demo` installs only what the demo needs, and the
pins are chosen per environment by tools/pins.py."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from types import ModuleType

import pytest
from fakes_common import ROOT
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _load_pins_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("devgraph_tools_pins", ROOT / "tools" / "pins.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pins_tool = _load_pins_tool()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = sorted(PYPROJECT["optional-dependencies"])
PINS = pins_tool.read_pins()


def _pins_for(python: str) -> dict[str, Version]:
    """The pins that apply under ``python`` ("3.11"), by canonical name; a name pinned twice fails."""
    here = tuple(int(p) for p in python.split("."))
    found: dict[str, Version] = {}
    for name, version, marker in PINS:
        if pins_tool.applies(marker, here):
            key = pins_tool.canonical(name)
            assert key not in found, f"{name} is pinned twice for Python {python}"
            found[key] = Version(version)
    return found


def _declared() -> list[Requirement]:
    """Every requirement devgraph and its plug-ins declare: the core, each extra, the plug-ins' own."""
    declared = [Requirement(r) for r in PYPROJECT["dependencies"]]
    for extra in EXTRAS:
        declared += [Requirement(r) for r in PYPROJECT["optional-dependencies"][extra]]
    for plugin in pins_tool.PLUGINS:
        project = tomllib.loads((ROOT / plugin / "pyproject.toml").read_text())["project"]
        declared += [Requirement(r) for r in project["dependencies"] if not r.startswith("devgraph")]
    return declared


def _torch_is_the_pinned_release() -> bool:
    installed = importlib.metadata.version("torch").split("+", 1)[0]
    return installed == str(_pins_for(f"{sys.version_info.major}.{sys.version_info.minor}")["torch"])


# -- the constraints file --------------------------------------------------------------------------------
@pytest.mark.parametrize("python", pins_tool.PYTHONS)
def test_every_declared_requirement_is_pinned_within_its_range(python):
    """A new dependency in pyproject.toml without a pin fails here, for each Python CI runs."""
    pins = _pins_for(python)
    environment = {**default_environment(), "python_version": python, "python_full_version": f"{python}.0"}
    missing, outside = [], []
    for requirement in _declared():
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        pinned = pins.get(pins_tool.canonical(requirement.name))
        if pinned is None:
            missing.append(requirement.name)
        elif not requirement.specifier.contains(pinned, prereleases=True):
            outside.append(f"{requirement} (pinned {pinned})")
    assert not missing, (
        f"constraints/ci.txt pins no release of {missing} for Python {python}: `make constraints`"
    )
    assert not outside, f"pins outside the declared range for Python {python}: {outside}"


def test_every_installed_dependency_is_pinned():
    """The whole closure of `devgraph[test]` and the plug-ins as installed here, transitive dependencies
    included, is pinned (what a torch build of another release requires is its own, as in the Makefile)."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    pins = _pins_for(here)
    foreign_torch = not _torch_is_the_pinned_release()
    environment = default_environment()
    queue = [(r, set(EXTRAS)) for r in _declared()]
    seen: set[str] = set()
    unpinned, not_installed = [], []
    while queue:
        requirement, extras = queue.pop()
        if requirement.marker is not None and not any(
            requirement.marker.evaluate({**environment, "extra": e}) for e in (extras or {""})
        ):
            continue
        key = pins_tool.canonical(requirement.name)
        if key in seen:
            continue
        seen.add(key)
        if key not in pins:
            unpinned.append(requirement.name)
        if foreign_torch and key == "torch":
            continue
        try:
            requires = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:  # its own dependencies cannot be walked here
            not_installed.append(requirement.name)
            continue
        queue += [(Requirement(r), set(requirement.extras)) for r in requires]
    assert not unpinned, f"installed but not pinned in constraints/ci.txt: {sorted(unpinned)}"
    if os.environ.get("CI"):  # elsewhere an older environment may lack a new dependency; CI's never does
        assert not not_installed, f"declared but not installed by `make test`: {sorted(not_installed)}"


def test_ci_installed_exactly_the_pinned_releases():
    if not os.environ.get("CI"):
        pytest.skip("only CI's environment (.ci/run: a fresh virtual environment) is installed from the pins")
    pins = _pins_for(f"{sys.version_info.major}.{sys.version_info.minor}")
    # Only what pip installed into the environment: once something imports setuptools, its vendored copies
    # (setuptools/_vendor/more_itertools-*.dist-info...) are on sys.path too, at setuptools' own releases.
    site_dirs = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {
        pins_tool.canonical(d.metadata["Name"]): d.version.split("+", 1)[0]
        for d in importlib.metadata.distributions(path=site_dirs)
    }
    differ = {n: (installed[n], str(v)) for n, v in pins.items() if n in installed and installed[n] != str(v)}
    assert not differ, f"installed vs pinned: {differ}"


def test_transformers_range_ends_at_the_newest_pinned_minor():
    """pyproject's upper bound admits the newest transformers tested and no later minor release; both
    extras that name transformers declare the same range; the Makefile's oldest is the lower bound."""
    ranges = {
        extra: SpecifierSet(str(Requirement(r).specifier))
        for extra in EXTRAS
        for r in PYPROJECT["optional-dependencies"][extra]
        if pins_tool.canonical(Requirement(r).name) == "transformers"
    }
    assert set(ranges) == {"test", "transformers"}, ranges
    assert len(set(map(str, ranges.values()))) == 1, f"the extras disagree: {ranges}"
    specifier = ranges["transformers"]
    newest = max(Version(v) for n, v, _ in PINS if pins_tool.canonical(n) == "transformers")
    upper = [s for s in specifier if s.operator == "<"]
    assert [s.version for s in upper] == [f"{newest.major}.{newest.minor + 1}"], (
        f"pinned transformers {newest}, declared {specifier}: the upper bound is the next minor after the "
        "newest tested release"
    )
    lower = next(s for s in specifier if s.operator == ">=")
    makefile = (ROOT / "Makefile").read_text()
    oldest = re.search(r"^HF_OLDEST := (\S+)$", makefile, re.MULTILINE)
    assert oldest is not None and Version(oldest.group(1)) == Version(lower.version), (
        f"make test-hf-range's oldest transformers must be the declared lower bound {lower}"
    )


def test_torch_is_pinned_to_the_release_ci_installs_from_disk():
    torch_pins = {v for n, v, _ in PINS if pins_tool.canonical(n) == "torch"}
    assert len(torch_pins) == 1, f"one torch release for every Python: {torch_pins}"
    assert all("+" not in v for v in torch_pins), "a local label (+cpu) would refuse the CUDA build"


# -- tools/pins.py ---------------------------------------------------------------------------------------
def test_read_pins_refuses_a_range(tmp_path):
    bad = tmp_path / "ci.txt"
    bad.write_text("# header\nruff==0.17.6\ntorch>=2.4\n")
    with pytest.raises(SystemExit, match=r"not a `name==version` pin: 'torch>=2.4'"):
        pins_tool.read_pins(bad)


def test_markers_are_read_or_refused():
    assert pins_tool.applies(None)
    assert pins_tool.applies('python_version < "3.11"', (3, 10))
    assert not pins_tool.applies('python_version < "3.11"', (3, 11))
    assert pins_tool.applies('python_version >= "3.11" and python_version < "3.12"', (3, 11))
    assert not pins_tool.applies('python_version >= "3.11" and python_version < "3.12"', (3, 12))
    with pytest.raises(SystemExit, match="cannot read the marker"):
        pins_tool.applies('sys_platform == "linux"', (3, 11))


def test_merge_splits_only_where_pythons_differ():
    merged = pins_tool.merge(
        {
            "3.11": {"numpy": "2.4.6", "torch": "2.13.0", "Jinja2": "3.1.6"},
            "3.10": {"numpy": "2.2.6", "torch": "2.13.0", "jinja2": "3.1.6", "tomli": "2.5.0"},
            "3.12": {"numpy": "2.5.5", "torch": "2.13.0", "Jinja2": "3.1.6"},
        }
    )
    assert merged == [
        "Jinja2==3.1.6",
        'numpy==2.2.6 ; python_version < "3.11"',
        'numpy==2.4.6 ; python_version >= "3.11" and python_version < "3.12"',
        'numpy==2.5.5 ; python_version >= "3.12"',
        'tomli==2.5.0 ; python_version < "3.11"',
        "torch==2.13.0",
    ]
    for here in ((3, 10), (3, 11), (3, 12), (3, 13)):  # exactly one numpy each, 3.13 included
        numpy = [line for line in merged if line.startswith("numpy") and pins_tool.applies(line[14:], here)]
        assert len(numpy) == 1, (here, numpy)


def test_a_python_between_two_that_agree_gets_its_own_line():
    merged = pins_tool.merge({"3.10": {"x": "1"}, "3.11": {"x": "2"}, "3.12": {"x": "1"}})
    assert merged == [
        'x==1 ; python_version < "3.11"',
        'x==1 ; python_version >= "3.12"',
        'x==2 ; python_version >= "3.11" and python_version < "3.12"',
    ]


def test_select_keeps_a_torch_of_another_release(tmp_path, monkeypatch):
    """A GPU machine's torch 2.11 (CUDA) is kept: its pins and its own requirements' pins are left out."""
    real_version, real_requires = importlib.metadata.version, importlib.metadata.requires

    def version(name):
        return "2.11.0+cu130" if name == "torch" else real_version(name)

    def requires(name):
        if name == "torch":
            return ["filelock", "triton==3.6.0; platform_system == 'Linux'", "sympy>=1.13.3"]
        return real_requires(name)

    monkeypatch.setattr(pins_tool.importlib.metadata, "version", version)
    monkeypatch.setattr(pins_tool.importlib.metadata, "requires", requires)
    monkeypatch.setattr(pins_tool, "LOCAL_COPY_DIR", tmp_path)
    chosen = pins_tool.select()
    assert chosen == tmp_path / "constraints-torch-2.11.0.txt"
    kept = {pins_tool.canonical(n) for n, _, _ in pins_tool.read_pins(chosen)}
    assert not kept & {"torch", "triton", "filelock", "sympy"}
    assert {"ruff", "transformers", "pytest"} <= kept


def test_select_uses_the_file_itself_for_the_pinned_torch(monkeypatch):
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    pinned = str(_pins_for(here)["torch"])
    monkeypatch.setattr(pins_tool.importlib.metadata, "version", lambda name: f"{pinned}+cpu")
    assert pins_tool.select() == pins_tool.CONSTRAINTS


# -- the Makefile ----------------------------------------------------------------------------------------
def _make_dry_run(target: str) -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    run = subprocess.run(
        ["make", "-n", "--no-print-directory", target, f"PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return [line for line in run.stdout.splitlines() if " pip install" in line]


def test_make_demo_installs_only_the_core_and_the_plugins_with_the_pins():
    installs = _make_dry_run("demo")
    assert installs, "make demo installs nothing?"
    for line in installs:
        assert re.search(r" -c \S+\.txt ", line), f"installs without the pins: {line}"
        assert "[" not in line, f"make demo installs an extra: {line}"
    assert any("-e . " in line and "-e backends/cuda" in line for line in installs)


def test_make_test_installs_the_test_extra_with_the_pins():
    installs = _make_dry_run("test")
    assert any("'.[test]'" in line for line in installs), installs
    for line in installs:
        assert re.search(r" -c \S+\.txt ", line), f"installs without the pins: {line}"


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.startswith("#")]
    assert commands[-1] == "make test"
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == [
        "make demo",
        "make test",
    ]


def test_demo_runs_without_triton_transformers_or_aiohttp():
    """`make demo` does not install them: the demo's CPU path must not import them."""
    script = (
        "import sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'triton', 'transformers', 'aiohttp'}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (absent in this test)')\n"
        "sys.meta_path.insert(0, Absent())\n"
        "from devgraph.cli import main\n"
        "args = ['--device', 'cpu', '--decode-sizes', '1,2', '--prefill-sizes', '16', '--iters', '1']\n"
        "code = main(['demo', *args])\n"
        "assert not {'triton', 'transformers', 'aiohttp'} & set(sys.modules), sorted(sys.modules)\n"
        "raise SystemExit(code)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "same padded batch: 0" in run.stdout
