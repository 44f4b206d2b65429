"""Run-time statistics of one runner: replays per key, eager steps by reason, padding waste, lazy cache,
steps the fallback graph set replayed by reason, data-parallel agreement, and (when recording) how many
steps had each count.

Counting is a few dict increments per step; :meth:`RunnerStats.as_dict` gives plain data for logs, JSON
and the optional Prometheus collector (:mod:`devgraph.runner.metrics`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from devgraph.contract.keys import TOKENS, GraphKey
from devgraph.errors import ConfigError
from devgraph.flag.trace import PhaseSteps
from devgraph.runner.dispatch import EagerReason, FallbackReason
from devgraph.runner.schedule import KeySchedule

__all__ = ["RunnerStats"]


@dataclass
class RunnerStats:
    """Counters since the runner was built (or :meth:`reset`)."""

    replays: Counter[GraphKey] = field(default_factory=Counter)
    eager: Counter[EagerReason] = field(default_factory=Counter)
    real_rows: int = 0  # real tokens of replayed steps
    padded_rows: int = 0  # padding tokens of replayed steps
    lazy_hits: int = 0
    lazy_misses: int = 0
    lazy_evictions: int = 0
    lazy_capture_seconds: float = 0.0
    verify_calls: int = 0
    fallback: Counter[FallbackReason] = field(default_factory=Counter)
    agreed_steps: int = 0  # data parallel: steps agreed with the group
    agreement_transport: str | None = None  # data parallel: where the agreement runs (shm, device, host)
    peer_padded_rows: int = 0  # tokens padded beyond this rank's own key because a peer had more
    #: Steps per count tuple ``(tokens, *other axes)``, while recording (``None``: not recording).
    recorded: Counter[tuple[int, ...]] | None = None

    def replayed(self, key: GraphKey, n: int) -> None:
        self.replays[key] += 1
        self.real_rows += n
        self.padded_rows += key.tokens - n

    def ran_eagerly(self, reason: EagerReason) -> None:
        self.eager[reason] += 1

    def reset(self) -> None:
        recording = self.recorded is not None
        fresh = RunnerStats()
        self.__dict__.update(fresh.__dict__)
        if recording:
            self.recorded = Counter()

    @property
    def steps(self) -> int:
        return sum(self.replays.values()) + sum(self.eager.values())

    def as_dict(self) -> dict[str, Any]:
        """Everything as plain data: key strings and reason names as dict keys."""
        replays = sum(self.replays.values())
        eager = sum(self.eager.values())
        return {
            "steps": replays + eager,
            "replays": replays,
            "replays_by_key": {
                str(k): v for k, v in sorted(self.replays.items(), key=lambda kv: kv[0].sort_key())
            },
            "eager": eager,
            "eager_by_reason": {str(r): self.eager.get(r, 0) for r in EagerReason},
            "real_rows": self.real_rows,
            "padded_rows": self.padded_rows,
            "padding_waste": self.padded_rows / self.real_rows if self.real_rows else 0.0,
            "lazy": {
                "hits": self.lazy_hits,
                "misses": self.lazy_misses,
                "evictions": self.lazy_evictions,
                "capture_seconds": self.lazy_capture_seconds,
            },
            "verify_calls": self.verify_calls,
            "fallback": {
                "replays": sum(self.fallback.values()),
                "by_reason": {str(r): self.fallback.get(r, 0) for r in FallbackReason},
            },
            "data_parallel": {
                "agreed_steps": self.agreed_steps,
                "peer_padded_rows": self.peer_padded_rows,
                "transport": self.agreement_transport,
            },
            "recorded": None
            if self.recorded is None
            else {"steps": [[*counts, steps] for counts, steps in sorted(self.recorded.items())]},
        }

    def phase_steps(self, schedule: KeySchedule, graph_bytes: dict[int, int]) -> PhaseSteps:
        """The steps recorded so far with the schedule and the bytes each captured token size took, for
        ``write_trace`` / ``devgraph tune``."""
        histogram = self.recorded
        phase = schedule.phase
        if histogram is None:
            raise ConfigError(
                f"the {phase} runner is not recording steps; build it with record_steps=True or call "
                "record_steps(True) before the traffic to tune for"
            )
        sizes = {TOKENS: list(schedule.token_sizes)}
        for axis in schedule.axis_names:
            if schedule.tokens_per_request is None:
                sizes[axis] = sorted({b for t in schedule.token_sizes for b in schedule.buckets[t][axis]})
        return PhaseSteps(phase, (TOKENS, *schedule.axis_names), Counter(histogram), sizes, graph_bytes)
