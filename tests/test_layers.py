"""The layers of the package (docs/architecture.md): each folder imports only its own modules and the layers
below it, and ``import devgraph`` loads nothing of the layers an engine does not ask for."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "devgraph"

#: Bottom to top; a unit of a layer may import its own modules and any unit of a lower layer, nothing else.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("devgraph.errors", "devgraph._version", "devgraph.messages"),
    ("devgraph.extras", "devgraph.console"),
    ("devgraph.contract",),
    ("devgraph.strategies", "devgraph.platforms", "devgraph.ranks"),
    ("devgraph.registry",),
    ("devgraph.flag",),
    ("devgraph.runner",),
    ("devgraph.reference", "devgraph.integrations"),
    ("devgraph.testing",),
    ("devgraph.serve",),
    ("devgraph.cli",),
    ("devgraph", "devgraph.__main__"),  # the face: every public name, and python -m devgraph
)


def _unit(module: str) -> str:
    """The unit of the layer table a module belongs to: the longest entry that is it or contains it."""
    units = [u for layer in LAYERS for u in layer if module == u or module.startswith(f"{u}.")]
    return max(units, key=len)


def _layer(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Every devgraph module ``module`` imports, wherever the import stands (functions and
    ``TYPE_CHECKING`` blocks included); ``from p import x`` counts as ``p.x`` when that is a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "devgraph")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            if base.split(".")[0] != "devgraph":
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found


def test_every_module_has_a_layer():
    unplaced = [
        m for m in _modules() if not any(m == u or m.startswith(f"{u}.") for lay in LAYERS for u in lay)
    ]
    assert not unplaced, f"modules outside the layer table of docs/architecture.md: {unplaced}"


def test_each_layer_imports_only_itself_and_the_layers_below():
    modules = _modules()
    known = set(modules)
    wrong = []
    for module, path in modules.items():
        unit = _unit(module)
        for target in sorted(_imports(module, path, known)):
            other = _unit(target)
            if other != unit and _layer(other) >= _layer(unit):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that do not run down the layers:\n" + "\n".join(wrong)


@pytest.mark.parametrize("statement", ["import devgraph", "import devgraph.runner.graph_runner"])
def test_the_library_loads_nothing_of_the_application_or_the_optional_packages(statement):
    probe = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True
    )
    loaded = json.loads(result.stdout.splitlines()[-1])
    above = (
        "devgraph.serve",
        "devgraph.cli",
        "devgraph.testing",
        "devgraph.reference",
        "devgraph.integrations",
    )
    optional = ("aiohttp", "prometheus_client", "transformers", "triton", "matplotlib")
    unwanted = [m for m in loaded if m.startswith(above) or m.split(".")[0] in optional]
    assert "devgraph.runner.graph_runner" in loaded
    assert not unwanted, f"{statement} imported {unwanted}"
