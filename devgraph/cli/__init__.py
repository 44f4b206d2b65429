"""The ``devgraph`` command: ``info``, ``demo`` (one process or tensor-parallel) and, reached lazily, the
serving application's ``serve`` and ``bench serve``."""

from devgraph.cli.main import main

__all__ = ["main"]
