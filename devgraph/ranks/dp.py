"""Data-parallel key agreement: every rank of a group pads each step to the largest counts any rank has.

Data-parallel attention engines run a different batch on each rank, but the layers after attention (an
expert-parallel MoE, a tensor-parallel MLP across the DP group) run collectives between the ranks, so every
rank must replay a graph of the same shapes. Per step, each rank sends its counts (one per axis), whether
it must run eagerly (past the largest key, a backend veto, a variant not captured), and a code of its
variant, in one int64 tensor; one all-reduce (MAX) on the group's gloo control group returns the largest
count of every axis, whether any rank runs eagerly, and (as the maximum of the code and of its negation)
whether every rank has the same variant. Each rank then routes the largest counts, so all of them reach
the same key, and pads its own rows up to it. See docs/tensor-parallel.md, "Data parallelism".
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.errors import ReplayError
from devgraph.ranks.group import (
    RANK_TIMEOUT_ENV,
    control_group,
    is_multi_rank,
    rank_name,
    rank_of,
    rank_timeout_s,
)

__all__ = ["GroupAgreement", "GroupCounts", "agree_counts", "variant_code"]


def variant_code(variant: Mapping[str, Any]) -> int:
    """A 62-bit code of a step's variant, equal on every rank for equal variants (0: no variant)."""
    if not variant:
        return 0
    text = repr(sorted((name, repr(value)) for name, value in variant.items()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


@dataclass(frozen=True)
class GroupCounts:
    """What the ranks agreed on for one step: the largest count of every axis over the group, whether
    some rank runs the step eagerly, and whether every rank has the same variant."""

    counts: tuple[int, ...]
    eager: bool
    same_variant: bool


class GroupAgreement:
    """The agreement of one process group, resolved once (its control group, the reduce options), so each
    step costs the all-reduce and little else."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.multi_rank = is_multi_rank(group)
        self._control: Any = None
        self._options: Any = None

    def __call__(self, counts: Sequence[int], eager: bool, code: int = 0) -> GroupCounts:
        """One all-reduce (MAX) of ``[*counts, eager, code, -code]`` over the group's control group."""
        if not self.multi_rank:
            return GroupCounts(tuple(counts), eager, True)
        message = torch.tensor([*counts, int(eager), code, -code], dtype=torch.int64)
        try:
            if self._control is None:
                self._control = control_group(self.group)  # every rank builds it at its first step
                self._options = torch.distributed.AllreduceOptions()
                self._options.reduceOp = torch.distributed.ReduceOp.MAX  # type: ignore[assignment]
            self._control.allreduce([message], self._options).wait()
        except Exception as exc:  # gloo: a timeout, or "connection closed by peer"
            group = self.group
            raise ReplayError(
                f"the data-parallel key agreement lost a rank on {rank_name(group, rank_of(group))}: {exc}. "
                "Every rank of the group must call run() (or agree()) for every step, with its own batch; "
                f"{RANK_TIMEOUT_ENV}={rank_timeout_s():g} s"
            ) from exc
        values = message.tolist()
        n = len(counts)
        most_code, least_code = values[n + 1], -values[n + 2]
        return GroupCounts(tuple(values[:n]), bool(values[n]), most_code == least_code)


def agree_counts(group: Any, counts: Sequence[int], eager: bool, code: int = 0) -> GroupCounts:
    """One agreement over ``group`` (see :class:`GroupAgreement`, which a runner keeps across steps).

    Without a process group, or with one rank, the step's own counts come back. Raises
    :class:`ReplayError` when a rank does not answer within the rank timeout.
    """
    return GroupAgreement(group)(counts, eager, code)
