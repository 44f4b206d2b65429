"""A runner's graph life, in one owner: its graph sets, pool, address guard, the keys a background capture
has left and what ``release()`` set aside, with one :class:`LifeState` and the transitions as methods.

::

    fresh ──capture()──────────────► captured ──release()──► released
      │ ▲                              ▲  ▲                     │
      │ └─(a key failed: abandoned)─┐  │  └──────restore()──────┘ (released before capture: back to fresh)
      └──BackgroundCapture─► capturing ┘ (the last key, or capture())
    any state ──close()──► closed;  refresh(): every graph released, then capture() from fresh

Every call works from every state or is refused with a :class:`~devgraph.errors.ConfigError` that leaves
the runner as it was: ``capture()`` of a released runner restores it; ``refresh()`` of one captures it
afresh; a background capture of one captures its keys again key by key; ``release()`` and ``retune()``
during a background capture are refused (finish or stop it first); ``estimate_graph_memory()`` is asked
before the first capture. The :class:`~devgraph.runner.stepping.Stepper` reads :attr:`GraphLife.state`
(as the dispatcher's :class:`~devgraph.runner.dispatch.Readiness`) and mirrors nothing.

Each transition takes the runner's lock (reentrant: the runner may hold it already), so a capture never
overlaps a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.keys import REQUESTS, GraphKey
from devgraph.contract.modes import Word
from devgraph.errors import ConfigError
from devgraph.flag.sizes import check_size_list
from devgraph.ranks import rank_of, release_backend
from devgraph.runner import memory
from devgraph.runner.capture.graph_set import GraphSet
from devgraph.runner.capture.job import CaptureReport
from devgraph.runner.capture.pending import PendingKeys
from devgraph.runner.capture.sets import GraphSets
from devgraph.runner.dispatch import Dispatcher, EagerReason, Readiness
from devgraph.runner.guard import AddressGuard, observe, reach
from devgraph.runner.options import RunnerPlan
from devgraph.runner.outputs.layout import OutputLayout
from devgraph.runner.schedule import KeySchedule
from devgraph.runner.shared_pool import GraphPool, PoolMember
from devgraph.runner.staging import StaticBuffers
from devgraph.runner.stats import RunnerStats

__all__ = ["GraphLife", "LifeState", "Released"]

logger = logging.getLogger(__name__)


class LifeState(Word):
    """Where a runner's graphs are in their life."""

    FRESH = "fresh"  # nothing captured: before capture(), after a failed or abandoned one
    CAPTURING = "capturing"  # a background capture has keys left; their steps run eagerly meanwhile
    CAPTURED = "captured"  # capture() done (a lazily capturing runner: each key on first sight)
    RELEASED = "released"  # release() gave the graphs' memory back; restore() captures them again
    CLOSED = "closed"  # close(): nothing more


@dataclasses.dataclass(frozen=True)
class Released:
    """What ``release()`` set aside: the keys that held graphs (``restore()`` captures them again), whether
    the runner had captured, and the bytes the capture reports attributed to those graphs (every set)."""

    keys: tuple[GraphKey, ...]
    captured: bool
    graph_bytes: int


class GraphLife:
    """One runner's graphs over its life (see the module docstring)."""

    def __init__(
        self,
        plan: RunnerPlan,
        forward: Callable[..., Any],
        parts: tuple[StaticBuffers, OutputLayout, RunnerStats],
        backends: Sequence[DeviceGraphBackend],
        pool: GraphPool | None,
        owner: PoolMember,
        lock: AbstractContextManager[Any],
    ) -> None:
        if pool is not None and not isinstance(pool, GraphPool):
            raise ConfigError(f"pool= must be a devgraph.GraphPool, got {type(pool).__name__}")
        buffers, layout, stats = parts
        self.plan = plan
        self.forward = forward
        self.owner = owner
        self.lock = lock
        self._buffers, self._layout, self._stats = buffers, layout, stats
        sets = []
        for backend in backends:
            backend.bind(owner)  # first: a backend another runner owns is refused before anything compiles
            if backend.captured_keys():
                # Graphs of an earlier owner dropped without close(): they read its buffers, not ours.
                logger.info(
                    "devgraph: releasing graphs a previous runner left in its %s backend", backend.name
                )
                backend.cleanup()
            # Each set wraps the plain forward its own way (a compiling strategy compiles it).
            sets.append(GraphSet(plan, backend, forward, buffers, layout, stats))
        self.sets = GraphSets(*sets)
        # A fallback's graphs share the primary's pool (one of the two replays at a time), as a GraphPool's.
        self.pool = pool if pool is not None else (GraphPool(name=plan.phase) if len(sets) > 1 else None)
        if self.pool is not None:
            self.pool.attach(owner, self.sets.backends, plan.platform, plan.device)
        #: Routes a step to a key of the current schedule (``retune()`` replaces it with the schedule).
        self.router = Dispatcher(plan.schedule)
        self.guard: AddressGuard | None = None
        self._uses_graphs = self.sets.primary.backend.uses_graphs
        self._enter(LifeState.FRESH)
        self.report: CaptureReport | None = None
        self.pending: PendingKeys | None = None  # while capturing
        self.released: Released | None = None  # while released

    # -- what the stepper reads ---------------------------------------------------------------------
    @property
    def state(self) -> LifeState:
        """Where the graphs are now (only the transitions below change it)."""
        return self._state

    def _enter(self, state: LifeState) -> None:
        self._state = state
        #: The state as the dispatcher reads it (set with the state: a step reads it, never computes it).
        self.readiness: Readiness = _READINESS[state] if self._uses_graphs else _DISABLED

    def check_open(self) -> None:
        if self.state is LifeState.CLOSED:
            raise ConfigError(f"this {self.plan.phase} runner was closed; build a new GraphRunner")

    def current_report(self) -> CaptureReport:
        """The last capture's report (an empty one before any)."""
        return self.report or self.sets.primary.empty_report()

    # -- capture ------------------------------------------------------------------------------------
    def capture(self) -> CaptureReport:
        """Every key, largest first (``capture()``): from fresh; a background capture's keys left, now; a
        released runner's keys again. Captured already: the report. A failure leaves the runner fresh."""
        with self.lock:
            self.check_open()
            if self.state is LifeState.CAPTURING:
                while self.capture_next():
                    pass
            elif self.state is LifeState.RELEASED:
                self.restore()  # released before capture(): fresh now, captured below
            if self.state is LifeState.FRESH:
                self.report = self._start_up()
                self._enter(LifeState.CAPTURED)
            return self.current_report()

    def refresh(self) -> CaptureReport:
        """Release every graph (a background capture stops, a release's record goes) and capture again on
        the tensors the forward reaches now."""
        with self.lock:
            self.check_open()
            self._release_all()
            self.released = None
            self._enter(LifeState.FRESH)
            return self.capture()

    def _start_up(self) -> CaptureReport:
        """Arm the address guard, then capture every key into every graph set."""
        self._arm_guard()
        primary = self.sets.primary
        try:
            with self._pool_capturing():
                return self.sets.start_up()
        except BaseException:
            self._disarm()
            raise
        finally:
            if not self.plan.capture.lazy:  # a lazy runner observes its first capture, whenever that comes
                primary.observe = None

    # -- release and restore ------------------------------------------------------------------------
    def release(self) -> Released:
        """Free every graph and the pool's memory; steps run eagerly as ``released`` until :meth:`restore`.
        The compiled forward (a compiling strategy's) stays, so restoring compiles nothing."""
        with self.lock:
            self._check_settled(
                "release()", ", BackgroundCapture.stop() then refresh()/close() abandons them"
            )
            plan = self.plan
            if self.released is not None:
                return self.released  # already released: nothing more to free
            held = sum(r.bytes for graphs in self.sets.all for r in graphs.reports.values())
            keys = tuple(self.sets.captured_keys())
            released = Released(keys, self.state is LifeState.CAPTURED, held)
            self._release_all()  # every set's backend.cleanup(): graphs, the backend's pool, then empty_cache
            plan.platform.empty_cache()  # a fallback set's or a shared pool's blocks too, now unused
            self.released = released
            self._enter(LifeState.RELEASED)
            logger.info("devgraph: %s: released %d graph(s), %.1f MiB", plan.phase, len(keys), held / 2**20)
            return released

    def restore(self) -> CaptureReport:
        """Capture again what :meth:`release` freed; a no-op when not released. A failure leaves the runner
        released (steps run eagerly as ``released``), so ``restore()`` may be tried again."""
        with self.lock:
            self.check_open()
            released = self.released
            if self.state is not LifeState.RELEASED or released is None:
                return self.current_report()
            if not released.captured:  # released before capture(): as it was then
                self._settle(LifeState.FRESH, None)
                return self.sets.primary.empty_report()
            report = self._start_up() if not self.plan.capture.lazy else self._restore_lazy(released)
            self._settle(LifeState.CAPTURED, report)
            return report

    def _restore_lazy(self, released: Released) -> CaptureReport:
        """A lazily capturing runner: the keys it held when released (those still scheduled), now."""
        self._arm_guard()
        sets = self.sets
        scheduled = set(self.plan.schedule.keys())
        keys = sorted((k for k in released.keys if k in scheduled), key=GraphKey.sort_key, reverse=True)
        report = sets.primary.empty_report()
        try:
            if keys:
                sets.primary.backend.prepare(self.plan.inputs, ())
                with self._pool_capturing():
                    report = sets.capture(keys)
                sets.adopt_captured()
        finally:
            sets.primary.observe = None
        return report

    def _settle(self, state: LifeState, report: CaptureReport | None) -> None:
        self.released = None
        self._enter(state)
        self.report = report

    # -- capture in the background ------------------------------------------------------------------
    def begin_background(self) -> PendingKeys | None:
        """Arm key-by-key capture (:class:`~devgraph.runner.background.BackgroundCapture`); returns the
        pending keys, or ``None`` when there is nothing to capture in the background (captured or capturing
        already; eager or lazy: captured now, which captures nothing)."""
        with self.lock:
            self.check_open()
            plan, sets = self.plan, self.sets
            if self.state in (LifeState.CAPTURED, LifeState.CAPTURING):
                return None
            if sets.fallback is not None:
                raise ConfigError(
                    f"the {plan.phase} runner has a fallback graph set ({sets.fallback.backend.name}); "
                    "capture in the background takes runners without one: drop the fallback or call capture()"
                )
            if not sets.primary.backend.uses_graphs or plan.capture.lazy:
                self.capture()
                return None
            keys = plan.schedule.keys()  # largest first
            self._arm_guard()
            sets.primary.backend.prepare(plan.inputs, keys)
            self.released = None  # a released runner captures its keys again, key by key
            self.pending = PendingKeys(list(keys), len(keys))
            self._enter(LifeState.CAPTURING)
            return self.pending

    def capture_next(self) -> bool:
        """Capture the next pending key; returns whether it captured one (``False``: nothing pending).

        On a failure every graph of the runner is released, it is left fresh (its steps run eagerly,
        ``before_capture``), and the :class:`~devgraph.errors.CaptureError` is raised."""
        with self.lock:
            pending = self.pending
            if self.state is not LifeState.CAPTURING or pending is None:
                return False
            key = pending.keys[0]
            primary = self.sets.primary
            start = time.perf_counter()
            try:
                with self._pool_capturing():
                    reports = primary.capture([key], collect=not pending.reports, quiet=True)
            except BaseException:
                self.abandon()
                raise
            finally:
                primary.observe = None  # the guard observes the first key's warm-up only (as at start-up)
            pending.seconds += time.perf_counter() - start
            pending.keys.pop(0)
            pending.reports += reports
            if self._rank0():
                logger.info(
                    "captured %s graph %d/%d (%s, %s) in the background in %.2f s",
                    self.plan.phase,
                    len(pending.reports),
                    pending.total,
                    key,
                    primary.backend.name,
                    time.perf_counter() - start,
                )
            if not pending.keys:
                self._complete(pending)
            return True

    def _complete(self, pending: PendingKeys) -> None:
        primary = self.sets.primary
        report = primary.empty_report()
        report.keys = sorted(pending.reports, key=lambda r: r.key.sort_key())
        report.seconds = pending.seconds
        report.notes = [*primary.notes, *primary.backend.capture_notes()]
        self.pending = None
        self._settle(LifeState.CAPTURED, report)
        if self._rank0():
            logger.info("%s", report.table())
            logger.info(
                "all %d %s graphs captured in the background: %.2f s capturing, %.2f s since it began; %d "
                "step(s) ran eagerly meanwhile",
                pending.total,
                self.plan.phase,
                pending.seconds,
                time.perf_counter() - pending.started,
                self._stats.eager.get(EagerReason.CAPTURING, 0),
            )

    def abandon(self) -> None:
        """Stop a background capture: release every graph captured so far; the runner is fresh again."""
        with self.lock:
            if self.state is LifeState.CAPTURING:
                self._release_all()
                self._enter(LifeState.FRESH)

    # -- while serving ------------------------------------------------------------------------------
    def retune(self, sizes: Sequence[int], *, lazy: bool) -> list[GraphKey]:
        """Other token sizes while serving: keep the graphs of keys that stay, release the others, capture
        new keys on first sight (``lazy``) or now, into every graph set (a key the primary cannot capture
        is left to the fallback, as at start-up; without a fallback its error is raised, and the graphs of
        the other keys keep serving)."""
        with self.lock:
            self._check_settled("retune()")
            plan = self.plan
            old = plan.schedule
            schedule = _retuned(old, plan.phase, sizes)
            sets = self.sets
            new_keys = set(schedule.keys())
            for key in [k for g in sets.all for k in g.backend.captured_keys() if k not in new_keys]:
                sets.release(key)
            captured = self.state is LifeState.CAPTURED
            # Lazily captured while serving; before capture() the new keys are captured at start-up as usual.
            online = lazy and captured and sets.fallback is None
            capture = dataclasses.replace(plan.capture, lazy=plan.capture.lazy or online)
            self.plan = dataclasses.replace(plan, schedule=schedule, capture=capture)
            sets.set_plan(self.plan)
            self.router = Dispatcher(schedule)
            if captured and not capture.lazy:
                with self._pool_capturing():
                    sets.capture(schedule.keys())
            if captured and capture.lazy:
                sets.adopt_captured()
            return sorted(new_keys.difference(old.keys()), key=GraphKey.sort_key)

    def estimate(self, probes: int | None) -> memory.GraphMemoryEstimate:
        """Before the first capture: every set's graph bytes, measured into a throw-away pool, released."""
        with self.lock:
            self.check_open()
            if self.state is not LifeState.FRESH:
                raise ConfigError(
                    f"the {self.plan.phase} runner is {self.state}; estimate graph memory before capture() "
                    "(and before a background capture), or read the exact bytes with graph_memory()"
                )
            try:
                with self._pool_capturing():
                    return memory.estimate(self.sets, probes)
            finally:
                self._release_all()  # the probes' graphs and pool, then the cache back to the device
                self.plan.platform.empty_cache()

    def graph_memory(self) -> memory.GraphMemory:
        return memory.graph_memory(self.sets)

    def check_addresses(self) -> None:
        """The address guard's full check (every watched tensor), raising what it finds."""
        with self.lock:
            if self.guard is not None:
                self.guard.full_check()

    # -- teardown -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Release graphs and pool (unless the process group is gone: see ``release_backend``), unbind
        the backends, leave the pool, stop watching memory. Closing twice is a no-op."""
        with self.lock:
            if self.state is LifeState.CLOSED:
                return
            plan = self.plan
            try:
                for backend in self.sets.backends:
                    release_backend(backend, plan.process_group, plan.platform)
            finally:
                if self.pending is not None:
                    self.pending.abandoned = True
                for backend in self.sets.backends:
                    backend.unbind(self.owner)
                for graphs in self.sets.all:
                    graphs.clear()
                if self.pool is not None:
                    self.pool.detach(self.owner)
                self._disarm()
                self.pending = self.released = self.report = None
                self._enter(LifeState.CLOSED)

    # -- inspection ---------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What ``inspect()`` adds for the life's parts: the state, the fallback set, the pool, the guard."""
        guard, pending = self.guard, self.pending
        return {
            "life": str(self.state),
            **self.sets.describe(),
            "pool": self.pool.describe() if self.pool is not None else None,
            "address_guard": guard.describe() if guard is not None else None,
            "data_parallel": self.plan.dp_group is not None,
            "background": pending.describe() if pending is not None else None,
        }

    # -- helpers ------------------------------------------------------------------------------------
    def _check_settled(self, call: str, more: str = "") -> None:
        """Refuse ``call`` on a closed runner, or while a background capture has keys left."""
        self.check_open()
        if self.state is LifeState.CAPTURING:
            raise ConfigError(
                f"the {self.plan.phase} runner is capturing its keys in the background; {call} after it is "
                f"done (BackgroundCapture.finish() captures the rest now{more})"
            )

    def _release_all(self) -> None:
        """Release every graph of every set; a background capture in progress stops. The layout learnt
        stays; the outputs it handed out per key go (new graphs have outputs of their own)."""
        for graphs in self.sets.all:
            for key in graphs.backend.captured_keys():
                self._layout.forget(key)
        self.sets.cleanup()
        self._disarm()
        self.report = None
        if self.pending is not None:
            self.pending.abandoned = True
            self.pending = None

    def _arm_guard(self) -> None:
        """Watch what the graphs will use: the tensors of the modules the forward reaches now, and those the
        first warm-up of the first key captured uses, observed (that warm-up runs the plain forward, so a
        compiling strategy compiles in the next one)."""
        plan, forward = self.plan, self.forward
        primary = self.sets.primary
        if not plan.safety.address_guard or not primary.backend.uses_graphs:
            return
        guard = self.guard = self.guard or AddressGuard(plan.phase, plan.platform.device_type != "cpu")
        for graphs in self.sets.all:  # each key's capture records the host values its forward reads
            graphs.wrap_context = guard.values.recording
        exclude = {b.untyped_storage().data_ptr() for b in self._buffers.buffers.values()}
        guard.arm(reach(forward), {}, exclude)  # the walk's result is not kept: it holds tensors

        def observed_warmup(key: GraphKey, inputs: Any) -> bool:
            if primary.observe is not observed_warmup:  # once: a capture job keeps the hook for all its keys
                return False
            primary.observe = None
            try:
                found = observe(lambda: forward(**inputs))
            except Exception as exc:  # run the warm-up plainly: a fault of the forward's own shows there
                logger.warning(
                    "devgraph: %s: the address guard could not observe a warm-up (%s: %s); it watches the "
                    "parameters and buffers of the modules the forward reaches only",
                    plan.phase,
                    type(exc).__name__,
                    exc,
                )
                return False
            guard.arm(reach(forward), found, exclude)
            return True

        primary.observe = observed_warmup

    def _disarm(self) -> None:
        if self.guard is not None:
            self.guard.disarm()

    def _pool_capturing(self) -> AbstractContextManager[None]:
        return self.pool.capturing() if self.pool is not None else contextlib.nullcontext()

    def _rank0(self) -> bool:
        return rank_of(self.plan.process_group) == 0


_DISABLED = Readiness(EagerReason.DISABLED)
_READINESS: dict[LifeState, Readiness] = {
    LifeState.FRESH: Readiness(EagerReason.BEFORE_CAPTURE),
    LifeState.CAPTURING: Readiness(None, EagerReason.CAPTURING),
    LifeState.CAPTURED: Readiness(None, EagerReason.NOT_CAPTURED),
    LifeState.RELEASED: Readiness(EagerReason.RELEASED),
    LifeState.CLOSED: Readiness(EagerReason.BEFORE_CAPTURE),
}


def _retuned(old: KeySchedule, phase: str, sizes: Sequence[int]) -> KeySchedule:
    """The schedule of ``retune(sizes)``: checked token sizes within the static buffers, other axes keeping
    the buckets they had (requests follow from tokens in uniform phases)."""
    chosen = sorted(set(check_size_list(phase, list(sizes), f"{phase} retune sizes")))
    tpr = old.tokens_per_request
    if tpr is not None and any(s % tpr for s in chosen):
        raise ConfigError(f"{phase} sizes must be multiples of its {tpr} tokens per request; got {chosen}")
    if chosen[-1] > old.max_tokens:
        raise ConfigError(
            f"retune() cannot grow past the largest size the runner was built for ({old.max_tokens}): its "
            f"static buffers hold that many rows; got {chosen[-1]}. Build a new runner (or pass max_size=) "
            "for more"
        )
    axes = {
        axis: (lambda t, axis=axis: _kept_buckets(old, axis, t))
        for axis in old.axis_names
        if tpr is None or axis != REQUESTS
    }
    return KeySchedule(phase, chosen, old.axis_names, axes or None, tpr, old.variants)


def _kept_buckets(old: KeySchedule, axis: str, tokens: int) -> Sequence[int]:
    """An axis's buckets at a retuned token size: those the old schedule had at the next size up."""
    above = [t for t in old.token_sizes if t >= tokens] or [old.max_tokens]
    return sorted({min(b, tokens) for b in old.buckets[above[0]][axis]})
