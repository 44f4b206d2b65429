"""Deciding, per step, whether a graph replays and which one (the backends only capture and replay).

:meth:`Dispatcher.decide` is a function of the step and data: the :class:`Readiness` the runner's graph
life is in, and one :class:`KeySet` per graph set (which keys it replays now, its backend's veto). It maps
a validated step to the smallest :class:`GraphKey` that holds it (:meth:`Dispatcher.route`: the smallest
token size ``>= n`` whose buckets on every other axis hold that axis's count, with the step's variant), then
asks the sets in order: the primary's graph replays if it holds the key and its backend does not veto the
step; else the fallback set's (counted by :class:`FallbackReason`). When none does, the step runs eagerly
and the :class:`EagerReason` says why; the runner counts every reason, so no eager fallback is silent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devgraph.contract.keys import TOKENS, Batch, GraphKey, bucket_index
from devgraph.contract.modes import Word
from devgraph.runner.schedule import KeySchedule

__all__ = ["Decision", "Dispatcher", "EagerReason", "FallbackReason", "KeySet", "Readiness"]


class EagerReason(Word):
    """Why a step ran eagerly."""

    DISABLED = "disabled"  # the phase's mode captures no graphs (disabled / eager)
    BEFORE_CAPTURE = "before_capture"  # run() before capture()
    PAST_LARGEST = "past_largest"  # more tokens than the largest captured size
    AXIS_PAST_LARGEST = "axis_past_largest"  # another axis's count past its largest bucket
    VARIANT_NOT_CAPTURED = "variant_not_captured"  # a variant value that was not declared for capture
    NOT_CAPTURED = "not_captured"  # the key exists in the schedule but holds no graph
    CAPTURING = "capturing"  # capture in the background: the key's graph is not captured yet
    RELEASED = "released"  # release() gave the graphs' memory back; restore() captures them again
    BACKEND_DECLINED = "backend_declined"  # backend.can_run() said no for this step
    PEER_EAGER = "peer_eager"  # data parallel: another rank of the group runs this step eagerly


class FallbackReason(Word):
    """Why a step replayed the fallback graph set's graph instead of the primary's."""

    BACKEND_DECLINED = "backend_declined"  # the primary's can_run() said no for this step
    NOT_CAPTURED = "not_captured"  # the primary holds no graph for the key (its capture failed)


@dataclass(frozen=True)
class Decision:
    """A step's route: replay ``key`` (the fallback set's graph when ``fallback`` says why), or run
    eagerly for ``reason``."""

    key: GraphKey | None
    reason: EagerReason | None = None
    fallback: FallbackReason | None = None


@dataclass(frozen=True)
class KeySet:
    """One graph set as the dispatcher reads it: whether it replays a key now (``holds``), and its
    backend's veto over a step padded to the key (``veto``: ``backend.can_run``; ``None``: it has none)."""

    holds: Callable[[GraphKey], bool]
    veto: Callable[[Batch], bool] | None = None


@dataclass(frozen=True)
class Readiness:
    """What the runner's graph life allows now: every step eager for ``eager`` (no graphs, not captured
    yet, released), else a key whose graph is absent runs eagerly for ``missing`` (``not_captured``, or
    ``capturing`` while a background capture has keys left)."""

    eager: EagerReason | None
    missing: EagerReason = EagerReason.NOT_CAPTURED


class Dispatcher:
    """Looks steps up in a :class:`KeySchedule`; cheap enough for every step (bisect per axis)."""

    def __init__(self, schedule: KeySchedule) -> None:
        self.schedule = schedule
        self._tokens = schedule.token_sizes
        self._axes = schedule.axis_names
        self._variants = schedule.variants
        # Axis-free, variant-free runners (the common decode case) map n -> key through one table.
        self._simple = not self._axes and not self._variants
        self._keys_by_tokens = {t: GraphKey(t) for t in self._tokens} if self._simple else {}

    def route(self, counts: Mapping[str, int], variant: Mapping[str, Any]) -> Decision:
        """The key a step of ``counts`` would replay if captured, else the reason it cannot."""
        n = counts[TOKENS]
        tokens = self._tokens
        i = bucket_index(tokens, n)
        if i == len(tokens):
            return Decision(None, EagerReason.PAST_LARGEST)
        if self._simple:
            return Decision(self._keys_by_tokens[tokens[i]])
        for name, value in variant.items():
            if value not in self._variants[name]:
                return Decision(None, EagerReason.VARIANT_NOT_CAPTURED)
        buckets = self.schedule.buckets
        for t in tokens[i:]:
            sizes = {}
            for axis in self._axes:
                options = buckets[t][axis]
                j = bucket_index(options, counts[axis])
                if j == len(options):
                    break
                sizes[axis] = options[j]
            else:
                return Decision(GraphKey.of(t, sizes, variant))
        return Decision(None, EagerReason.AXIS_PAST_LARGEST)

    def decide(
        self,
        counts: Mapping[str, int],
        variant: Mapping[str, Any],
        readiness: Readiness,
        sets: Sequence[KeySet],
        step: Batch | None = None,
        context: Any = None,
    ) -> Decision:
        """Route a step, then ask the sets (primary first) whether one replays the key: it ``holds`` it and
        its ``veto`` allows ``step`` padded to the key (no ``step``: no veto is asked)."""
        if readiness.eager is not None:
            return Decision(None, readiness.eager)
        decision = self.route(counts, variant)
        key = decision.key
        if key is None:
            return decision
        declined: EagerReason | None = None
        for i, graphs in enumerate(sets):
            if not graphs.holds(key):
                reason = readiness.missing
            elif graphs.veto is not None and step is not None and not graphs.veto(step.routed(key, context)):
                reason = EagerReason.BACKEND_DECLINED
            elif declined is None:
                return decision
            else:
                return Decision(key, fallback=FallbackReason(declined.value))
            if i == 0:
                declined = reason
        return Decision(None, declined)
