"""Compiled or plain, per key: a compiling strategy captures both graphs, times them, and keeps the faster.

A compiled forward is usually faster than the plain one (inductor fuses the elementwise kernels), but not
always: on a decoder that writes one large cache tensor in place, inductor's code was 75x slower than the
plain forward's graph (docs/performance.md). Asking for a compiler must never make a model slower, so with
a compiler set ``full`` captures each key twice into the same pool, the compiled forward and the plain one,
replays each a few times (:func:`time_pair`, through the platform's timer: device events on a GPU), and
keeps the faster graph; the other is released before the next key. The CPU simulator cannot time a replay
as a device would (it re-runs the recorded ops from Python), so there the compiled graph is kept untimed
unless the strategy is given a timer (``backend.replay_timer``: the tests' stand-in, or the host clock).

What it costs, and the bound: one more capture and a few replays per key (their seconds are in
:attr:`KeyChoice.extra_s`). Keys are captured largest first; when the compiled graph loses by
:data:`ABANDON_RATIO` or more at the largest key, the compiled path is given up for every remaining key:
they capture the plain forward only and compile nothing more (where each size compiles on its own, that
is a compile per size saved).

``keep_compiled`` (``create_backend(options={"compiler": "inductor", "keep_compiled": True})``) keeps the
compiled graph whatever the timing says, with a warning that gives the ratio.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

from devgraph.contract.keys import GraphKey

__all__ = [
    "ABANDON_RATIO",
    "agreed_times",
    "CompileChoice",
    "KeyChoice",
    "Kept",
    "PlainOrCompiled",
    "ReplayTimer",
    "time_pair",
]

logger = logging.getLogger(__name__)

#: Once the compiled graph of the largest key takes this many times the plain graph's time, the compiled
#: path is abandoned for the keys after it.
ABANDON_RATIO = 2.0
#: Timed rounds per key, each replaying both graphs ``REPLAYS_PER_ROUND`` times (interleaved, so a clock
#: that drifts affects both alike); the fastest round of each counts.
TIMED_ROUNDS = 3
REPLAYS_PER_ROUND = 2
#: One replay slower than this (seconds) is decided on one round: the difference is not noise.
SLOW_REPLAY_S = 0.05

#: ``timer(replay, iters)``: seconds one ``replay()`` takes, averaged over ``iters`` calls.
ReplayTimer = Callable[[Callable[[], Any], int], float]


class Kept(str, Enum):
    """Which graph serves a key."""

    COMPILED = "compiled"
    PLAIN = "plain"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class KeyChoice:
    """What was measured for one key and which graph was kept.

    ``compiled_s`` / ``plain_s``: seconds per replay (``None`` where that graph was not captured: the
    compiled path was abandoned before this key). ``why``: ``faster``, ``slower``, ``keep_compiled``,
    ``abandoned``, ``plain_failed`` (the plain forward could not be captured: the compiled graph
    serves), ``not_timed`` (the platform cannot time replays: the CPU simulator) or ``cached`` (the
    choice of the process that wrote the artifact cache, with that process's times: a warm start
    replays the graphs a cold one chose, so its outputs are the same bits, and it captures one graph per
    key). ``extra_s``: what choosing cost at capture (the second capture and the timed replays).
    """

    key: GraphKey
    kept: Kept
    why: str
    compiled_s: float | None = None
    plain_s: float | None = None
    extra_s: float = 0.0

    @property
    def ratio(self) -> float | None:
        """Compiled over plain replay time (above 1: the compiled graph is slower)."""
        if self.compiled_s is None or not self.plain_s:
            return None
        return self.compiled_s / self.plain_s

    def describe(self) -> dict[str, Any]:
        ratio = self.ratio
        return {
            "kept": self.kept.value,
            "why": self.why,
            "compiled_ms": None if self.compiled_s is None else round(self.compiled_s * 1e3, 4),
            "plain_ms": None if self.plain_s is None else round(self.plain_s * 1e3, 4),
            "compiled_over_plain": None if ratio is None else round(ratio, 3),
            "choice_seconds": round(self.extra_s, 4),
        }

    def line(self) -> str:
        """One line of the capture report."""
        if self.why == "plain_failed":
            return f"{self.key}: compiled graph only (the plain forward could not be captured)"
        if self.why == "not_timed":
            return f"{self.key}: compiled graph, not timed (this platform's replays do not time a device's)"
        if self.why == "cached":
            times = ""
            if self.compiled_s is not None and self.plain_s is not None:
                times = f" (compiled {self.compiled_s * 1e3:.3f} ms, plain {self.plain_s * 1e3:.3f} ms there)"
            return f"{self.key}: {self.kept} graph only, as the process that wrote cache_dir chose{times}"
        if self.compiled_s is None or self.plain_s is None:
            return f"{self.key}: plain graph only (the compiled path was abandoned at a larger key)"
        return (
            f"{self.key}: compiled {self.compiled_s * 1e3:.3f} ms, plain {self.plain_s * 1e3:.3f} ms per "
            f"replay ({self.ratio:.2f}x): kept {self.kept} ({self.why}); choosing took {self.extra_s:.2f} s"
        )


def time_pair(
    timer: ReplayTimer, compiled: Callable[[], Any], plain: Callable[[], Any], *, fixed: bool = False
) -> tuple[float, float]:
    """Seconds per replay of ``compiled`` and ``plain``: one untimed replay each, then interleaved rounds
    (the fastest round of each counts; one round when a replay is slow enough that noise cannot decide).

    ``fixed``: always every round. Ranks of a process group replay graphs that hold collectives, so each
    must replay exactly as often as its peers, whatever its own clock says."""
    compiled()
    plain()
    best_compiled = timer(compiled, REPLAYS_PER_ROUND)
    best_plain = timer(plain, REPLAYS_PER_ROUND)
    if not fixed and max(best_compiled, best_plain) >= SLOW_REPLAY_S:
        return best_compiled, best_plain
    for _ in range(TIMED_ROUNDS - 1):
        best_compiled = min(best_compiled, timer(compiled, REPLAYS_PER_ROUND))
        best_plain = min(best_plain, timer(plain, REPLAYS_PER_ROUND))
    return best_compiled, best_plain


def agreed_times(group: Any, compiled_s: float, plain_s: float) -> tuple[float, float]:
    """The slowest of each time over the ranks of ``group`` (every rank then makes the same choice, and
    abandons the compiled path at the same key: their captures stay in step); as given without one."""
    import torch.distributed as dist

    if (
        group is None
        or not dist.is_available()
        or not dist.is_initialized()
        or dist.get_world_size(group) < 2
    ):
        return compiled_s, plain_s
    answers: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(answers, (compiled_s, plain_s), group=group)
    return max(a[0] for a in answers), max(a[1] for a in answers)


class CompileChoice:
    """The choices of one capture: per key, and whether the compiled path is still tried."""

    def __init__(self, strategy: str, *, keep_compiled: bool) -> None:
        self.strategy = strategy
        self.keep_compiled = keep_compiled
        self.choices: dict[GraphKey, KeyChoice] = {}
        #: Why the compiled path was given up for the keys after the largest (``None``: it was not).
        self.abandoned: str | None = None

    @property
    def trying(self) -> bool:
        """Whether the next key captures (and compiles) the compiled forward at all."""
        return self.abandoned is None

    def decide(self, key: GraphKey, compiled_s: float, plain_s: float, extra_s: float) -> KeyChoice:
        """Record the timings of ``key`` and say which graph to keep."""
        ratio = compiled_s / plain_s if plain_s > 0 else 1.0
        if self.keep_compiled:
            choice = KeyChoice(key, Kept.COMPILED, "keep_compiled", compiled_s, plain_s, extra_s)
            if ratio > 1.0:
                logger.warning(
                    "devgraph: %s keeps the compiled graph of %s as asked (keep_compiled), though it is "
                    "%.2fx slower than the plain graph (%.3f ms against %.3f ms per replay)",
                    self.strategy,
                    key,
                    ratio,
                    compiled_s * 1e3,
                    plain_s * 1e3,
                )
        elif ratio <= 1.0:
            choice = KeyChoice(key, Kept.COMPILED, "faster", compiled_s, plain_s, extra_s)
        else:
            choice = KeyChoice(key, Kept.PLAIN, "slower", compiled_s, plain_s, extra_s)
            logger.info(
                "devgraph: %s: the compiled graph of %s is %.2fx slower than the plain forward's graph "
                "(%.3f ms against %.3f ms per replay); keeping the plain graph for it",
                self.strategy,
                key,
                ratio,
                compiled_s * 1e3,
                plain_s * 1e3,
            )
            if not self.choices and ratio >= ABANDON_RATIO:
                self.abandoned = (
                    f"the compiled graph of the largest key, {key}, was {ratio:.2f}x slower than the plain "
                    f"one (at least {ABANDON_RATIO:g}x gives the compiled path up)"
                )
                logger.warning(
                    "devgraph: %s: %s; the smaller keys capture the plain forward only",
                    self.strategy,
                    self.abandoned,
                )
        self.choices[key] = choice
        return choice

    def record(self, key: GraphKey, kept: Kept, why: str, extra_s: float = 0.0) -> KeyChoice:
        """A key served without a timed comparison: ``not_timed`` (the platform cannot time replays, the CPU
        simulator), ``plain_failed`` (the plain forward could not be captured) or ``abandoned``."""
        choice = KeyChoice(key, kept, why, extra_s=extra_s)
        self.choices[key] = choice
        return choice

    def forget(self, key: GraphKey) -> None:
        self.choices.pop(key, None)

    def to_keep(self) -> dict[str, dict[str, Any]]:
        """The choices worth keeping for a later process (``cache_dir``): those that timed both graphs, or
        gave the compiled path up, or came from an earlier process; per key name, the graph kept and the
        times. Not ``keep_compiled`` (the option decides again), ``not_timed`` or ``plain_failed``."""
        kept = {}
        for choice in self.choices.values():
            if choice.why in ("faster", "slower", "abandoned", "cached"):
                kept[str(choice.key)] = {
                    "kept": choice.kept.value,
                    "compiled_s": choice.compiled_s,
                    "plain_s": choice.plain_s,
                }
        return kept

    def earlier_kept(self, key: GraphKey, earlier: dict[str, dict[str, Any]]) -> Kept | None:
        """The graph an earlier process kept for ``key`` (``earlier``: :meth:`to_keep` as it loaded);
        ``None`` when there is none readable or ``keep_compiled`` decides."""
        entry = earlier.get(str(key))
        if self.keep_compiled or not isinstance(entry, dict):
            return None
        try:
            return Kept(entry.get("kept"))
        except ValueError:
            return None

    def cached(self, key: GraphKey, earlier: dict[str, dict[str, Any]]) -> KeyChoice | None:
        """The choice an earlier process made for ``key`` (see :meth:`earlier_kept`), recorded as this
        capture's; ``None`` when there is none or ``keep_compiled`` decides."""
        kept = self.earlier_kept(key, earlier)
        if kept is None:
            return None
        entry = earlier[str(key)]
        compiled_s, plain_s = (_seconds(entry.get(name)) for name in ("compiled_s", "plain_s"))
        choice = KeyChoice(key, kept, "cached", compiled_s, plain_s)
        self.choices[key] = choice
        return choice

    def reset(self) -> None:
        self.choices.clear()
        self.abandoned = None

    @property
    def any_compiled(self) -> bool:
        return any(c.kept is Kept.COMPILED for c in self.choices.values())

    def notes(self) -> list[str]:
        """Lines for the capture report: each key's two times and the choice, and what it cost."""
        ordered = sorted(self.choices.values(), key=lambda c: c.key.sort_key())
        if all(c.why == "not_timed" for c in ordered):
            return []  # nothing was compared (the CPU simulator): nothing differs from the plan
        compiled = sum(c.kept is Kept.COMPILED for c in ordered)
        seconds = sum(c.extra_s for c in ordered)
        lines = [
            f"{self.strategy}: compiled against plain graphs, per key: {compiled} of {len(ordered)} keys "
            f"keep the compiled graph; choosing took {seconds:.2f} s of capture"
        ]
        if self.abandoned:
            lines.append(f"{self.strategy}: compiled path abandoned: {self.abandoned}")
        lines += [f"{self.strategy}: {c.line()}" for c in ordered]
        return lines

    def summary(self) -> dict[str, Any]:
        """Which keys replay which graph, and both times per key (for the runner's ``stats()``)."""
        ordered = sorted(self.choices.values(), key=lambda c: c.key.sort_key())
        return {
            "compiled": [str(c.key) for c in ordered if c.kept is Kept.COMPILED],
            "plain": [str(c.key) for c in ordered if c.kept is Kept.PLAIN],
            "abandoned": self.abandoned is not None,
            "ms": {str(c.key): [c.describe()["compiled_ms"], c.describe()["plain_ms"]] for c in ordered},
        }

    def describe(self) -> dict[str, Any]:
        ordered = sorted(self.choices.values(), key=lambda c: c.key.sort_key())
        return {
            "keep_compiled": self.keep_compiled,
            "abandoned": self.abandoned,
            "keys": {str(c.key): c.describe() for c in ordered},
            "compiled_keys": sum(c.kept is Kept.COMPILED for c in ordered),
            "plain_keys": sum(c.kept is Kept.PLAIN for c in ordered),
            "choice_seconds": round(sum(c.extra_s for c in ordered), 4),
        }


def _seconds(value: Any) -> float | None:
    """A time read from the artifact file's header (not checksummed): a float, or ``None`` where it is
    none (another type, or an int too large for a float)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


class PlainOrCompiled:
    """The forward a choosing strategy hands the runner: the compiled forward, or the plain one while
    :meth:`plain` is entered (the strategy's second capture), once the compiled path was abandoned, or for
    the inputs of a key whose plain graph was kept (so that ``verify()`` compares a key's graph with the
    forward it captured)."""

    def __init__(self, plain: Callable[..., Any], compiled: Callable[..., Any]) -> None:
        self.plain_forward = plain
        self.compiled = compiled
        self.use_plain = False
        #: The shapes of the last call's tensor arguments (the key being captured, during a capture).
        self.last_signature: tuple[Any, ...] | None = None
        self._plain_keys: set[tuple[Any, ...]] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        signature = _signature(args, kwargs)
        self.last_signature = signature
        plain = self.use_plain or signature in self._plain_keys
        return (self.plain_forward if plain else self.compiled)(*args, **kwargs)

    def kept(self, signature: tuple[Any, ...] | None, kept: Kept) -> None:
        """The graph kept for the inputs of ``signature``: later calls with them run the same forward."""
        if signature is None:
            return
        if kept is Kept.PLAIN:
            self._plain_keys.add(signature)
        else:
            self._plain_keys.discard(signature)

    def forget(self) -> None:
        self._plain_keys.clear()
        self.use_plain = False

    @contextmanager
    def plain(self) -> Iterator[None]:
        before = self.use_plain
        self.use_plain = True
        try:
            yield
        finally:
            self.use_plain = before


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    def one(value: Any) -> Any:
        shape = getattr(value, "shape", None)
        return tuple(shape) if shape is not None else None

    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))
