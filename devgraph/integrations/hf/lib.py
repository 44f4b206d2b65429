"""The transformers package, imported on first use: ``import devgraph`` never imports it."""

from __future__ import annotations

import importlib
import re
from types import ModuleType

from devgraph.errors import BackendUnavailableError

__all__ = ["INSTALL_HINT", "MIN_VERSION", "TESTED_VERSIONS", "transformers"]

INSTALL_HINT = "pip install 'devgraph[transformers]'"
#: The oldest release whose ``generate()`` contract (``custom_generate`` callables, ``StaticLayer`` with a
#: device-side write position, no ``cache_position`` argument) this integration was written against.
MIN_VERSION = (5, 17)
TESTED_VERSIONS = ("5.17.0", "5.23.0")

_module: ModuleType | None = None


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def transformers() -> ModuleType:
    """``import transformers``, or :class:`BackendUnavailableError` saying what to install."""
    global _module
    if _module is not None:
        return _module
    try:
        module = importlib.import_module("transformers")
    except ImportError as exc:
        raise BackendUnavailableError(
            f"devgraph.integrations.transformers needs the transformers package ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from None
    version = getattr(module, "__version__", "0")
    if _version_tuple(version) < MIN_VERSION:
        floor = ".".join(map(str, MIN_VERSION))
        raise BackendUnavailableError(
            f"devgraph.integrations.transformers needs transformers >= {floor} (tested with "
            f"{', '.join(TESTED_VERSIONS)}); this environment has {version}. Upgrade with: {INSTALL_HINT}"
        )
    _module = module
    return module
