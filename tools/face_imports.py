"""Rewrites the imports of public names in applications and plug-ins to come from devgraph's face:
``from devgraph.errors import ConfigError`` becomes ``from devgraph import ConfigError`` (the ``face`` rule
that tools/layers.py checks), then sorts the imports of every file it changed with ruff.

    python tools/face_imports.py PATH...          # rewrite the modules under PATH (files or folders)
    python tools/face_imports.py --check PATH...  # list what it would change; exit status 1 if anything

Only modules the rule covers change: the applications (``APPLICATIONS`` in tools/layer_table.py) and the
plug-ins; library modules under PATH are left as they are (the library never imports its face). A statement
that mixes public and other names is split in two; one with a comment inside its parentheses is listed and
left for a hand to move.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from layers import PACKAGE, ROOT, Checker, defined_by_face  # noqa: E402


@dataclass(frozen=True)
class Edit:
    """One import statement's text (from ``start`` to ``end``, offsets in the file) and what replaces it."""

    start: int
    end: int
    text: str
    line: int


def _offsets(source: str) -> list[int]:
    starts, total = [], 0
    for line in source.splitlines(keepends=True):
        starts.append(total)
        total += len(line)
    return starts


def _names(aliases: Sequence[ast.alias]) -> str:
    return ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in aliases)


def edits_for(
    source: str, module: str, is_package: bool, face: dict[str, str]
) -> tuple[list[Edit], list[int]]:
    """The rewrites of one module's imports, and the lines of statements left for a hand (comments inside)."""
    package = module if is_package else module.rpartition(".")[0]
    starts = _offsets(source)
    edits, skipped = [], []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or any(a.name == "*" for a in node.names):
            continue
        target = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join([*parent, *([node.module] if node.module else [])])
        if target == PACKAGE or target.split(".")[0] != PACKAGE:
            continue
        public = [a for a in node.names if defined_by_face(a.name, target, face)]
        if not public:
            continue
        start = starts[node.lineno - 1] + node.col_offset
        end = starts[(node.end_lineno or node.lineno) - 1] + (node.end_col_offset or 0)
        if "#" in source[start:end]:
            skipped.append(node.lineno)
            continue
        rest = [a for a in node.names if a not in public]
        indent = "\n" + " " * node.col_offset
        lines = [f"from {'.' * node.level}{node.module or ''} import {_names(rest)}"] if rest else []
        lines.append(f"from {PACKAGE} import {_names(public)}")
        edits.append(Edit(start, end, indent.join(lines), node.lineno))
    return edits, skipped


def rewrite(paths: Sequence[Path], *, write: bool, root: Path = ROOT) -> dict[Path, list[int]]:
    """Files under ``paths`` that the rule covers -> the lines of the statements rewritten (or that would
    be); statements left for a hand are reported on stderr."""
    checker = Checker(root)
    covered: dict[Path, str] = {}
    for name, path in checker.modules.items():
        unit = checker.unit(name)
        if unit is not None and checker.is_application(unit):
            covered[path.resolve()] = name
    for name, (_, path) in checker.plugins.items():
        covered[path.resolve()] = name
    wanted = [p.resolve() for p in paths]
    changed: dict[Path, list[int]] = {}
    for path, module in sorted(covered.items()):
        if not any(path == w or w in path.parents for w in wanted):
            continue
        source = path.read_text(encoding="utf-8")
        edits, skipped = edits_for(source, module, path.name == "__init__.py", checker.face)
        for line in skipped:
            print(
                f"{path}:{line}: a comment inside the statement: move its public names by hand",
                file=sys.stderr,
            )
        if not edits:
            continue
        changed[path] = [e.line for e in edits]
        if write:
            for edit in sorted(edits, key=lambda e: e.start, reverse=True):
                source = source[: edit.start] + edit.text + source[edit.end :]
            path.write_text(source, encoding="utf-8")
    if write and changed:
        files = [str(p) for p in changed]
        # Merge the new ``from devgraph import`` lines with any already there, in import order.
        subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--fix", "--select", "I", "-q", *files], check=False
        )
        subprocess.run([sys.executable, "-m", "ruff", "format", "-q", *files], check=False)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="files or folders to rewrite")
    parser.add_argument("--check", action="store_true", help="list what would change; change nothing")
    args = parser.parse_args(argv)
    changed = rewrite(args.paths, write=not args.check)
    for path, lines in changed.items():
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"{shown}: lines {', '.join(map(str, lines))}")
    statements = sum(len(lines) for lines in changed.values())
    verb = "would rewrite" if args.check else "rewrote"
    print(f"{verb} {statements} import statement(s) in {len(changed)} file(s)", file=sys.stderr)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
