"""The words of ``--device-graph-mode``: special modes, built-in strategies and compilers.

Glossary (docs/glossary.md): a *mode* is the word a user types; a *strategy* is the backend class that
implements it; a *platform* is the device it runs on. ``full`` on an NVIDIA GPU and ``full`` on an Ascend
NPU are one mode served by two backends. What a strategy does (whether it compiles, where its break ops
run) is said by its class (:class:`~devgraph.contract.backend.DeviceGraphBackend`), not here, so a plug-in's
own strategy says it the same way.
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
    "Word",
]


class Word(str, Enum):
    """A word of devgraph's vocabulary: equal to its text, and printed as it."""

    def __str__(self) -> str:
        return self.value


class SpecialMode(Word):
    """Mode names that are not a backend: ``auto`` picks the platform default, the others mean no graphs."""

    AUTO = "auto"
    DISABLED = "disabled"
    EAGER = "eager"


class Strategy(Word):
    """The names of the strategies devgraph ships; plug-ins register backends under these names (or their
    own). Each strategy class sets its ``name`` from here."""

    FULL = "full"
    BREAKABLE = "breakable"
    TC_PIECEWISE = "tc_piecewise"
    EAGER = "eager"


class Compiler(Word):
    """What ``torch.compile`` lowers the forward with: ``eager`` (no code generation) or ``inductor``."""

    EAGER = "eager"
    INDUCTOR = "inductor"


#: Names that mean "no graphs" on every platform.
EAGER_MODES: tuple[str, ...] = (SpecialMode.EAGER.value, SpecialMode.DISABLED.value)
#: Names a backend may not register under: they have a meaning of their own in the flag.
SPECIAL_MODES: tuple[str, ...] = tuple(m.value for m in SpecialMode)
#: A mode name must survive the flag's grammar (``phase=MODE,phase=MODE``) and a shell unquoted.
MODE_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,63}")
