"""The layers of the package, checked against the one layer table (tools/layer_table.py, rendered into
docs/architecture.md): every module has a row, every import runs down the layers and down the orders inside
``runner/`` and ``serve/`` (string imports too), applications and plug-ins take public names from the face,
plug-ins import only what the table allows them. Each rule is shown to bite on a violation planted in a copy
of the tree; and ``import devgraph`` loads nothing of the layers an engine does not ask for."""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"devgraph_tools_{name}", ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


layers = _load("layers")
sys.path.insert(0, str(ROOT / "tools"))  # face_imports imports layers by name, as it does when run
face_imports = _load("face_imports")

# What the checker reads: the package, the plug-in distributions and the table.
_TREE = ("devgraph", "backends", "docs/examples", "tools")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the sources the checker reads, to plant violations in."""
    for part in _TREE:
        shutil.copytree(
            ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
        )
    return tmp_path


def _plant(root: Path, relative: str, code: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    before = path.read_text(encoding="utf-8") if path.exists() else ""
    path.write_text(before + code, encoding="utf-8")


def _found(root: Path) -> set[tuple[str, str]]:
    return {(v.module, v.rule) for v in layers.check(root) if v.rule != "face-pending"}


def _of(root: Path, module: str) -> list:
    """The violations of one module (those FACE_PENDING sets apart left out)."""
    return [v for v in layers.check(root) if v.module == module and v.rule != "face-pending"]


# -- the repository -------------------------------------------------------------------------------------
def test_the_tree_keeps_the_table():
    violations = [v for v in layers.check(ROOT) if v.rule != "face-pending"]
    assert not violations, "the layer table of tools/layer_table.py is broken:\n" + "\n".join(
        map(str, violations)
    )


def test_the_docs_show_the_table():
    text = (ROOT / layers.DOCS).read_text(encoding="utf-8")
    assert layers.with_blocks(text, layers.render(layers.load_table())) == text, (
        "docs/architecture.md differs from tools/layer_table.py: run python tools/layers.py docs --write"
    )


def test_pending_face_rewrites_are_still_pending():
    """FACE_PENDING lists the applications whose imports the codemod has not rewritten yet; an entry whose
    application has no such import left must go, so the rule applies to it again."""
    table = layers.load_table()
    pending = [v for v in layers.check(ROOT) if v.rule == "face-pending"]
    units = {layers.unit_of(v.module, table.APPLICATIONS) for v in pending}
    assert units == set(table.FACE_PENDING), (
        f"FACE_PENDING lists {sorted(table.FACE_PENDING)} but only {sorted(u for u in units if u)} still "
        "import public names from their modules: remove the others from FACE_PENDING"
    )


# -- the five violations of issue 28, planted ---------------------------------------------------------
def test_a_new_folder_importing_the_serving_engine_fails(tree):
    _plant(tree, "devgraph/cache_tools/__init__.py", "from devgraph.serve.engine import Engine\n")
    assert ("devgraph.cache_tools", "unplaced") in _found(tree)


def test_a_new_root_module_importing_the_cli_fails(tree):
    _plant(tree, "devgraph/shortcuts.py", "from devgraph.cli.main import main\n")
    assert ("devgraph.shortcuts", "unplaced") in _found(tree)
    # Given a row of its own low in the table, its import is still an arrow up.
    _plant(
        tree,
        "tools/layer_table.py",
        "LAYERS = (LAYERS[0], (Row(('devgraph.shortcuts',), 'x'),), *LAYERS[1:])\n",
    )
    assert ("devgraph.shortcuts", "upward") in _found(tree)


@pytest.mark.parametrize(
    ("planted", "code", "module", "rule", "says"),
    [
        pytest.param(
            "devgraph/contract/modes.py",
            "\n\ndef _late():\n    import importlib\n\n"
            "    return importlib.import_module('devgraph.serve.engine')\n",
            "devgraph.contract.modes",
            "upward",
            "a string import",
            id="import_module-of-serve-inside-contract",
        ),
        pytest.param(
            "devgraph/runner/capture/advice.py",
            "\n\ndef _runner_type():\n    from devgraph.runner.graph_runner import GraphRunner\n\n"
            "    return GraphRunner\n",
            "devgraph.runner.capture.advice",
            "order",
            "in devgraph.runner, capture.advice (level 0)",
            id="capture-advice-importing-graph_runner",
        ),
        pytest.param(
            # the serve/api/startup.py: the start-up lives in serve/startup.py now, above the engine
            "devgraph/serve/engine/limits.py",
            "\nfrom devgraph.serve import startup\n",
            "devgraph.serve.engine.limits",
            "order",
            "in devgraph.serve, engine.* (level 0)",
            id="engine-limits-importing-startup",
        ),
    ],
)
def test_an_import_against_the_layers_or_an_order_fails(tree, planted, code, module, rule, says):
    _plant(tree, planted, code)
    found = _of(tree, module)
    assert [v.rule for v in found] == [rule] and says in found[0].message, found


# -- the other rules, planted -------------------------------------------------------------------------
def test_the_library_importing_the_face_fails(tree):
    _plant(tree, "devgraph/flag/sizes.py", "\nfrom devgraph import GraphRunner\n")
    assert ("devgraph.flag.sizes", "upward") in _found(tree)


def test_an_f_string_import_is_judged_by_its_constant_prefix(tree):
    _plant(
        tree,
        "devgraph/strategies/eager.py",
        "\n\ndef _late(name):\n    from importlib import import_module\n\n"
        "    return import_module(f'devgraph.serve.{name}')\n",
    )
    assert ("devgraph.strategies.eager", "upward") in _found(tree)


def test_an_application_importing_a_public_name_from_its_module_fails(tree):
    _plant(tree, "devgraph/reference/model.py", "\nfrom devgraph.runner.graph_runner import GraphRunner\n")
    assert ("devgraph.reference.model", "face") in _found(tree)


def test_plugins_import_only_what_the_table_allows(tree):
    _plant(tree, "backends/cuda/devgraph_cuda/platform.py", "\nfrom devgraph.runner.plan import RunnerPlan\n")
    _plant(
        tree, "backends/rocm/devgraph_rocm/rules.py", "\nfrom devgraph_cuda.platform import CudaPlatform\n"
    )
    _plant(tree, "backends/npu/devgraph_npu/plugin.py", "\nfrom devgraph.errors import CaptureError\n")
    found = _found(tree)
    assert ("devgraph_cuda.platform", "plugin") in found  # the runner is not theirs to import
    assert ("devgraph_rocm.rules", "plugin") in found  # nor another plug-in
    assert ("devgraph_npu.plugin", "face") in found  # a public name comes from the face


def test_a_row_whose_module_moved_is_named(tree):
    (tree / "devgraph/runner/metrics.py").rename(tree / "devgraph/runner/prometheus.py")
    found = _found(tree)
    assert ("devgraph.runner.metrics", "stale") in found
    assert ("devgraph.runner.prometheus", "unplaced") in found


def test_the_proposal_for_an_order_follows_todays_imports():
    levels = layers.propose("devgraph.runner")
    names = [n for level in levels for n in level]
    assert sorted(names) == sorted(set(names))
    level_of = {name: i for i, level in enumerate(levels) for name in level}
    # Each unit sits above what it imports: the runner above its life, the life above its graph sets.
    assert level_of["background"] > level_of["graph_runner"] > level_of["life"] > level_of["capture.sets"]
    assert "capture.advice" in names and "__init__" in names


# -- the codemod --------------------------------------------------------------------------------------
def test_the_codemod_moves_public_names_to_the_face(tree):
    _plant(
        tree,
        "devgraph/reference/planted.py",
        "from devgraph.errors import ConfigError, DevGraphError\n"
        "from devgraph.flag.factory import create_backend, resolve_phase\n\n\n"
        "def f():\n    from devgraph.runner.graph_runner import GraphRunner as Runner\n\n"
        "    return Runner, ConfigError, DevGraphError, create_backend, resolve_phase\n",
    )
    _plant(tree, "devgraph/flag/planted.py", "from devgraph.errors import ConfigError\n")
    assert ("devgraph.reference.planted", "face") in _found(tree)
    changed = face_imports.rewrite([tree / "devgraph"], write=True, root=tree)
    assert tree / "devgraph/reference/planted.py" in changed
    assert tree / "devgraph/flag/planted.py" not in changed  # the library never imports its face
    tree_ast = ast.parse((tree / "devgraph/reference/planted.py").read_text(encoding="utf-8"))
    froms = {
        (n.module, a.name, a.asname)
        for n in ast.walk(tree_ast)
        if isinstance(n, ast.ImportFrom)
        for a in n.names
    }
    assert froms == {
        ("devgraph", "ConfigError", None),
        ("devgraph", "DevGraphError", None),
        ("devgraph", "create_backend", None),
        ("devgraph.flag.factory", "resolve_phase", None),
        ("devgraph", "GraphRunner", "Runner"),
    }
    assert not [
        v for v in layers.check(tree) if v.rule == "face" and v.module == "devgraph.reference.planted"
    ]


# -- what ``import devgraph`` loads -----------------------------------------------------------------------
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
