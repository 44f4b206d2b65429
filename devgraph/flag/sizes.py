"""Size lists: which shapes get a graph, and which captured shape a step pads up to.

Sizes are bounded twice: a hard cap per phase (no engine captures a decode batch of a million requests)
and a cap from the device's free memory that the caller passes in (the runner knows how many bytes one
row of its static inputs takes). Both are named in the error, so a user sees which one to move.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from devgraph.contract.keys import bucket_index
from devgraph.contract.phases import DEFAULT_DECODE_SIZES, DEFAULT_PREFILL_SIZES, PHASE_SPECS, Phase
from devgraph.errors import ConfigError
from devgraph.messages import kind, shorten

__all__ = [
    "DEFAULT_DECODE_SIZES",
    "DEFAULT_PREFILL_SIZES",
    "HARD_MAX_SIZE",
    "MAX_SIZE_COUNT",
    "SizeSchedule",
    "check_size",
    "default_max_size",
    "device_max_size",
    "resolve_sizes",
]

logger = logging.getLogger(__name__)

GiB = 1 << 30

#: The largest size a phase may capture on any device, by phase name (each phase's
#: :attr:`~devgraph.contract.phases.PhaseSpec.hard_max_size`).
HARD_MAX_SIZE: dict[str, int] = {phase.value: phase.spec.hard_max_size for phase in Phase}
#: At most this many sizes per phase (each is a captured graph; real engines use tens).
MAX_SIZE_COUNT = 1024
#: The smallest per-row cost assumed when the caller does not say: one row of a 256-wide float32 input.
MIN_ROW_BYTES = 1024
#: Static input buffers of the largest size may take at most this share of the free device memory.
_FREE_MEMORY_SHARE = 2


def hard_max_size(phase: str) -> int:
    """The phase's hard cap (:data:`HARD_MAX_SIZE`)."""
    return Phase.parse(phase).spec.hard_max_size


def device_max_size(free_bytes: int | None, row_bytes: int | None = None) -> int | None:
    """The largest size whose static input rows take at most half of ``free_bytes``; ``None`` if unknown."""
    if free_bytes is None:
        return None
    per_row = max(int(row_bytes or 0), MIN_ROW_BYTES)
    return max(1, int(free_bytes) // (_FREE_MEMORY_SHARE * per_row))


def _limit(phase: str, free_bytes: int | None, row_bytes: int | None) -> tuple[int, str]:
    """The largest allowed size and a sentence naming both caps."""
    hard = hard_max_size(phase)
    caps = "the hard cap is " + ", ".join(
        f"{spec.hard_max_size} {spec.counts} for {phase}" for phase, spec in PHASE_SPECS.items()
    )
    device = device_max_size(free_bytes, row_bytes)
    if device is None:
        return hard, f"{caps}; the device's free memory sets a second cap when the runner is built"
    per_row = max(int(row_bytes or 0), MIN_ROW_BYTES)
    return min(hard, device), (
        f"{caps}; this device's free memory ({int(free_bytes or 0) / GiB:.1f} GiB) affords {device} rows "
        f"of {per_row} bytes of static inputs (at most 1/{_FREE_MEMORY_SHARE} of it)"
    )


def check_size(
    phase: str, value: object, what: str, *, free_bytes: int | None = None, row_bytes: int | None = None
) -> int:
    """``value`` if it is an integer from 1 to the phase's limit; :class:`ConfigError` naming both caps."""
    top, why = _limit(phase, free_bytes, row_bytes)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what} must be an integer from 1 to {top}, got {shorten(value)} ({kind(value)})")
    if not 1 <= value <= top:
        raise ConfigError(f"{what} must be an integer from 1 to {top}, got {shorten(value)}; {why}")
    return value


def check_size_list(
    phase: str, sizes: object, what: str, *, free_bytes: int | None = None, row_bytes: int | None = None
) -> list[int]:
    """``sizes`` as a list of checked sizes: a non-empty sequence of at most :data:`MAX_SIZE_COUNT`."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ConfigError(
            f"{what} must be a non-empty list of positive integers, got {shorten(sizes)} "
            f"(a {type(sizes).__name__})"
        )
    if not sizes:
        raise ConfigError(f"{what} is empty; give at least one positive integer or leave it unset")
    if len(sizes) > MAX_SIZE_COUNT:
        raise ConfigError(
            f"{what} has {len(sizes)} entries; at most {MAX_SIZE_COUNT} sizes per phase are accepted "
            "(each is a captured graph)"
        )
    return [check_size(phase, s, f"{what} entry", free_bytes=free_bytes, row_bytes=row_bytes) for s in sizes]


def default_max_size(phase: str, free_bytes: int | None) -> int:
    """The largest size to capture when the user gives none, from the device's free memory (the phase's
    :attr:`~devgraph.contract.phases.PhaseSpec.max_by_free_memory`)."""
    spec = Phase.parse(phase).spec
    if free_bytes is not None:
        for threshold, largest in spec.max_by_free_memory:
            if free_bytes < threshold:
                return largest
    return spec.largest_default


@dataclass(frozen=True)
class SizeSchedule:
    """Captured sizes in ascending order and the bucket lookup over them (by bisection, O(log n))."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        if not sizes:
            raise ConfigError("a size list needs at least one size")
        if len(sizes) > MAX_SIZE_COUNT:
            raise ConfigError(f"a size list has {len(sizes)} entries; at most {MAX_SIZE_COUNT} are accepted")
        ceiling = max(HARD_MAX_SIZE.values())
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= ceiling:
                raise ConfigError(f"sizes must be integers from 1 to {ceiling}, got {shorten(s)}")
        if any(a >= b for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ConfigError(f"SizeSchedule sizes must be strictly ascending, got {shorten(sizes)}")
        object.__setattr__(self, "sizes", sizes)

    @property
    def max(self) -> int:
        return self.sizes[-1]

    def bucket(self, n: int) -> int | None:
        """The smallest captured size >= ``n``, or ``None`` when ``n`` is past the largest."""
        if not 0 <= n <= self.sizes[-1]:
            return None
        return self.sizes[bucket_index(self.sizes, n)]

    def __iter__(self) -> Iterator[int]:
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)


def resolve_sizes(
    phase: str,
    sizes: Sequence[int] | None = None,
    max_size: int | None = None,
    free_bytes: int | None = None,
    *,
    row_bytes: int | None = None,
) -> SizeSchedule:
    """Build the schedule for ``phase``.

    User ``sizes`` are sorted and de-duplicated; sizes above ``max_size`` are dropped with a warning
    (never silently); ``max_size`` itself is always captured. Without ``sizes`` the phase's default list
    is cut at ``max_size`` (or at :func:`default_max_size` of the free memory). Every size must lie within
    the phase's hard cap and the cap ``free_bytes`` affords at ``row_bytes`` bytes of static inputs a row
    (:func:`check_size` says both).
    """
    chosen_phase = Phase.parse(phase)
    phase = chosen_phase.value
    limits = {"free_bytes": free_bytes, "row_bytes": row_bytes}
    if max_size is not None:
        check_size(phase, max_size, f"{phase} max_size", **limits)
    if sizes is None:
        defaults = chosen_phase.spec.default_sizes
        if max_size is not None:
            top = max_size
        else:
            top = min(default_max_size(phase, free_bytes), _limit(phase, free_bytes, row_bytes)[0])
        return SizeSchedule(tuple(sorted({s for s in defaults if s < top} | {top})))
    chosen = sorted(set(check_size_list(phase, sizes, f"{phase} sizes", **limits)))
    if max_size is None:
        return SizeSchedule(tuple(chosen))
    dropped = [s for s in chosen if s > max_size]
    if dropped:
        logger.warning(
            "devgraph: %s sizes %s exceed max_size=%d and will not be captured (steps that large "
            "run eagerly)",
            phase,
            dropped,
            max_size,
        )
    return SizeSchedule(tuple(sorted({s for s in chosen if s <= max_size} | {max_size})))
