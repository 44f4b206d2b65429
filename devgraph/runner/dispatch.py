"""Deciding, per step, whether a graph replays and which one (the backends only capture and replay).

:meth:`Dispatcher.decide` maps a validated step to the smallest captured :class:`GraphKey` that holds it:
the smallest token size ``>= n`` whose buckets on every other axis hold that axis's count, with the step's
variant. When no key fits, the step runs eagerly and the :class:`EagerReason` says why; the runner counts
every reason, so no eager fallback is silent. A runner with a second graph set (``fallback``) replays the
fallback's graph of the key where the primary declines it, counted by :class:`FallbackReason`.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any

from devgraph.contract.keys import TOKENS, GraphKey, bucket_index
from devgraph.contract.modes import Word
from devgraph.runner.schedule import KeySchedule

__all__ = ["Decision", "Dispatcher", "EagerReason", "FallbackReason", "SecondSet"]


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
class SecondSet:
    """The fallback graph set as the dispatcher asks it: does it hold the key, and may the step replay it."""

    has_shape: Callable[[GraphKey], bool]
    can_run: Callable[[GraphKey], bool] | None = None

    def takes(self, key: GraphKey) -> bool:
        return self.has_shape(key) and (self.can_run is None or self.can_run(key))


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
        *,
        uses_graphs: bool,
        captured: bool,
        has_shape: Callable[[GraphKey], bool],
        lazy: bool = False,
        can_run: Callable[[GraphKey], bool] | None = None,
        failed: Container[GraphKey] = (),
        second: SecondSet | None = None,
        capturing: bool = False,
    ) -> Decision:
        """Route a step, then check the runner's state: a key replays only if its graph exists (or, for a
        lazily capturing runner, will be captured now) and ``can_run`` (the backend's veto) allows it;
        where the primary declines, ``second`` (the fallback set) replays the key if it can. ``capturing``:
        the keys are being captured in the background; one not captured yet runs eagerly, as ``capturing``."""
        if not uses_graphs:
            return Decision(None, EagerReason.DISABLED)
        if not captured:
            return Decision(None, EagerReason.BEFORE_CAPTURE)
        decision = self.route(counts, variant)
        key = decision.key
        if key is None:
            return decision
        if (not lazy and not has_shape(key)) or (lazy and key in failed):
            # Not captured; for a lazy runner, its capture failed once (raised then), so it runs eagerly.
            declined = EagerReason.CAPTURING if capturing else EagerReason.NOT_CAPTURED
        elif can_run is not None and not can_run(key):
            declined = EagerReason.BACKEND_DECLINED
        else:
            return decision
        if second is not None and second.takes(key):
            return Decision(key, fallback=FallbackReason(declined.value))
        return Decision(None, declined)
