"""``GraphKey``: what one captured graph is for — a size on each axis plus engine-declared variants;
``Batch``: one step, which pads up to a key; ``bucket_index``: the one rule for which size a count pads to.

A key is small, hashable and ordered, so backends can keep graphs in a dict and the runner can capture
largest first. ``tokens`` is the phase's primary size (a decode batch size, a prefill token count); every
other axis an input declares (``requests`` for sequence lengths, ``cu_seqlens`` and block tables, or an
engine's own) has its own padded size in ``axes``; ``variant`` holds discrete values the graph was
specialised for (``lora=True``, a uniform query length).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Batch", "GraphKey", "TOKENS", "REQUESTS", "bucket_index"]

#: The primary axis of every phase: the number of rows the step's size counts.
TOKENS = "tokens"
#: The usual second axis: one row per request of the batch.
REQUESTS = "requests"


@dataclass(frozen=True)
class GraphKey:
    """One captured shape: ``tokens`` rows, ``axes`` sizes of the other axes, ``variant`` values.

    ``axes`` and ``variant`` are tuples of ``(name, value)`` pairs sorted by name, so two keys built from
    the same mappings compare equal whatever order the mappings had.
    """

    tokens: int
    axes: tuple[tuple[str, int], ...] = ()
    variant: tuple[tuple[str, Hashable], ...] = ()

    @classmethod
    def of(
        cls,
        tokens: int,
        axes: Mapping[str, int] | None = None,
        variant: Mapping[str, Hashable] | None = None,
    ) -> GraphKey:
        """A key from mappings (the usual way to build one)."""
        return cls(
            tokens,
            tuple(sorted((axes or {}).items())),
            tuple(sorted((variant or {}).items(), key=lambda kv: kv[0])),
        )

    def size(self, axis: str) -> int:
        """The padded size of ``axis`` (``tokens`` or one of :attr:`axes`)."""
        if axis == TOKENS:
            return self.tokens
        for name, value in self.axes:
            if name == axis:
                return value
        raise KeyError(f"{self} has no axis {axis!r} (axes: {', '.join([TOKENS, *self.axis_names])})")

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def variant_dict(self) -> dict[str, Any]:
        return dict(self.variant)

    def sort_key(self) -> tuple[Any, ...]:
        """Largest-first capture order: by tokens, then the other axes, then variant (as text)."""
        return (self.tokens, tuple(v for _, v in self.axes), tuple(repr(v) for _, v in self.variant))

    def __str__(self) -> str:
        parts = [f"{TOKENS}={self.tokens}"]
        parts += [f"{name}={value}" for name, value in self.axes]
        parts += [f"{name}={value!r}" for name, value in self.variant]
        return ",".join(parts)


@dataclass(frozen=True)
class Batch:
    """One step of a runner: ``n`` real tokens and the real count of every axis (``tokens`` included).

    ``GraphRunner.run`` validates a step into a Batch before anything is written; once the dispatcher has
    picked the ``key`` the step would replay, a backend's ``can_run`` sees the Batch with that key and the
    step's live ``context``.
    """

    n: int
    key: GraphKey | None = None
    counts: Mapping[str, int] = field(default_factory=dict)
    context: Any = None

    @property
    def size(self) -> int:
        """The padded token count (``key.tokens``; ``n`` before a key is chosen)."""
        return self.key.tokens if self.key is not None else self.n

    def routed(self, key: GraphKey, context: Any) -> Batch:
        """This step as a backend's ``can_run`` sees it: on ``key``, with the live ``context``."""
        return Batch(self.n, key, self.counts, context)


def bucket_index(sizes: Sequence[int], n: int) -> int:
    """Where ``n`` pads to among ascending ``sizes``: the position of the smallest size ``>= n``, or
    ``len(sizes)`` when none holds it. The one bucketing rule: ``SizeSchedule.bucket`` (the flag's sizes)
    and the runner's dispatcher (for tokens and for every other axis) both use it."""
    return bisect.bisect_left(sizes, n)
