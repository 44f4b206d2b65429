"""A runner's graphs over its life: assembled from the plan's backends, captured at start-up with the
address guard armed, captured again after the memory moved (``refresh()``), switched to tuned sizes while
serving (``retune()``), and the traffic recorded for ``devgraph tune``.

These are :class:`~devgraph.runner.graph_runner.GraphRunner` methods' bodies; the runner holds the lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.keys import REQUESTS, TOKENS, GraphKey
from devgraph.errors import ConfigError
from devgraph.flag.sizes import check_size_list
from devgraph.flag.trace import PhaseSteps
from devgraph.ranks import track_runner
from devgraph.runner.capture import pending
from devgraph.runner.capture.graphs import RunnerGraphs
from devgraph.runner.capture.loop import CaptureReport
from devgraph.runner.capture.pool import GraphPool
from devgraph.runner.capture.sets import GraphSets
from devgraph.runner.guard import AddressGuard, observe, reach
from devgraph.runner.schedule import KeySchedule
from devgraph.runner.stepping import Stepper

#: A :class:`~devgraph.runner.graph_runner.GraphRunner` (not imported: it imports this module).
GraphRunner = Any

__all__ = [
    "arm_guard",
    "assemble",
    "check_addresses",
    "describe_extras",
    "let_go",
    "recorded_steps",
    "release",
    "release_all",
    "restore",
    "retune",
    "start_up",
]

logger = logging.getLogger(__name__)


def assemble(
    runner: GraphRunner, backend: DeviceGraphBackend, second: DeviceGraphBackend | None, pool: Any
) -> None:
    """Bind the backends to ``runner`` and build its graph sets, its stepper and its pool."""
    if pool is not None and not isinstance(pool, GraphPool):
        raise ConfigError(f"pool= must be a devgraph.GraphPool, got {type(pool).__name__}")
    plan = runner.plan
    sets = []
    for owned in (backend, second) if second is not None else (backend,):
        owned.bind(runner)  # first: a backend another runner owns is refused before anything is compiled
        if owned.captured_keys():
            # Graphs of an earlier owner that was dropped without close(): they read its buffers, not ours.
            logger.info("devgraph: releasing graphs a previous runner left in its %s backend", owned.name)
            owned.cleanup()
        # Each set wraps the plain forward its own way (a compiling strategy compiles it).
        sets.append(RunnerGraphs(plan, owned, runner.forward, runner._buffers, runner._layout, runner._stats))
    runner._graphs = sets[0]
    runner._released = None  # what release() set aside for restore()
    runner._background = None  # keys a background capture has still to capture (capture/pending.py)
    runner._sets = GraphSets(*sets)
    steps = runner._steps = Stepper(
        plan,
        runner.forward,
        runner._sets,
        runner._buffers,
        runner._layout,
        runner._stats,
        lambda: runner._captured,
    )
    steps.owner = runner
    # A fallback's graphs share the primary's pool (one of the two replays at a time), as a GraphPool's do.
    runner.pool = pool if pool is not None else (GraphPool(name=plan.phase) if second is not None else None)
    if runner.pool is not None:
        runner.pool.attach(runner, runner._sets.backends, plan.platform, plan.device)
        steps.pool = runner.pool
    for group in {id(g): g for g in (plan.process_group, plan.dp_group) if g is not None}.values():
        track_runner(runner, group)  # devgraph.ranks.destroy_process_group() closes it first


def arm_guard(runner: GraphRunner) -> None:
    """Watch what the graphs will use: the tensors of the modules the forward reaches now, and those the
    first warm-up of the first key captured uses, observed (that warm-up runs the plain forward, so a
    compiling strategy compiles in the next one)."""
    plan, steps = runner.plan, runner._steps
    if not plan.address_guard or not runner.backend.uses_graphs:
        return
    guard = steps.guard = steps.guard or AddressGuard(plan.phase, plan.platform.device_type != "cpu")
    for graphs in runner._sets.all:  # each key's capture records the host values its forward reads
        graphs.wrap_context = guard.values.recording
    exclude = {b.untyped_storage().data_ptr() for b in runner._buffers.buffers.values()}
    guard.arm(reach(runner.forward), {}, exclude)  # the walk's result is not kept: it holds tensors
    primary = runner._sets.primary

    def observed_warmup(key: GraphKey, inputs: Mapping[str, Any]) -> bool:
        if primary.observe is not observed_warmup:  # once: a capture job keeps the hook for all its keys
            return False
        primary.observe = None
        try:
            found = observe(lambda: runner.forward(**inputs))
        except Exception as exc:  # run the warm-up plainly: a fault of the forward's own shows there
            logger.warning(
                "devgraph: %s: the address guard could not observe a warm-up (%s: %s); it watches the "
                "parameters and buffers of the modules the forward reaches only",
                plan.phase,
                type(exc).__name__,
                exc,
            )
            return False
        guard.arm(reach(runner.forward), found, exclude)
        return True

    primary.observe = observed_warmup


def start_up(runner: GraphRunner) -> CaptureReport:
    """Arm the address guard, then capture every key into every graph set (``capture()``); during a
    background capture, the keys it has not captured yet."""
    if runner._background is not None:
        pending.finish_now(runner)
        return runner.report or runner._graphs.empty_report()
    arm_guard(runner)
    pool = runner.pool
    try:
        with pool.capturing() if pool is not None else contextlib.nullcontext():
            return runner._sets.start_up()
    finally:
        if not runner.plan.capture.lazy:  # a lazy runner observes its first capture, whenever that comes
            runner._sets.primary.observe = None


def check_addresses(runner: GraphRunner) -> None:
    """The address guard's full check (every watched tensor), raising what it finds."""
    if runner._steps.guard is not None:
        runner._steps.guard.full_check()


def release_all(runner: GraphRunner) -> None:
    """Release every graph (``refresh()`` captures again after this); the layout learnt stays, the outputs
    it handed out per key go (the new graphs have outputs of their own)."""
    pending.abandon(runner)  # a background capture in progress stops; capture() takes every key again
    for graphs in runner._sets.all:
        for key in graphs.backend.captured_keys():
            runner._layout.forget(key)
    runner._sets.cleanup()
    runner._captured = False
    runner.report = None
    if runner._steps.guard is not None:
        runner._steps.guard.disarm()


@dataclasses.dataclass(frozen=True)
class Released:
    """What ``release()`` set aside: the keys that held graphs (``restore()`` captures them again), whether
    the runner had captured, and the bytes the capture reports attributed to those graphs."""

    keys: tuple[GraphKey, ...]
    captured: bool
    graph_bytes: int


def release(runner: GraphRunner) -> Released:
    """Free every graph and its pool's memory (``release()``); steps run eagerly as ``released`` until
    :func:`restore`. The compiled forward (a compiling strategy's) stays, so restoring compiles nothing."""
    plan = runner.plan
    if runner._background is not None:
        raise ConfigError(
            f"the {plan.phase} runner is capturing its keys in the background; release() after it is done "
            "(BackgroundCapture.finish() captures the rest now, BackgroundCapture.stop() then "
            "refresh()/close() abandons them)"
        )
    if runner._released is not None:
        return runner._released  # already released: nothing more to free
    keys = tuple(sorted(runner._graphs.backend.captured_keys(), key=GraphKey.sort_key))
    held = sum(r.bytes for r in runner._graphs.reports.values())
    released = Released(keys, runner._captured, held)
    release_all(runner)  # every set's backend.cleanup(): graphs, the backend's pool, then empty_cache
    plan.platform.empty_cache()  # a fallback set's or a shared pool's blocks too, now unused
    runner._released = released
    runner._steps.released = True
    logger.info("devgraph: %s: released %d graph(s), %.1f MiB", plan.phase, len(keys), held / 2**20)
    return released


def restore(runner: GraphRunner) -> CaptureReport:
    """Capture again what :func:`release` freed, on the forward already wrapped (compiled) before."""
    released: Released | None = runner._released
    if released is None:
        return runner.report or runner._graphs.empty_report()
    runner._released = None
    runner._steps.released = False
    if not released.captured:
        return runner._graphs.empty_report()  # released before capture(): as it was then
    if not runner.plan.capture.lazy:
        runner.report = start_up(runner)
        runner._captured = True
        return runner.report
    # A lazily capturing runner: the keys it held when released, now, into graph pools of their own.
    arm_guard(runner)
    graphs = runner._graphs
    report = graphs.empty_report()
    if released.keys:
        runner.backend.prepare(runner.plan.inputs, ())
        start = time.perf_counter()
        with runner.pool.capturing() if runner.pool is not None else contextlib.nullcontext():
            report.keys = runner._sets.capture_now(released.keys)
        report.seconds = time.perf_counter() - start
        runner._sets.adopt_captured()
    runner._sets.primary.observe = None
    runner.report = report
    runner._captured = True
    return report


def retune(runner: GraphRunner, sizes: Sequence[int], *, lazy: bool) -> list[GraphKey]:
    """New token sizes while serving (``retune()``): keep the graphs of keys that stay, release the others,
    capture new keys on first sight (``lazy``) or now."""
    plan = runner.plan
    if runner._background is not None:
        raise ConfigError(
            f"the {plan.phase} runner is capturing its keys in the background; retune() after it is done "
            "(BackgroundCapture.finish() captures the rest now)"
        )
    chosen = sorted(set(check_size_list(plan.phase, list(sizes), f"{plan.phase} retune sizes")))
    old = plan.schedule
    tpr = old.tokens_per_request
    if tpr is not None and any(s % tpr for s in chosen):
        raise ConfigError(
            f"{plan.phase} sizes must be multiples of its {tpr} tokens per request; got {chosen}"
        )
    if chosen[-1] > old.max_tokens:
        raise ConfigError(
            f"retune() cannot grow past the largest size the runner was built for ({old.max_tokens}): "
            "its static "
            f"buffers hold that many rows; got {chosen[-1]}. Build a new runner (or pass max_size=) for more"
        )
    # Other axes keep the buckets they had (requests follow from tokens in uniform phases).
    axes = {
        axis: (lambda t, axis=axis: _kept_buckets(old, axis, t))
        for axis in old.axis_names
        if tpr is None or axis != REQUESTS
    }
    schedule = KeySchedule(plan.phase, chosen, old.axis_names, axes or None, tpr, old.variants)
    sets = runner._sets
    new_keys = set(schedule.keys())
    for key in [k for g in sets.all for k in g.backend.captured_keys() if k not in new_keys]:
        sets.release(key)
    # Lazily captured while serving; before capture() the new keys are captured at start-up as usual.
    online = lazy and runner._captured and sets.fallback is None
    capture = dataclasses.replace(plan.capture, lazy=plan.capture.lazy or online)
    runner.plan = dataclasses.replace(plan, schedule=schedule, capture=capture)
    runner._steps.set_plan(runner.plan)
    if runner._captured:
        missing = sorted(
            (k for k in new_keys if not sets.primary.backend.has_shape(k)),
            key=GraphKey.sort_key,
            reverse=True,
        )
        if missing and not capture.lazy:
            sets.capture_now(missing)
        if capture.lazy:
            sets.adopt_captured()
    return sorted(new_keys.difference(old.keys()), key=GraphKey.sort_key)


def _kept_buckets(old: KeySchedule, axis: str, tokens: int) -> Sequence[int]:
    """An axis's buckets at a retuned token size: those the old schedule had at the next size up."""
    above = [t for t in old.token_sizes if t >= tokens] or [old.max_tokens]
    return sorted({min(b, tokens) for b in old.buckets[above[0]][axis]})


def recorded_steps(runner: GraphRunner) -> PhaseSteps:
    """The runner's recorded steps with its schedule and the bytes each captured token size took."""
    plan = runner.plan
    histogram = runner._stats.recorded
    if histogram is None:
        raise ConfigError(
            f"the {plan.phase} runner is not recording steps; build it with record_steps=True or call "
            "record_steps(True) before the traffic to tune for"
        )
    schedule = plan.schedule
    sizes = {TOKENS: list(schedule.token_sizes)}
    for axis in schedule.axis_names:
        if schedule.tokens_per_request is None:
            sizes[axis] = sorted({b for t in schedule.token_sizes for b in schedule.buckets[t][axis]})
    graph_bytes: dict[int, int] = {}
    for key, report in runner._graphs.reports.items():
        graph_bytes[key.tokens] = graph_bytes.get(key.tokens, 0) + report.bytes
    return PhaseSteps(plan.phase, (TOKENS, *schedule.axis_names), Counter(histogram), sizes, graph_bytes)


def let_go(runner: GraphRunner) -> None:
    """``close()``'s end, after the graphs were released: unbind the backends, leave the pool, stop
    watching memory."""
    pending.stop(runner)
    for backend in runner._sets.backends:
        backend.unbind(runner)
    for graphs in runner._sets.all:
        graphs.clear()
    if runner.pool is not None:
        runner.pool.detach(runner)
    if runner._steps.guard is not None:
        runner._steps.guard.disarm()


def describe_extras(runner: GraphRunner) -> dict[str, Any]:
    """What ``inspect()`` adds for this module's parts: the fallback set, the pool, the address guard."""
    guard = runner._steps.guard
    return {
        **runner._sets.describe(),
        "pool": runner.pool.describe() if runner.pool is not None else None,
        "address_guard": guard.describe() if guard is not None else None,
        "data_parallel": runner.plan.dp_group is not None,
        "background": runner._background.describe() if runner._background is not None else None,
    }
