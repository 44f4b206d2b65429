"""Optional packages and the pip extras of devgraph that install them.

Core devgraph imports none of them at import time; a command or feature that needs one calls
:func:`require_extra` first, so a missing package is one line naming the extra to install
(``pip install 'devgraph[serve]'``), not a traceback from deep inside.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from devgraph.errors import BackendUnavailableError
from devgraph.messages import shorten

__all__ = ["install_hint", "missing_extra", "require_extra"]


def install_hint(extra: str) -> str:
    """``pip install 'devgraph[extra]'`` (quoted: the brackets are a glob in most shells)."""
    return f"pip install 'devgraph[{extra}]'"


def missing_extra(module: str, extra: str, needed_by: str, error: ImportError) -> str:
    """The one-line message for ``module`` failing to import: not installed, or installed but broken."""
    missing = error.name is not None and (error.name == module or module.startswith(f"{error.name}."))
    why = "is not installed" if missing else f"does not import ({shorten(str(error), 160)})"
    return f"{needed_by} needs {module}, which {why}: {install_hint(extra)}"


def require_extra(module: str, *, extra: str, needed_by: str) -> ModuleType:
    """``module`` imported; :class:`BackendUnavailableError` with the install hint of ``extra`` when it
    does not import. ``needed_by`` says who needs it (``"devgraph serve"``)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise BackendUnavailableError(missing_extra(module, extra, needed_by, error)) from None
