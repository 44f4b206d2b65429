"""Size lists: which shapes get a graph, and which captured shape a step pads up to."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from devgraph.errors import ConfigError

__all__ = [
    "DEFAULT_DECODE_SIZES",
    "DEFAULT_PREFILL_SIZES",
    "SizeSchedule",
    "default_max_size",
    "resolve_sizes",
]

logger = logging.getLogger("devgraph.sizes")

GiB = 1 << 30

#: Decode batch sizes: dense at small batches (where latency matters most), then steps of 8, 16 and 32.
DEFAULT_DECODE_SIZES: tuple[int, ...] = (
    1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128,
    144, 160, 176, 192, 208, 224, 240, 256, 288, 320, 352, 384, 416, 448, 480, 512,
)  # fmt: skip

#: Prefill / encode token counts: powers of two and the 1.5x points between them.
DEFAULT_PREFILL_SIZES: tuple[int, ...] = (
    16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192,
)  # fmt: skip

# (free-memory threshold, decode max, prefill max): more free memory affords larger graphs.
_MAX_BY_FREE_MEMORY: tuple[tuple[int, int, int], ...] = (
    (8 * GiB, 16, 256),
    (24 * GiB, 64, 1024),
    (48 * GiB, 128, 2048),
)
_MAX_LARGEST = (256, 4096)


def default_max_size(phase: str, free_bytes: int | None) -> int:
    """The largest size to capture when the user gives none, from the device's free memory."""
    decode = phase == "decode"
    if free_bytes is not None:
        for threshold, decode_max, prefill_max in _MAX_BY_FREE_MEMORY:
            if free_bytes < threshold:
                return decode_max if decode else prefill_max
    return _MAX_LARGEST[0] if decode else _MAX_LARGEST[1]


@dataclass(frozen=True)
class SizeSchedule:
    """Captured sizes in ascending order and the bucket lookup over them."""

    sizes: tuple[int, ...]
    _table: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ConfigError("a size list needs at least one size")
        table = [self.sizes[0]] + [
            self.sizes[bisect.bisect_left(self.sizes, n)] for n in range(1, self.max + 1)
        ]
        object.__setattr__(self, "_table", tuple(table))

    @property
    def max(self) -> int:
        return self.sizes[-1]

    def bucket(self, n: int) -> int | None:
        """The smallest captured size >= ``n``, or ``None`` when ``n`` is past the largest."""
        if 0 <= n <= self.sizes[-1]:
            return self._table[n]
        return None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)


def _validate(sizes: Iterable[object], what: str) -> list[int]:
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
            raise ConfigError(f"{what} must be positive integers, got {s!r}")
        out.append(s)
    return out


def resolve_sizes(
    phase: str,
    sizes: Sequence[int] | None = None,
    max_size: int | None = None,
    free_bytes: int | None = None,
) -> SizeSchedule:
    """Build the schedule for ``phase``.

    User ``sizes`` are sorted and de-duplicated; sizes above ``max_size`` are dropped with a warning
    (never silently); ``max_size`` itself is always captured. Without ``sizes`` the phase's default list
    is cut at ``max_size`` (or at :func:`default_max_size` of the free memory).
    """
    if max_size is not None:
        _validate([max_size], "max_size")
    if sizes is None:
        defaults = DEFAULT_DECODE_SIZES if phase == "decode" else DEFAULT_PREFILL_SIZES
        top = max_size if max_size is not None else default_max_size(phase, free_bytes)
        return SizeSchedule(tuple(sorted({s for s in defaults if s < top} | {top})))
    chosen = sorted(set(_validate(sizes, "sizes")))
    if not chosen:
        raise ConfigError(f"the {phase} size list is empty; give at least one size or leave it unset")
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
