"""The transformers package, imported on first use (``import devgraph`` never imports it), and the range of
releases this integration is tested on.

The range is stated, not enforced by version string: what the integration needs is found by signature and
attribute (:mod:`~devgraph.integrations.hf.features`), and a release that lacks a piece is refused naming
the piece. A release outside the tested range that has every piece is used, with one warning.
"""

from __future__ import annotations

import importlib
import logging
import re
from types import ModuleType

from devgraph import BackendUnavailableError

__all__ = [
    "INSTALL_HINT",
    "MIN_VERSION",
    "MAX_TESTED_VERSION",
    "SUPPORTED",
    "TESTED_VERSIONS",
    "installed_version",
    "transformers",
]

INSTALL_HINT = "pip install 'devgraph[transformers]'"
#: The oldest and the newest minor releases the integration is tested on (both ends included).
MIN_VERSION = (5, 17)
MAX_TESTED_VERSION = (5, 24)
#: The releases ``tests/test_hf.py`` ran under (on the CPU).
TESTED_VERSIONS = ("5.17.0", "5.18.0", "5.19.0", "5.20.0", "5.21.1", "5.22.2", "5.23.0", "5.24.0")
#: What devgraph supports, in the words its messages use.
SUPPORTED = (
    f"transformers {MIN_VERSION[0]}.{MIN_VERSION[1]} to {MAX_TESTED_VERSION[0]}.{MAX_TESTED_VERSION[1]} "
    f"(tested: {', '.join(TESTED_VERSIONS)}; "
    f"pip install 'transformers>={MIN_VERSION[0]}.{MIN_VERSION[1]},"
    f"<{MAX_TESTED_VERSION[0]}.{MAX_TESTED_VERSION[1] + 1}')"
)

logger = logging.getLogger(__name__)

_module: ModuleType | None = None


def _minor(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def installed_version() -> str:
    """The installed transformers' ``__version__`` (imports it)."""
    return str(getattr(transformers(), "__version__", "unknown"))


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
    version = str(getattr(module, "__version__", "unknown"))
    if not MIN_VERSION <= _minor(version)[:2] <= MAX_TESTED_VERSION:
        # Not a refusal: the pieces are checked by feature when a decoder is built, and a missing one is
        # refused there by name. Said once, so a report of odd behaviour carries the version.
        logger.warning(
            "devgraph: transformers %s is outside the range devgraph's integration is tested on (%s); "
            "the pieces it needs are checked when a DevgraphDecoder is built",
            version,
            SUPPORTED,
        )
    _module = module
    return module
