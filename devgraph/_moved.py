"""Modules that moved, still importable under their old names for a deprecation period.

A module renamed so that its name says what it holds (no two modules of one name for two concepts) keeps
its old import path working: importing the old name gives the new module itself and a
:class:`DeprecationWarning` naming where to import it from. Public names (``devgraph.GraphRunner``, ...)
never moved; these are paths inside the package that code outside it may have imported. The face
(``devgraph/__init__.py``) installs the finder, so any ``import devgraph.<old name>`` reaches it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

#: Old module name -> the module it is now. Entries go once a release has warned about them.
MOVED: dict[str, str] = {
    "devgraph.flag.jsonfile": "devgraph.jsonfile",
    "devgraph.integrations.hf.loop": "devgraph.integrations.hf.decode_loop",
    "devgraph.platforms.sim.modes": "devgraph.platforms.sim.dispatch_modes",
    "devgraph.platforms.sim.pool": "devgraph.platforms.sim.device_memory",
    "devgraph.platforms.sim.rules": "devgraph.platforms.sim.device_rules",
    "devgraph.ranks.capture": "devgraph.ranks.handshake",
    "devgraph.reference.kernels.checks": "devgraph.reference.kernels.interface",
    "devgraph.runner.guard.values": "devgraph.runner.guard.host_values",
    "devgraph.serve.api.startup": "devgraph.serve.startup",
    "devgraph.serve.structured.limits": "devgraph.serve.structured.work_limits",
    "devgraph.strategies.plan": "devgraph.strategies.segments",
    "devgraph.strategies.startup": "devgraph.strategies.compile_time",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of :data:`MOVED` and loads each as the module it is now."""

    def __init__(self) -> None:
        #: Old name -> the new module's own spec, which the import system overwrites with the old name's
        #: between create_module() and exec_module() (put back there: reload() and pickle read it).
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} is now {new}: import it from there (the old name will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module was imported under its new name) but to give it its own spec back."""
        spec = module.__spec__
        if spec is not None and spec.name in self._specs:
            module.__spec__ = self._specs.pop(spec.name)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (after the standard finders: an old name has no file)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
