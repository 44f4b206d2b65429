"""Checks devgraph's imports against its layer table (tools/layer_table.py), and renders the table into
docs/architecture.md.

    python tools/layers.py                         # every violation, one a line; exit status 1 if any
    python tools/layers.py docs --write            # rewrite the generated tables of docs/architecture.md
    python tools/layers.py docs --check            # exit status 1 if they differ from the table
    python tools/layers.py propose devgraph.runner  # the levels today's imports allow (a start for ORDERS)

What is checked, for every module of ``devgraph/`` and of the plug-in distributions (``PLUGIN_ROOTS``):

* every module has a row, and every row covers a module (``unplaced``, ``stale``);
* every import runs down the layers (``upward``) and, inside an ordered folder, down its order (``order``);
  imports inside functions and ``TYPE_CHECKING`` blocks count, and so do ``importlib.import_module`` and
  ``__import__`` of a constant string (or an f-string's constant ``devgraph.`` prefix);
* applications and plug-ins import a public name from the face, not from the module that defines it
  (``face``; ``face-pending`` for the applications listed in ``FACE_PENDING``);
* a plug-in imports its own distribution, the face and what ``PLUGIN_MAY_IMPORT`` lists, nothing else of
  devgraph and no other plug-in (``plugin``).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
DOCS = Path("docs") / "architecture.md"
PACKAGE = "devgraph"
_IMPORT_CALLS = frozenset({"import_module", "__import__"})


def load_table(root: Path = ROOT) -> ModuleType:
    """``tools/layer_table.py`` of the tree at ``root``, loaded by path (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("devgraph_layer_table", root / "tools" / "layer_table.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"no layer table under {root}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the table is built
    spec.loader.exec_module(module)
    return module


# -- names ---------------------------------------------------------------------------------------------
def covers(pattern: str, module: str) -> bool:
    """Whether the unit ``pattern`` (``a.b.*``: the folder and everything in it; ``a.b``: that module)
    covers ``module``."""
    if pattern.endswith(".*"):
        base = pattern[:-2]
        return module == base or module.startswith(f"{base}.")
    return module == pattern


def unit_of(module: str, patterns: Iterable[str]) -> str | None:
    """The longest pattern that covers ``module`` (``None``: no row has it)."""
    found = [p for p in patterns if covers(p, module)]
    return max(found, key=lambda p: (len(p.removesuffix(".*")), not p.endswith(".*"))) if found else None


def relative(folder: str, module: str) -> str | None:
    """``module`` named inside ``folder`` (``__init__`` for the folder itself), ``None`` if outside."""
    if module == folder:
        return "__init__"
    return module[len(folder) + 1 :] if module.startswith(f"{folder}.") else None


# -- the tree --------------------------------------------------------------------------------------------
def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path) -> dict[str, Path]:
    """Every module of ``devgraph/`` by dotted name."""
    return {
        _module_name(p, root): p
        for p in sorted((root / PACKAGE).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def plugin_modules(root: Path, plugin_roots: Sequence[str]) -> dict[str, tuple[str, Path]]:
    """Every module of the plug-in distributions: name -> (its distribution's top package, path)."""
    found: dict[str, tuple[str, Path]] = {}
    for pattern in plugin_roots:
        for dist in sorted(root.glob(pattern)):
            for init in sorted(dist.glob("*/__init__.py")):
                top = init.parent.name
                for path in sorted(init.parent.rglob("*.py")):
                    if "__pycache__" not in path.parts:
                        found[_module_name(path, dist)] = (top, path)
    return found


@dataclass(frozen=True)
class Import:
    """One import of a module: the module it reaches, the names taken from it, where, and how."""

    target: str
    names: tuple[str, ...]
    line: int
    how: str  # "import", "from" or "string"


def _string_target(call: ast.Call) -> str | None:
    """The module an ``import_module("...")`` / ``__import__("...")`` call names, if it is written out."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in _IMPORT_CALLS or not call.args:
        return None
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    if isinstance(first, ast.JoinedStr) and first.values:  # f"devgraph.serve.{x}": its constant prefix
        head = first.values[0]
        if isinstance(head, ast.Constant) and isinstance(head.value, str) and "." in head.value:
            return head.value.rpartition(".")[0]
    return None


def read_imports(module: str, path: Path, known: set[str], is_package: bool) -> list[Import]:
    """Every import ``module`` makes, wherever it stands; ``from p import x`` reaches ``p.x`` when that is
    a module (``known``), else ``p`` with the name ``x``."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, (), node.lineno, "import") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            names = []
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.append(Import(f"{base}.{alias.name}", (), node.lineno, "from"))
                else:
                    names.append(alias.name)
            if names:
                found.append(Import(base, tuple(names), node.lineno, "from"))
        elif isinstance(node, ast.Call):
            target = _string_target(node)
            if target is not None:
                found.append(Import(target, (), node.lineno, "string"))
    return found


def face_names(root: Path) -> dict[str, str]:
    """Public name -> the module the face imports it from (``devgraph/__init__.py``'s own imports)."""
    tree = ast.parse((root / PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    public: set[str] = set()
    imported: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                imported[alias.asname or alias.name] = node.module
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            public.update(ast.literal_eval(node.value))
    return {name: module for name, module in imported.items() if name in public}


def defined_by_face(name: str, target: str, face: Mapping[str, str]) -> bool:
    """Whether ``from target import name`` takes a name the face exports from ``target`` (or from a module
    inside the package ``target``, which then re-exports it)."""
    origin = face.get(name)
    return origin is not None and (origin == target or origin.startswith(f"{target}."))


# -- the check -----------------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Violation:
    """One place that breaks the table: where, which rule, and what to do."""

    module: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: [{self.rule}] {self.message}"


class Checker:
    """The table applied to one tree (the repository, or a copy of it with a violation planted)."""

    def __init__(self, root: Path = ROOT, table: ModuleType | None = None) -> None:
        self.root = root
        self.table = table or load_table(root)
        self.modules = package_modules(root)
        self.plugins = plugin_modules(root, self.table.PLUGIN_ROOTS)
        self.known = set(self.modules) | set(self.plugins)
        self.face = face_names(root)
        self.levels = {
            unit: level for level, rows in enumerate(self.table.LAYERS) for row in rows for unit in row.units
        }
        self.top = len(self.table.LAYERS) - 1
        self.plugin_tops = {top for top, _ in self.plugins.values()}

    # -- where a module sits ------------------------------------------------------------------------
    def unit(self, module: str) -> str | None:
        return unit_of(module, self.levels)

    def is_application(self, unit: str) -> bool:
        return unit in self.table.APPLICATIONS

    def _order_units(self, folder: str, module: str) -> tuple[str | None, int | None]:
        name = relative(folder, module)
        if name is None:
            return None, None
        levels = self.table.ORDERS[folder]
        patterns = {p: i for i, level in enumerate(levels) for p in level}
        unit = unit_of(name, patterns)
        return unit, patterns.get(unit) if unit is not None else None

    # -- rules -------------------------------------------------------------------------------------
    def check(self) -> list[Violation]:
        found = [*self._placement(), *self._package_imports(), *self._plugin_imports()]
        return sorted(set(found))

    def _placement(self) -> Iterator[Violation]:
        for module in self.modules:
            if self.unit(module) is None:
                yield Violation(
                    module,
                    0,
                    "unplaced",
                    "no row of the layer table has it: add it to LAYERS in tools/layer_table.py",
                )
        for unit in self.levels:
            if not any(covers(unit, m) for m in self.modules):
                yield Violation(
                    unit, 0, "stale", "a row of LAYERS names it, but no module is there: remove it"
                )
        for folder, levels in self.table.ORDERS.items():
            inside = [m for m in self.modules if relative(folder, m) is not None]
            for module in inside:
                if self._order_units(folder, module)[0] is None:
                    yield Violation(
                        module, 0, "unplaced", f"no level of ORDERS[{folder!r}] has it: add it to one"
                    )
            names = [relative(folder, m) or "" for m in inside]
            for pattern in (p for level in levels for p in level):
                if not any(covers(pattern, n) for n in names):
                    yield Violation(
                        f"{folder}.{pattern}",
                        0,
                        "stale",
                        f"ORDERS[{folder!r}] names it, but no module is there",
                    )

    def _resolved(self, imp: Import, importer_unit: str) -> Iterator[tuple[str, str]]:
        """(the module an import reaches, how it is named) — a face import by an application resolves each
        public name to the module that defines it."""
        if imp.target == self.table.FACE and imp.names and self.is_application(importer_unit):
            for name in imp.names:
                yield self.face.get(name, imp.target), name
        else:
            yield imp.target, imp.target

    def _package_imports(self) -> Iterator[Violation]:
        for module, path in self.modules.items():
            unit = self.unit(module)
            if unit is None:
                continue
            for imp in read_imports(module, path, self.known, path.name == "__init__.py"):
                if imp.target.split(".")[0] != PACKAGE:
                    continue
                yield from self._face_rule(module, unit, imp)
                for target, shown in self._resolved(imp, unit):
                    other = unit_of(target, self.levels)
                    if other is None or other == unit:
                        yield from self._order_rule(module, target, imp)
                        continue
                    if self.levels[other] >= self.levels[unit]:
                        how = " (a string import)" if imp.how == "string" else ""
                        yield Violation(
                            module,
                            imp.line,
                            "upward",
                            f"imports {shown}{how}: {unit} (layer {self.levels[unit]}) may import only lower "
                            f"layers, and {other} is layer {self.levels[other]}",
                        )

    def _order_rule(self, module: str, target: str, imp: Import) -> Iterator[Violation]:
        for folder in sorted(self.table.ORDERS, key=len):
            here, level = self._order_units(folder, module)
            there, target_level = self._order_units(folder, target)
            if here is None or there is None or level is None or target_level is None:
                continue
            if here == there:
                continue  # one unit: a deeper ordered folder may still order them
            if target_level >= level:
                yield Violation(
                    module,
                    imp.line,
                    "order",
                    f"imports {target}: in {folder}, {here} (level {level}) may import only lower levels, "
                    f"and {there} is level {target_level} (tools/layer_table.py ORDERS)",
                )
            return

    def _face_rule(self, module: str, unit: str, imp: Import) -> Iterator[Violation]:
        if not self.is_application(unit) or imp.how != "from" or imp.target == self.table.FACE:
            return
        public = [n for n in imp.names if defined_by_face(n, imp.target, self.face)]
        if public:
            pending = unit in self.table.FACE_PENDING
            yield Violation(
                module,
                imp.line,
                "face-pending" if pending else "face",
                f"imports {', '.join(public)} from {imp.target}: import public names from the face "
                f"(from devgraph import {', '.join(public)}; tools/face_imports.py rewrites it)",
            )

    def _plugin_imports(self) -> Iterator[Violation]:
        allowed = self.table.PLUGIN_MAY_IMPORT
        for module, (top, path) in self.plugins.items():
            for imp in read_imports(module, path, self.known, path.name == "__init__.py"):
                head = imp.target.split(".")[0]
                if head in self.plugin_tops and head != top:
                    yield Violation(
                        module,
                        imp.line,
                        "plugin",
                        f"imports {imp.target}: a plug-in imports no other plug-in",
                    )
                if head != PACKAGE:
                    continue
                if imp.how == "from" and imp.target != self.table.FACE:
                    public = [n for n in imp.names if defined_by_face(n, imp.target, self.face)]
                    if public:
                        yield Violation(
                            module,
                            imp.line,
                            "face",
                            f"imports {', '.join(public)} from {imp.target}: a plug-in takes public names "
                            f"from the face (from devgraph import {', '.join(public)})",
                        )
                if imp.target != self.table.FACE and unit_of(imp.target, allowed) is None:
                    yield Violation(
                        module,
                        imp.line,
                        "plugin",
                        f"imports {imp.target}: a plug-in imports the face and {', '.join(allowed)} only "
                        "(tools/layer_table.py PLUGIN_MAY_IMPORT)",
                    )


def check(root: Path = ROOT) -> list[Violation]:
    """Every violation of the layer table in the tree at ``root``."""
    return Checker(root).check()


# -- the docs ------------------------------------------------------------------------------------------
_BLOCKS = ("layers", "orders")


def _shown(unit: str) -> str:
    name = unit.removeprefix(f"{PACKAGE}.")
    if unit == PACKAGE:
        return "`__init__.py`"
    if name.endswith(".*"):
        return f"`{name[:-2].replace('.', '/')}/`"
    return f"`{name.replace('.', '/')}.py`"


def _may_import(level: int, top: int) -> str:
    if level == 0:
        return "nothing of devgraph"
    if level == top:
        return "everything"
    return "layer 0" if level == 1 else f"layers 0–{level - 1}"


def render(table: ModuleType) -> dict[str, str]:
    """The generated blocks of docs/architecture.md: the layer table and the orders inside folders."""
    top = len(table.LAYERS) - 1
    lines = ["| layer | folder or module | what | may import |", "| --- | --- | --- | --- |"]
    for level, rows in enumerate(table.LAYERS):
        for row in rows:
            units = ", ".join(_shown(u) for u in row.units)
            lines.append(f"| {level} | {units} | {row.what} | {_may_import(level, top)} |")
    orders = []
    for folder, levels in table.ORDERS.items():
        orders += [
            f"`{folder.removeprefix(f'{PACKAGE}.').replace('.', '/')}/`, bottom to top:",
            "",
            "| level | units |",
            "| --- | --- |",
        ]
        for level, units in enumerate(levels):
            orders.append(f"| {level} | {', '.join(f'`{u}`' for u in units)} |")
        orders.append("")
    return {"layers": "\n".join(lines), "orders": "\n".join(orders).rstrip()}


def with_blocks(text: str, blocks: Mapping[str, str]) -> str:
    """``text`` with each ``<!-- NAME:begin -->`` ... ``<!-- NAME:end -->`` block replaced."""
    for name, body in blocks.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if begin not in text or end not in text:
            raise ValueError(f"{DOCS} has no {begin} ... {end} block")
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = f"{head}{begin}\n{body}\n{end}{tail}"
    return text


# -- a proposal for an order ---------------------------------------------------------------------------
def propose(folder: str, root: Path = ROOT) -> list[list[str]]:
    """The levels today's imports allow for the modules of ``folder`` (each at one above the highest
    module it imports); a cycle between modules raises."""
    modules = {m: p for m, p in package_modules(root).items() if relative(folder, m) is not None}
    edges = {
        m: {
            i.target
            for i in read_imports(m, p, set(modules), p.name == "__init__.py")
            if i.target in modules and i.target != m
        }
        for m, p in modules.items()
    }
    level: dict[str, int] = {}

    def visit(module: str, path: tuple[str, ...]) -> int:
        if module in path:
            raise ValueError(f"import cycle: {' -> '.join((*path, module))}")
        if module not in level:
            level[module] = 1 + max((visit(t, (*path, module)) for t in edges[module]), default=-1)
        return level[module]

    for module in modules:
        visit(module, ())
    out: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for module, lv in level.items():
        out[lv].append(relative(folder, module) or "__init__")
    return [sorted(names) for names in out]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    docs = sub.add_parser("docs", help="render the table into docs/architecture.md")
    docs.add_argument("--write", action="store_true", help="rewrite the generated blocks")
    docs.add_argument("--check", action="store_true", help="exit 1 if they differ from the table")
    proposal = sub.add_parser("propose", help="the levels today's imports allow inside a folder")
    proposal.add_argument("folder", help="a dotted folder name, e.g. devgraph.runner")
    args = parser.parse_args(argv)
    if args.command == "docs":
        path = ROOT / DOCS
        text = path.read_text(encoding="utf-8")
        wanted = with_blocks(text, render(load_table()))
        if args.write:
            path.write_text(wanted, encoding="utf-8")
            return 0
        if wanted != text:
            print(f"{DOCS} differs from tools/layer_table.py: run python tools/layers.py docs --write")
            return 1
        return 0
    if args.command == "propose":
        for i, names in enumerate(propose(args.folder)):
            print(f"        {tuple(names)!r},  # level {i}")
        return 0
    violations = check()
    for violation in violations:
        print(violation)
    pending = sum(v.rule == "face-pending" for v in violations)
    failing = len(violations) - pending
    print(f"{failing} violation(s); {pending} face import(s) pending (FACE_PENDING)", file=sys.stderr)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
