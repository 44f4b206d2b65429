"""The per-step key check: every rank of a tensor-parallel group is about to replay the same key."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from devgraph.errors import ReplayError
from devgraph.ranks.group import (
    RANK_TIMEOUT_ENV,
    PeerLost,
    all_gather,
    exchange,
    is_multi_rank,
    rank_name,
    rank_of,
    rank_timeout_s,
)

__all__ = ["assert_same_key"]


def _key_code(key: Any) -> int:
    """A 63-bit code of the key (0: eager), equal on every rank (Python's hash() of text is not)."""
    if key is None:
        return 0
    digest = hashlib.blake2b(str(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1 or 1


def assert_same_key(group: Any, key: Any) -> None:
    """Raise :class:`ReplayError` unless every rank of ``group`` is about to replay ``key`` (or run eagerly).

    One all-gather of one int64 on the control group per step (a second one, of the keys' text, only when
    they differ). Without a process group, or with one rank, there is nothing to check.
    """
    if not is_multi_rank(group):
        return
    mine = _key_code(key)
    try:
        codes = all_gather(group, torch.tensor([mine], dtype=torch.int64))
        if all(int(code) == mine for code in codes):
            return
        texts = exchange(group, "eager" if key is None else str(key))
    except PeerLost as exc:
        raise ReplayError(
            f"the per-step key check timed out or lost a rank on {rank_name(group, rank_of(group))}: "
            f"{exc}. Every rank must call run() for every step (rank 0 schedules and broadcasts the "
            f"batch); {RANK_TIMEOUT_ENV}={rank_timeout_s():g} s"
        ) from exc
    shown = ", ".join(f"{rank_name(group, r)}: {text}" for r, text in enumerate(texts))
    raise ReplayError(
        f"ranks are about to run different steps ({shown}); tensor-parallel ranks must run the same "
        "batch shape each step, or their collectives pair up wrongly. Let rank 0 schedule and broadcast "
        "the batch to the other ranks"
    )
