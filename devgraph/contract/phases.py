"""The phases an engine runs, each with its own runner, sizes and backend choice.

A phase is a closed set of names (``decode``, ``prefill``, ``encode``, ``verify``). Callers turn a name into
a :class:`Phase` once (:meth:`Phase.parse`) and then ask it (:attr:`Phase.uniform`) or compare members;
no caller compares phase strings.
"""

from __future__ import annotations

from devgraph.contract.modes import Word
from devgraph.errors import ConfigError
from devgraph.messages import shorten

__all__ = ["PHASES", "Phase", "check_phase"]


class Phase(Word):
    """One step type of an inference engine.

    * ``decode``: one new token per request; sizes are batch sizes.
    * ``verify``: speculative-decoding verification, ``1 + k`` tokens per request; sizes are token counts,
      multiples of ``1 + k``.
    * ``prefill``: packed prompt tokens of several requests; sizes are token counts.
    * ``encode``: packed encoder tokens (image patches); sizes are token counts, often captured lazily.
    """

    DECODE = "decode"
    PREFILL = "prefill"
    ENCODE = "encode"
    VERIFY = "verify"

    @property
    def uniform(self) -> bool:
        """Whether every request brings the same number of tokens (so requests follow from tokens)."""
        return self in (Phase.DECODE, Phase.VERIFY)

    @classmethod
    def parse(cls, value: object) -> Phase:
        """``value`` as a :class:`Phase`; :class:`ConfigError` listing the accepted names otherwise."""
        if isinstance(value, Phase):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"unknown phase {shorten(value, 40)}; accepted: {', '.join(PHASES)}") from None


#: Every phase name, in the order docs and reports list them.
PHASES: tuple[str, ...] = tuple(p.value for p in Phase)


def check_phase(phase: object) -> str:
    """Return ``phase``'s name if it is a known phase, else raise :class:`ConfigError` listing them."""
    return Phase.parse(phase).value
