"""The phases an engine runs, each with its own runner, sizes and backend choice, and what each one means as
data: one :class:`PhaseSpec` per phase that every layer reads (the flag's size checks, the key schedule,
what ``auto`` picks on a platform).

A phase is a closed set of names (``decode``, ``prefill``, ``encode``, ``verify``). Callers turn a name into
a :class:`Phase` once (:meth:`Phase.parse`) and then ask it (:attr:`Phase.spec`, :attr:`Phase.uniform`) or
compare members; no caller compares phase strings, and no layer keeps a table of its own per phase.
A new phase is a member here and its spec in :data:`PHASE_SPECS`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from devgraph.contract.modes import Strategy, Word
from devgraph.errors import ConfigError
from devgraph.messages import shorten

__all__ = [
    "DEFAULT_DECODE_SIZES",
    "DEFAULT_PREFILL_SIZES",
    "PHASES",
    "PHASE_SPECS",
    "Phase",
    "PhaseSpec",
    "check_phase",
]

GiB = 1 << 30


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
    def spec(self) -> PhaseSpec:
        """What this phase means (:data:`PHASE_SPECS`)."""
        return PHASE_SPECS[self]

    @property
    def uniform(self) -> bool:
        """Whether every request brings the same number of tokens (so requests follow from tokens)."""
        return self.spec.uniform

    @classmethod
    def parse(cls, value: object) -> Phase:
        """``value`` as a :class:`Phase`; :class:`ConfigError` listing the accepted names otherwise."""
        if isinstance(value, Phase):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"unknown phase {shorten(value, 40)}; accepted: {', '.join(PHASES)}") from None


@dataclass(frozen=True)
class PhaseSpec:
    """One phase as data.

    * ``uniform``: every request brings the same number of tokens, so a step's request count follows from
      its token count and the default sizes count requests (multiplied by the tokens per request).
    * ``tokens_per_request``: fixed for the phase (decode: 1); ``None`` where the engine gives it
      (``needs_tokens_per_request``: verify's ``1 + k``) or where requests vary (prefill, encode).
    * ``hard_max_size``: the largest size on any device (requests for uniform phases: a verify size is a
      token count, but of at most a decode batch's requests times ``1 + k``; tokens otherwise).
    * ``default_sizes``: captured when the engine gives none, cut at a maximum the device's free memory
      affords: ``max_by_free_memory`` (free-bytes threshold, maximum) pairs, else ``largest_default``.
    * ``default_mode``: the strategy ``auto`` picks on a platform whose plug-in names none for the phase
      (mode names are portable across vendors); ``like``: the phase whose default comes next when the
      platform registers no backend of that name for this phase (verify replays decode-shaped steps).
    """

    uniform: bool
    tokens_per_request: int | None
    needs_tokens_per_request: bool
    hard_max_size: int
    default_sizes: tuple[int, ...]
    max_by_free_memory: tuple[tuple[int, int], ...]
    largest_default: int
    default_mode: str
    like: Phase | None = None

    @property
    def counts(self) -> str:
        """What a size of the phase counts, in words (messages name it)."""
        return "requests" if self.uniform else "tokens"


#: Decode batch sizes: dense at small batches (where latency matters most), then steps of 8, 16 and 32.
DEFAULT_DECODE_SIZES: tuple[int, ...] = (
    1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128,
    144, 160, 176, 192, 208, 224, 240, 256, 288, 320, 352, 384, 416, 448, 480, 512,
)  # fmt: skip

#: Prefill / encode token counts: powers of two and the 1.5x points between them.
DEFAULT_PREFILL_SIZES: tuple[int, ...] = (
    16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192,
)  # fmt: skip

# More free memory affords larger graphs: (free-memory threshold, the largest default size below it).
_DECODE_MAX = ((8 * GiB, 16), (24 * GiB, 64), (48 * GiB, 128))
_PREFILL_MAX = ((8 * GiB, 256), (24 * GiB, 1024), (48 * GiB, 2048))

#: Why these defaults (measured: docs/performance.md). decode: ``full`` replays the whole step with one
#: launch, as fast as a hand-written CUDA graph (0.99-1.01x on an H100) and bit-identical to eager; decode
#: attention reads only device tensors. prefill/encode: real attention needs host-side metadata (variable
#: lengths), so the default cuts the graph at break ops; ``breakable`` replays as fast as ``tc_piecewise``
#: with the eager compiler, captures 10x faster (no torch.compile) and puts no dynamo constraints on the
#: model code. verify: decode-shaped steps (``1 + k`` tokens per request) with the same device metadata.
_DECODE = PhaseSpec(
    uniform=True,
    tokens_per_request=1,
    needs_tokens_per_request=False,
    hard_max_size=65536,
    default_sizes=DEFAULT_DECODE_SIZES,
    max_by_free_memory=_DECODE_MAX,
    largest_default=256,
    default_mode=Strategy.FULL.value,
)
_PREFILL = PhaseSpec(
    uniform=False,
    tokens_per_request=None,
    needs_tokens_per_request=False,
    hard_max_size=1 << 20,
    default_sizes=DEFAULT_PREFILL_SIZES,
    max_by_free_memory=_PREFILL_MAX,
    largest_default=4096,
    default_mode=Strategy.BREAKABLE.value,
)
PHASE_SPECS: dict[Phase, PhaseSpec] = {
    Phase.DECODE: _DECODE,
    Phase.PREFILL: _PREFILL,
    # Packed encoder tokens: sized and captured like prefill.
    Phase.ENCODE: replace(_PREFILL, like=Phase.PREFILL),
    # Decode-shaped steps of 1 + k tokens per request (the engine gives k), on decode's request sizes.
    Phase.VERIFY: replace(_DECODE, tokens_per_request=None, needs_tokens_per_request=True, like=Phase.DECODE),
}

#: Every phase name, in the order docs and reports list them.
PHASES: tuple[str, ...] = tuple(p.value for p in Phase)


def check_phase(phase: object) -> str:
    """Return ``phase``'s name if it is a known phase, else raise :class:`ConfigError` listing them."""
    return Phase.parse(phase).value
