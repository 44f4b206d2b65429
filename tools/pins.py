"""The pinned versions `make demo`, `make test` and CI install (constraints/ci.txt).

    python tools/pins.py select      # the constraints file for this environment's pip (used by the Makefile)
    python tools/pins.py version transformers    # the pinned release for this Python
    python tools/pins.py generate    # rewrite constraints/ci.txt from fresh environments (`make constraints`)

``select`` prints constraints/ci.txt itself, unless the torch installed here is another version than the
pinned one (a GPU machine's CUDA build): then it writes and prints a copy without the pins of torch and of
what that torch requires, so pip keeps the build the machine came with instead of replacing it.

``generate`` installs the newest releases pyproject.toml allows (and the pinned torch) into a fresh virtual
environment of this Python, freezes it, resolves the same requirements for the other supported Pythons it
finds (on PATH or installed by pyenv; ``--dry-run``, nothing downloaded but metadata), and writes one pin per
distribution, with a ``python_version`` marker where the Pythons need different releases (numpy dropped
3.10, for instance).

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints" / "ci.txt"
#: Where ``select`` writes the trimmed copy (ignored by git).
LOCAL_COPY_DIR = ROOT / "build"
PLUGINS = ["backends/cuda", "backends/rocm", "backends/npu"]
#: Every extra of pyproject.toml: CI's set-up installs ``test``, which names them all, and the pins must
#: cover each one a user may install.
EXTRAS = "test,serve,structured,metrics,transformers,triton"
DEFAULT_TORCH = "2.13.0"
#: The Pythons the CI workflows run (.github/workflows/ci.yml); the generating one is installed, the others
#: resolved where found.
PYTHONS = ["3.10", "3.11", "3.12"]
#: Tools pip brings with every environment; pinning pip itself would upgrade it mid-install.
NOT_PINNED = {"pip"}

HEADER = """\
# Every distribution `make test` installs (torch, the libraries, the tools, all their dependencies),
# pinned. The Makefile installs with `-c` this file, so a new release on the index never changes what
# `make demo`, `make test` or CI (.ci/run) runs. pyproject.toml says what devgraph supports; this file
# says what was tested. Regenerate with `make constraints` (tools/pins.py generate: a fresh virtual
# environment, the newest releases pyproject.toml allows, torch=={torch} (CPU build), frozen; the other
# Pythons resolved alike), then run `make test`. `make test-latest` runs the suite on the newest releases
# without these pins; `make test-hf-range` runs tests/test_hf.py on the oldest and newest transformers.
# Generated {date} with Python {pythons}, pip {pip}, torch {torch}.
"""

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.+))?$")


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name (``Jinja2`` and ``jinja2``, ``typing_extensions`` and ``-``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path = CONSTRAINTS) -> list[tuple[str, str, str | None]]:
    """(name as written, version, marker or None) for every pin line of ``path``."""
    pins = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN.match(line)
        if match is None:
            raise SystemExit(f"{path}: not a `name==version` pin: {raw!r}")
        pins.append((match.group(1), match.group(2), match.group(3)))
    return pins


def _base_version(version: str) -> str:
    return version.split("+", 1)[0]


def _requirement_name(requirement: str) -> str:
    return canonical(re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0])


# -- select ------------------------------------------------------------------------------------------------
def select() -> Path:
    """The constraints file this environment's pip should install with (see the module docstring)."""
    try:
        installed = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return CONSTRAINTS
    pinned = {canonical(name): version for name, version, _ in read_pins()}
    if _base_version(installed) == pinned.get("torch"):
        return CONSTRAINTS
    own = {"torch"} | {_requirement_name(r) for r in importlib.metadata.requires("torch") or []}
    LOCAL_COPY_DIR.mkdir(exist_ok=True)
    copy = LOCAL_COPY_DIR / f"constraints-torch-{_base_version(installed)}.txt"
    kept = [line for line in CONSTRAINTS.read_text().splitlines() if _line_name(line) not in own]
    copy.write_text(
        f"# {CONSTRAINTS.relative_to(ROOT)} without the pins of torch and of what the torch {installed} "
        "installed here requires (written by tools/pins.py select)\n" + "\n".join(kept) + "\n"
    )
    print(
        f"tools/pins.py: keeping the torch {installed} installed here (pinned: {pinned.get('torch')}); "
        f"its own requirements are not pinned ({_shown(copy)})",
        file=sys.stderr,
    )
    return copy


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it (what the Makefile passes to pip)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _line_name(line: str) -> str | None:
    match = _PIN.match(line.split("#", 1)[0].strip())
    return canonical(match.group(1)) if match else None


def applies(marker: str | None, python: tuple[int, int] | None = None) -> bool:
    """Whether a pin's marker holds for ``python`` (this interpreter by default). ``generate`` writes only
    ``python_version`` comparisons joined by ``and``; anything else is refused rather than guessed."""
    if not marker:
        return True
    here = python or (sys.version_info.major, sys.version_info.minor)
    compare = {
        "<": lambda a, b: a < b,
        "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b,
        ">=": lambda a, b: a >= b,
        "==": lambda a, b: a == b,
    }
    for clause in marker.split(" and "):
        match = re.fullmatch(r'\s*python_version\s*(<=|>=|==|<|>)\s*"(\d+)\.(\d+)"\s*', clause)
        if match is None:
            raise SystemExit(f"{CONSTRAINTS}: cannot read the marker {marker!r} (only python_version ones)")
        if not compare[match.group(1)](here, (int(match.group(2)), int(match.group(3)))):
            return False
    return True


def pinned_version(name: str) -> str:
    """The release of ``name`` constraints/ci.txt pins for this Python."""
    for written, version, marker in read_pins():
        if canonical(written) == canonical(name) and applies(marker):
            return version
    raise SystemExit(f"{CONSTRAINTS} pins no {name} for this Python")


# -- generate ----------------------------------------------------------------------------------------------
def _run(*command: str, **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(command), file=sys.stderr, flush=True)
    return subprocess.run(command, check=True, cwd=ROOT, **kwargs)


def _venv(python: str, where: Path) -> str:
    _run(python, "-m", "venv", str(where))
    return str(where / "bin" / "python")


def _installed(python: str, torch: str) -> dict[str, str]:
    """Install torch==``torch``, then devgraph with every extra and the plug-ins; return the freeze."""
    _run(python, "-m", "pip", "install", "-q", f"torch=={torch}")
    editables = [arg for plugin in PLUGINS for arg in ("-e", plugin)]
    _run(python, "-m", "pip", "install", "-q", "--no-build-isolation", "-e", f".[{EXTRAS}]", *editables)
    frozen = _run(
        python, "-m", "pip", "freeze", "--all", "--exclude-editable", capture_output=True, text=True
    ).stdout
    pins = {}
    for line in frozen.splitlines():
        match = _PIN.match(line.strip())
        if match and canonical(match.group(1)) not in NOT_PINNED:
            # The local label (+cpu) names the build, not the release: torch==2.13.0 admits 2.13.0+cpu.
            pins[match.group(1)] = _base_version(match.group(2))
    return pins


def _top_level_requirements(installed_python: str) -> list[str]:
    """What ``-e .[EXTRAS]`` asks for, with torch replaced by what the installed torch build requires."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip vendors a TOML reader
        from pip._vendor import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in EXTRAS.split(","):
        wanted += project["optional-dependencies"][extra]
    torch_requires = _run(
        installed_python,
        "-c",
        "import importlib.metadata as m, json; print(json.dumps(m.requires('torch') or []))",
        capture_output=True,
        text=True,
    ).stdout
    wanted += [r for r in json.loads(torch_requires) if "extra ==" not in r]  # torch's extras: not installed
    unique = dict.fromkeys(r for r in wanted if _requirement_name(r) != "torch")
    return list(unique)


def _resolved(python: str, requirements: list[str], scratch: Path) -> dict[str, str]:
    """The newest releases pip would install for ``requirements`` under ``python`` (metadata only)."""
    report = scratch / "report.json"
    _run(
        python, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report),
        *requirements,
    )  # fmt: skip
    items = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in items}


def _marker(pythons: list[str], group: list[str]) -> list[str | None]:
    """``python_version`` markers for the Pythons in ``group``: one per run of consecutive Pythons, open
    below the oldest and above the newest supported one (so 3.13 takes 3.12's pins)."""
    if group == pythons:
        return [None]
    runs: list[list[str]] = []
    for version in group:
        if runs and pythons.index(version) == pythons.index(runs[-1][-1]) + 1:
            runs[-1].append(version)
        else:
            runs.append([version])
    markers: list[str | None] = []
    for run in runs:
        parts = []
        if run[0] != pythons[0]:
            parts.append(f'python_version >= "{run[0]}"')
        if run[-1] != pythons[-1]:
            after = pythons[pythons.index(run[-1]) + 1]
            parts.append(f'python_version < "{after}"')
        markers.append(" and ".join(parts))
    return markers


def merge(per_python: dict[str, dict[str, str]]) -> list[str]:
    """One line per distribution and release, sorted by name, with markers where Pythons differ."""
    pythons = sorted(per_python, key=lambda v: tuple(int(p) for p in v.split(".")))
    names: dict[str, str] = {}
    for pins in per_python.values():
        for name in pins:
            names.setdefault(canonical(name), name)
    lines = []
    for key in sorted(names):
        by_version: dict[str, list[str]] = {}
        for python in pythons:
            found = {canonical(n): v for n, v in per_python[python].items()}.get(key)
            if found is not None:
                by_version.setdefault(found, []).append(python)
        for version, group in by_version.items():
            for marker in _marker(pythons, group):
                lines.append(f"{names[key]}=={version}" + (f" ; {marker}" if marker else ""))
    return lines


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` that runs: on PATH, else one pyenv installed (its shims refuse to run
    versions that are not selected)."""
    candidates = [shutil.which(f"python{version}")]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += [str(p) for p in sorted(pyenv_root.glob(f"versions/{version}.*/bin/python{version}"))]
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    return None


def generate(torch: str, output: Path) -> None:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    with tempfile.TemporaryDirectory(prefix="devgraph-pins-") as scratch_dir:
        scratch = Path(scratch_dir)
        python = _venv(sys.executable, scratch / here)
        per_python = {here: _installed(python, torch)}
        requirements = _top_level_requirements(python)
        for other in (v for v in PYTHONS if v != here):
            found = find_python(other)
            if found is None:
                print(f"tools/pins.py: no python{other} on PATH; its pins are not checked", file=sys.stderr)
                continue
            resolved = _resolved(_venv(found, scratch / other), requirements, scratch)
            per_python[other] = {**resolved, "torch": torch}  # the same torch release everywhere
        pip_version = _run(python, "-m", "pip", "--version", capture_output=True, text=True).stdout.split()[1]
    header = HEADER.format(
        torch=torch,
        date=datetime.date.today().isoformat(),
        pythons="/".join(sorted(per_python)),
        pip=pip_version,
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(header + "\n".join(merge(per_python)) + "\n")
    print(f"wrote {output}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("select", help="print the constraints file for this environment")
    version = sub.add_parser("version", help="print the pinned release of a distribution for this Python")
    version.add_argument("name")
    gen = sub.add_parser("generate", help="rewrite constraints/ci.txt from fresh environments")
    gen.add_argument("--torch", default=os.environ.get("TORCH_VERSION", DEFAULT_TORCH), help="torch release")
    gen.add_argument("--output", type=Path, default=CONSTRAINTS)
    args = parser.parse_args(argv)
    if args.command == "select":
        print(_shown(select()))
    elif args.command == "version":
        print(pinned_version(args.name))
    else:
        generate(args.torch, args.output.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
