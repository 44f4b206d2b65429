"""The words of ``--device-graph-mode``: special modes, built-in strategies and compilers.

Glossary (docs/glossary.md): a *mode* is the word a user types; a *strategy* is the backend class that
implements it; a *platform* is the device it runs on. ``full`` on an NVIDIA GPU and ``full`` on an Ascend
NPU are one mode served by two backends.
"""

from __future__ import annotations

import re
from enum import Enum

__all__ = [
    "Compiler",
    "EAGER_MODES",
    "MODE_NAME_PATTERN",
    "SPECIAL_MODES",
    "SpecialMode",
    "Strategy",
]


class SpecialMode(str, Enum):
    """Mode names that are not a backend: ``auto`` picks the platform default, the others mean no graphs."""

    AUTO = "auto"
    DISABLED = "disabled"
    EAGER = "eager"

    def __str__(self) -> str:
        return self.value

    @property
    def is_eager(self) -> bool:
        return self is not SpecialMode.AUTO


class Strategy(str, Enum):
    """The strategies devgraph ships; plug-ins register backends under these names (or their own)."""

    FULL = "full"
    BREAKABLE = "breakable"
    TC_PIECEWISE = "tc_piecewise"
    EAGER = "eager"

    def __str__(self) -> str:
        return self.value

    @property
    def accepts_compiler(self) -> bool:
        """Whether the strategy runs the forward through ``torch.compile`` when a compiler is set."""
        return self in (Strategy.FULL, Strategy.TC_PIECEWISE)

    @property
    def runs_breaks_eagerly(self) -> bool:
        """Whether break ops run eagerly between graph segments at replay (rather than inside the graph)."""
        return self in (Strategy.BREAKABLE, Strategy.TC_PIECEWISE)


class Compiler(str, Enum):
    """What ``torch.compile`` lowers the forward with: ``eager`` (no code generation) or ``inductor``."""

    EAGER = "eager"
    INDUCTOR = "inductor"

    def __str__(self) -> str:
        return self.value


#: Names that mean "no graphs" on every platform.
EAGER_MODES: tuple[str, ...] = (SpecialMode.EAGER.value, SpecialMode.DISABLED.value)
#: Names a backend may not register under: they have a meaning of their own in the flag.
SPECIAL_MODES: tuple[str, ...] = tuple(m.value for m in SpecialMode)
#: A mode name must survive the flag's grammar (``phase=MODE,phase=MODE``) and a shell unquoted.
MODE_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,63}")
