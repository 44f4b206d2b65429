"""The ``devgraph`` console command's entry point: answers ``devgraph --version`` before anything heavy is
imported, and hands every other command line to :func:`devgraph.cli.main`.

It lives outside the ``devgraph`` package on purpose: importing any ``devgraph.*`` module runs
``devgraph/__init__.py``, which loads the library and with it torch (seconds), so a command that only
prints the version would pay for torch. The version is read from ``devgraph/_version.py`` (a leaf module
with no imports), found without importing its package.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

__all__ = ["main", "version"]


def version() -> str:
    """``devgraph.__version__``, without importing ``devgraph``."""
    spec = importlib.util.find_spec("devgraph")  # locates the package; does not run its __init__
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the devgraph package is not installed next to its command")
    for folder in spec.submodule_search_locations:
        leaf = importlib.util.spec_from_file_location("_devgraph_version", f"{folder}/_version.py")
        if leaf is not None and leaf.loader is not None:
            module = importlib.util.module_from_spec(leaf)
            leaf.loader.exec_module(module)
            return str(module.__version__)
    raise RuntimeError("devgraph/_version.py is missing")


def main(argv: Sequence[str] | None = None) -> int:
    """``devgraph [args]``: ``--version`` alone prints at once; anything else runs the command."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:
        print(f"devgraph {version()}")
        return 0
    from devgraph.cli.main import main as run

    return run(args)
