"""Data-parallel key agreement: every rank of a group pads each step to the largest counts any rank has.

Data-parallel attention engines run a different batch on each rank, but the layers after attention (an
expert-parallel MoE, a tensor-parallel MLP across the DP group) run collectives between the ranks, so every
rank must replay a graph of the same shapes. Per step, each rank sends its counts (one per axis), whether
it must run eagerly (past the largest key, a backend veto, a variant not captured), a code of its variant
and a code of the keys it holds, in one int64 message; one all-reduce (MAX) returns the largest count of
every axis, whether any rank runs eagerly, and (as the maximum of each code and of its negation) whether
every rank has the same variant and the same keys. Each rank then routes the largest counts, so ranks with
the same keys reach the same key, and pads its own rows up to it; ranks whose keys differ (built with other
sizes, axes or variants) would route the same counts to different keys, so every rank raises instead.

The all-reduce reads a shared-memory board where every rank is on one host, else runs on the device where
the group is NCCL's, else on the gloo control group (:mod:`devgraph.ranks.transport`). See
docs/tensor-parallel.md, "Data parallelism".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devgraph.errors import ReplayError
from devgraph.messages import shorten
from devgraph.ranks.group import (
    RANK_TIMEOUT_ENV,
    PeerLost,
    exchange,
    is_multi_rank,
    rank_name,
    rank_of,
    rank_timeout_s,
)
from devgraph.ranks.transport import Transport, transport_for

__all__ = ["GroupAgreement", "GroupCounts", "agree_counts", "keys_code", "variant_code"]


def _code(text: str) -> int:
    """A 62-bit code of ``text``, equal on every rank (Python's hash() of text is not); its negation fits
    an int64 too, which the agreement needs."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def variant_code(variant: Mapping[str, Any]) -> int:
    """A 62-bit code of a step's variant, equal on every rank for equal variants (0: no variant)."""
    if not variant:
        return 0
    return _code(repr(sorted((name, repr(value)) for name, value in variant.items())))


def keys_code(keys: Iterable[Any]) -> int:
    """A 62-bit code of a runner's key set (sizes on every axis, variants), in any order (0: no keys)."""
    texts = sorted(str(key) for key in keys)
    return _code("\n".join(texts)) if texts else 0


@dataclass(frozen=True)
class GroupCounts:
    """What the ranks agreed on for one step: the largest count of every axis over the group, whether
    some rank runs the step eagerly, and whether every rank has the same variant."""

    counts: tuple[int, ...]
    eager: bool
    same_variant: bool


class GroupAgreement:
    """The agreement of one process group, resolved once (its transport, this rank's key-set code), so each
    step costs the all-reduce and little else. ``keys``: the keys this rank's runner holds (``None``: not
    compared)."""

    def __init__(self, group: Any, keys: Iterable[Any] | None = None) -> None:
        self.group = group
        self.multi_rank = is_multi_rank(group)
        listed = sorted(str(key) for key in keys) if keys is not None else []
        self.keys_code = keys_code(listed)
        self._listing = shorten(listed, 160)
        self._transport: Transport | None = None

    @property
    def transport(self) -> str | None:
        """``shm``, ``device`` or ``host`` once the first step chose one (``None`` before, or with one
        rank)."""
        return self._transport.name if self._transport is not None else None

    def __call__(self, counts: Sequence[int], eager: bool, code: int = 0) -> GroupCounts:
        """One all-reduce (MAX) of ``[*counts, eager, code, -code, keys, -keys]`` over the group."""
        if not self.multi_rank:
            return GroupCounts(tuple(counts), eager, True)
        keys = self.keys_code
        message = [*counts, int(eager), code, -code, keys, -keys]
        group = self.group
        try:
            if self._transport is None:
                self._transport = transport_for(group, len(message))
            values = self._transport.max(message)
        except PeerLost as exc:
            raise ReplayError(
                f"the data-parallel key agreement lost a rank on {rank_name(group, rank_of(group))}: {exc}. "
                "Every rank of the group must call run() (or agree()) for every step, with its own batch; "
                f"{RANK_TIMEOUT_ENV}={rank_timeout_s():g} s"
            ) from exc
        n = len(counts)
        if values[n + 3] != -values[n + 4]:
            self._refuse_different_keys()
        most_code, least_code = values[n + 1], -values[n + 2]
        return GroupCounts(tuple(values[:n]), bool(values[n]), most_code == least_code)

    def _refuse_different_keys(self) -> None:
        """Every rank saw the codes differ: each lists every rank's keys (one exchange) and raises."""
        group = self.group
        try:
            listings = exchange(group, self._listing)
            shown = "; ".join(f"{rank_name(group, r)}: {text}" for r, text in enumerate(listings))
        except PeerLost as exc:
            shown = f"the listing itself failed: {exc}"
        raise ReplayError(
            "the data-parallel ranks hold different keys, so the same agreed counts would replay different "
            f"graphs on different ranks (their collectives would pair up wrongly or hang): {shown}. Build "
            "every rank's runner with the same sizes, axes and variants (and retune every rank alike); "
            f"this is {rank_name(group, rank_of(group))}"
        )


def agree_counts(
    group: Any, counts: Sequence[int], eager: bool, code: int = 0, keys: Iterable[Any] | None = None
) -> GroupCounts:
    """One agreement over ``group`` (see :class:`GroupAgreement`, which a runner keeps across steps).

    Without a process group, or with one rank, the step's own counts come back. Raises
    :class:`ReplayError` when a rank does not answer within the rank timeout, or when the ranks' ``keys``
    differ.
    """
    return GroupAgreement(group, keys)(counts, eager, code)
