"""``GraphRunner``: capture a phase's forward at start-up (or on first sight), replay it on every step.

The runner is the front door: it resolves its options once into a :class:`~devgraph.runner.options.RunnerPlan`
(:mod:`~devgraph.runner.options`), holds the lock, validates each step (:mod:`~devgraph.runner.staging`)
and delegates: its graphs over their life (capture, release, restore, retune, close) to its
:class:`~devgraph.runner.life.GraphLife`, one step (decide, replay, cut the outputs back) to its
:class:`~devgraph.runner.stepping.Stepper`; :mod:`~devgraph.runner.stats` counts.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.inputs import StaticInput
from devgraph.contract.keys import REQUESTS, TOKENS, GraphKey
from devgraph.contract.platform import GraphPlatform
from devgraph.errors import InputError
from devgraph.flag.config import DeviceGraphConfig
from devgraph.flag.factory import ResolvedPhase
from devgraph.flag.trace import PhaseSteps
from devgraph.ranks import track_runner
from devgraph.runner.capture.job import CaptureReport
from devgraph.runner.handle import HostCopy, StepHandle, copy_to_host
from devgraph.runner.inspection import describe_runner
from devgraph.runner.life import GraphLife, LifeState, Released
from devgraph.runner.memory import GraphMemory, GraphMemoryEstimate
from devgraph.runner.options import RunnerOptions, RunnerPlan, plan_runner
from devgraph.runner.outputs.layout import OutputLayout
from devgraph.runner.outputs.trees import copy_into_out, copy_tree
from devgraph.runner.schedule import KeySchedule
from devgraph.runner.shared_pool import GraphPool
from devgraph.runner.staging import StaticBuffers, StepValidator
from devgraph.runner.stats import RunnerStats
from devgraph.runner.stepping import Agreement, Stepper
from devgraph.runner.verify import VerifyResult

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["GraphRunner"]


class GraphRunner:
    """Captures ``forward`` for a phase at a set of keys and replays it, padding each step up to a key.

    ``forward(**inputs, **variant)`` takes one tensor per declared :class:`StaticInput` (rows follow the
    input's axis: the step's token count, or its request count, ...) and returns any pytree of tensors;
    model state (weights, KV cache) is reached through the closure. Every other keyword is one of
    :class:`~devgraph.runner.options.RunnerOptions` (choose the backend with ``mode``, a strategy name, or
    ``config``, a parsed ``--device-graph-mode``); they are resolved once into :attr:`plan`: those the flag
    also has are checked as its values are, and the flag wins where both set one. See docs/user-guide.md.

    Thread safety: ``run``, ``submit``, ``verify``, ``capture`` and ``close`` hold one lock, so steps from
    several threads never interleave. What ``run`` returns is valid until the next ``run`` from any thread:
    threads sharing a runner pass ``copy=True`` (or ``out=``). ``single_thread=True`` drops the lock for an
    engine that calls the runner from one thread only.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        *,
        phase: str,
        inputs: Mapping[str, StaticInput],
        **options: Unpack[RunnerOptions],
    ) -> None:
        plan, backend, fallback = plan_runner(forward, phase, inputs, options)
        self.forward = forward
        #: The strategy capturing and replaying the phase's graphs (the primary graph set's backend).
        self.backend: DeviceGraphBackend = backend
        self._validator = StepValidator(plan)
        buffers = StaticBuffers(plan.inputs, plan.schedule.max_rows(), plan.device)
        # Decode's request count is its token count: an output following either is cut the same way.
        linked = frozenset({REQUESTS}) if plan.tokens_per_request == 1 else frozenset()
        self._layout = OutputLayout(plan.output_axes, same_as_tokens=linked)
        self._stats = RunnerStats(recorded=Counter() if options.get("record_steps") else None)
        self._buffers = buffers
        self._lock: contextlib.AbstractContextManager[Any] = (
            contextlib.nullcontext() if plan.safety.single_thread else threading.RLock()
        )
        parts = (buffers, self._layout, self._stats)
        backends = (backend,) if fallback is None else (backend, fallback)
        #: The runner's graphs over their life: state, graph sets, pool, guard (docs/architecture.md).
        self.life = GraphLife(plan, forward, parts, backends, options.get("pool"), self, self._lock)
        self._steps = Stepper(self.life, forward, parts, plan.distributed.check_lockstep)
        for group in plan.distributed.groups:
            track_runner(self, group)  # devgraph.ranks.destroy_process_group() closes it first

    # -- what the plan resolved (read-only) --------------------------------------------------------
    @property
    def plan(self) -> RunnerPlan:
        """Every setting resolved once (``retune()`` replaces it with one of another schedule)."""
        return self.life.plan

    @property
    def phase(self) -> str:
        return self.life.plan.phase

    @property
    def platform(self) -> GraphPlatform:
        return self.life.plan.platform

    @property
    def device(self) -> torch.device:
        return self.life.plan.device

    @property
    def input_specs(self) -> Mapping[str, StaticInput]:
        return self.life.plan.inputs

    @property
    def schedule(self) -> KeySchedule:
        return self.life.plan.schedule

    @property
    def sizes(self) -> tuple[int, ...]:
        """The token sizes this runner captures."""
        return self.schedule.token_sizes

    @property
    def tokens_per_request(self) -> int | None:
        return self.life.plan.tokens_per_request

    @property
    def warmup_iters(self) -> int:
        return self.life.plan.capture.warmup_iters

    @property
    def lazy(self) -> bool:
        return self.life.plan.capture.lazy

    @property
    def config(self) -> DeviceGraphConfig:
        """``--device-graph-mode`` as given (the phase's settings are :attr:`resolved`)."""
        return self.life.plan.flag

    @property
    def resolved(self) -> ResolvedPhase:
        return self.life.plan.resolved

    # -- what the life holds (read-only) -----------------------------------------------------------
    @property
    def pool(self) -> GraphPool | None:
        """The graph pool the runner captures into (``pool=``, or its own with a fallback set)."""
        return self.life.pool

    @property
    def report(self) -> CaptureReport | None:
        """The last capture's report (``None`` before one, and after a release)."""
        return self.life.report

    @property
    def released(self) -> bool:
        """Whether :meth:`release` freed the graphs and :meth:`restore` has not captured them again."""
        return self.life.released is not None

    @property
    def keys(self) -> list[GraphKey]:
        """The keys holding a graph now."""
        return self.life.sets.captured_keys()

    @property
    def static_inputs(self) -> Mapping[str, torch.Tensor]:
        """The full static buffers (as many rows as the largest key's axis)."""
        return self._buffers.buffers

    def static_rows(self, name: str, rows: int) -> torch.Tensor | None:
        """The first ``rows`` rows of input ``name``'s static buffer, where :meth:`run` would copy a step's
        ``name`` of ``rows`` rows; ``None`` where there is no such buffer (no input ``name``, more rows than
        it holds) or a capture could still come between the write and the step and reset the buffers
        (graphs not captured yet or being captured in the background, released, captured lazily on first
        sight of a key, a closed runner): then pass the input as usual.

        An engine that produces an input on the device can write it here (``torch.index_select(...,
        out=rows)``) and pass this tensor to :meth:`run`, which then copies nothing for it: one device op
        fewer a step. The write must come after the previous step is issued and before this step's
        :meth:`run`, from the thread that runs the steps (or under the engine's own lock from the write to
        the run): another step in between would overwrite it. A forward that changes its inputs in place
        changes this tensor, which is the buffer itself."""
        with self._lock:
            if self.life.state is not LifeState.CAPTURED or self.life.plan.capture.lazy:
                return None
            return self._buffers.rows_of(name, rows)

    @property
    def check_lockstep(self) -> bool:
        """Check each step that every rank replays the same key (an all-gather); may flip between steps."""
        return self._steps.check_lockstep

    @check_lockstep.setter
    def check_lockstep(self, on: bool) -> None:
        self._steps.check_lockstep = on

    def bucket(self, n: int) -> int | None:
        """The token size a step of ``n`` tokens would replay now (``None``: it would run eagerly)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return None
        counts = {TOKENS: n, **{a: 1 for a in self.schedule.axis_names}}
        variant = {name: values[0] for name, values in self.schedule.variants.items()}
        key = self._steps.route(counts, variant).key  # no per-step context here, so no backend veto
        return key.tokens if key is not None else None

    # -- the graphs' life (docs/user-guide.md) ------------------------------------------------------
    def capture(self) -> CaptureReport:
        """Capture every key, largest first, into one pool on one stream; returns the report.

        Per key: ``warmup_iters`` eager runs on the capture stream, a barrier across ``process_group``, the
        capture (which changes no older tensor, on a device as on the simulator). At most one more eager
        run learns the output layout (``output_axes=`` skips it). Declared ``state`` is restored after.
        A lazily capturing runner captures nothing here; a released runner captures its keys again. On
        failure raises :class:`CaptureError` naming the key and what to do, after releasing every graph.
        """
        return self.life.capture()

    def refresh(self) -> CaptureReport:
        """Release every graph and capture again on the tensors the forward reaches now (user guide)."""
        return self.life.refresh()

    def release(self) -> Released:
        """Free every graph and the graph pool (the bytes go back to the device); steps run eagerly,
        counted as ``released`` in :meth:`stats`, until :meth:`restore`. Compiled artifacts stay in memory.
        Refused during a background capture. Returns the keys released and the bytes they held. See
        docs/user-guide.md, "Start-up and memory"."""
        return self.life.release()

    def restore(self) -> CaptureReport:
        """Capture again the keys :meth:`release` freed, reusing the compiled forward (nothing is compiled
        again); outputs are those of before the release. A no-op when not released."""
        return self.life.restore()

    def retune(self, sizes: Sequence[int], *, lazy: bool = True) -> list[GraphKey]:
        """Switch to other token ``sizes`` while serving (tuned ones): graphs of keys that stay are kept,
        others released, new keys (returned) captured on first sight (``lazy``) or now. See the user guide."""
        return self.life.retune(sizes, lazy=lazy)

    def graph_memory(self) -> GraphMemory:
        """Exact bytes the captured graphs hold, per key (each key's pool growth while captured)."""
        with self._lock:
            return self.life.graph_memory()

    def estimate_graph_memory(self, *, probes: int | None = None) -> GraphMemoryEstimate:
        """Before :meth:`capture`: the bytes every configured key's graph will hold, in every graph set,
        measured by capturing every key into a throw-away pool (then released), or with ``probes=N`` from N
        keys and a piecewise-linear fit of the rest. Call it before allocating the KV cache (see
        docs/user-guide.md, "Start-up and memory")."""
        return self.life.estimate(probes)

    def check_addresses(self) -> None:
        """Check every tensor the graphs use, not only what an event reported (see the user guide)."""
        self.life.check_addresses()

    # -- recording ----------------------------------------------------------------------------------
    def record_steps(self, on: bool = True) -> None:
        """Start (or stop) counting steps per count tuple: ``stats()["recorded"]``, :meth:`recorded_steps`."""
        with self._lock:
            self._stats.recorded = (self._stats.recorded or Counter()) if on else None

    def recorded_steps(self) -> PhaseSteps:
        """The steps recorded so far, with the schedule and graph bytes, for ``write_trace`` / ``tune``."""
        with self._lock:
            graph_bytes: dict[int, int] = {}
            for key, report in self.life.sets.primary.reports.items():
                graph_bytes[key.tokens] = graph_bytes.get(key.tokens, 0) + report.bytes
            return self._stats.phase_steps(self.schedule, graph_bytes)

    # -- steps --------------------------------------------------------------------------------------
    def agree(
        self, n: int | None = None, context: Any = None, *, counts: Mapping[str, int] | None = None,
        variant: Mapping[str, Hashable] | None = None,
    ) -> Agreement:  # fmt: skip
        """With ``dp_group``: agree on this step's key with the other ranks (one all-reduce); the counts every
        rank pads to. Pass it to :meth:`run` as ``agreement=``. See docs/tensor-parallel.md."""
        with self._lock:
            self.life.check_open()
            step, chosen = self._validator.validate_counts(n, counts, variant)
            return self._steps.agree(step, chosen, context)

    def run(
        self,
        n: int | None = None,
        context: Any = None,
        *,
        counts: Mapping[str, int] | None = None,
        variant: Mapping[str, Hashable] | None = None,
        copy: bool = False,
        out: Any = None,
        agreement: Agreement | None = None,
        **inputs: torch.Tensor,
    ) -> Any:
        """Run one step of ``n`` tokens (default: the rows of the first tokens-axis input).

        Replays the graph of the smallest key that holds the step (each axis padded with its inputs'
        fills) and returns outputs with row-major leaves cut to the real counts, else runs ``forward``
        eagerly (before ``capture()``, past the largest key, a variant not captured, ``can_run`` said no,
        or a mode without graphs) and counts why. Every path validates inputs the same way and never lets
        the forward's in-place changes to inputs reach the caller (but for an input written into
        :meth:`static_rows`, which is the buffer itself). Returned tensors are valid until the
        next ``run()`` of any thread; ``copy=True`` returns owned tensors, ``out=`` copies into the
        caller's tensors (checked against the step's outputs once the step ran).
        """
        if copy and out is not None:
            raise InputError("run() takes copy=True or out=, not both: out= already gives owned tensors")
        with self._lock:
            self.life.check_open()
            step, chosen = self._validator.validate(n, counts, variant, inputs)
            result = self._steps.step(step, chosen, context, inputs, agreement=agreement)
            if out is not None:
                return copy_into_out(result, out)
            return copy_tree(result) if copy else result

    def submit(
        self,
        n: int | None = None,
        context: Any = None,
        *,
        counts: Mapping[str, int] | None = None,
        variant: Mapping[str, Hashable] | None = None,
        copy: bool = False,
        out: Any = None,
        agreement: Agreement | None = None,
        **inputs: torch.Tensor,
    ) -> StepHandle:
        """:meth:`run` that returns once the step's work is issued, before the device finishes it: a
        :class:`~devgraph.runner.handle.StepHandle` with the outputs and an event recorded on the replay
        stream after the step (``ready()``, ``wait()``). For engines that overlap the host's work with the
        device's (docs/user-guide.md, "Overlapping the host and the device")."""
        with self._lock:
            outputs = self.run(
                n, context, counts=counts, variant=variant, copy=copy, out=out, agreement=agreement, **inputs
            )
            return StepHandle(outputs, self.life.plan.platform.record_event())

    def to_host(self, *tensors: torch.Tensor) -> HostCopy:
        """Copy ``tensors`` (computed on this runner's device after a step: sampled tokens, log
        probabilities) to pinned host memory without blocking, ordered after the work issued so far on the
        current stream; :class:`~devgraph.runner.handle.HostCopy` ``.wait()`` returns them once the copies
        are done. The other half of :meth:`submit` for an engine that overlaps its host work (see
        docs/user-guide.md). Holds no lock: it reads no runner state."""
        return copy_to_host(tensors, self.life.plan.platform.record_event)

    def verify(
        self,
        n: int | None = None,
        context: Any = None,
        *,
        rtol: float | None = None,
        counts: Mapping[str, int] | None = None,
        variant: Mapping[str, Hashable] | None = None,
        **inputs: torch.Tensor,
    ) -> VerifyResult:
        """Run one step through the graph and eagerly on the same inputs; report the largest differences:
        the forward runs 3 times on the graph path (replay, eager on the caller's rows, eager on the padded
        buffers), twice on the eager path; declared ``state`` is restored before each run and after the
        last. ``rtol`` bounds both differences relative to max |eager| (default 1e-4; 2e-2 for 16-bit
        outputs). Not counted in :meth:`stats` steps.
        """
        with self._lock:
            self.life.check_open()
            step, chosen = self._validator.validate(n, counts, variant, inputs)
            self._stats.verify_calls += 1
            return self._steps.verify(step, chosen, context, inputs, rtol)

    # -- inspection ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Run-time counters as plain data: replays per key, eager steps by reason, padding waste."""
        with self._lock:
            return {
                "phase": self.phase,
                "backend": self.backend.name,
                **self._stats.as_dict(),
                "released": self.released,
                "graph_memory": self.life.graph_memory().as_dict(),
                "strategy": self.backend.stats(),
            }

    def reset_stats(self) -> None:
        with self._lock:
            self._stats.reset()

    def inspect(self) -> dict[str, Any]:
        """What was set up and captured, as plain data (no private attributes needed)."""
        with self._lock:
            life = self.life
            reports = life.sets.primary.reports
            info = describe_runner(life.plan, self.backend, reports, self._layout, life.report is not None)
            return {**info, **life.describe(), "graph_memory": life.graph_memory().as_dict()}

    # -- teardown -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Release graphs, their pool and the static buffers. Call before destroying the process group."""
        with self._lock:
            try:
                self.life.close()
            finally:
                self._buffers.clear()

    def __enter__(self) -> GraphRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GraphRunner(phase={self.phase!r}, backend={self.backend.name!r}, "
            f"platform={self.platform.name!r}, sizes={list(self.sizes)}, life={self.life.state})"
        )
