"""``GraphRunner``: capture a phase's forward at start-up (or on first sight), replay it on every step.

The runner assembles its parts from one :class:`~devgraph.runner.plan.RunnerPlan` (the flag and the
arguments resolved once): :mod:`~devgraph.runner.staging` validates and pads inputs, the
:mod:`~devgraph.runner.dispatch` dispatcher decides graph or eager and which key, the backend captures
(:mod:`~devgraph.runner.capture.graphs`) and replays, :mod:`~devgraph.runner.outputs.layout` hands the same
structure back on every path, :mod:`~devgraph.runner.stats` counts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.inputs import StaticInput
from devgraph.contract.keys import REQUESTS, TOKENS, Batch, GraphKey
from devgraph.errors import ConfigError, InputError
from devgraph.flag.config import DeviceGraphConfig
from devgraph.flag.trace import PhaseSteps
from devgraph.messages import shorten
from devgraph.ranks import assert_same_key, release_backend
from devgraph.runner import lifecycle, memory
from devgraph.runner.capture.graphs import RunnerGraphs
from devgraph.runner.capture.loop import CaptureReport
from devgraph.runner.capture.pool import GraphPool
from devgraph.runner.capture.sets import GraphSets
from devgraph.runner.dispatch import Decision
from devgraph.runner.inspection import describe_runner
from devgraph.runner.outputs.layout import OutputLayout
from devgraph.runner.outputs.trees import copy_into_out, copy_tree
from devgraph.runner.plan import check_signature, plan_runner
from devgraph.runner.plan_view import PlanView
from devgraph.runner.schedule import AxisSizes
from devgraph.runner.staging import StaticBuffers, StepValidator
from devgraph.runner.stats import RunnerStats
from devgraph.runner.stepping import Agreement, Stepper
from devgraph.runner.verify import VerifyResult

__all__ = ["GraphRunner"]

logger = logging.getLogger(__name__)

#: Keywords of run() and verify(): an input may not use these names.
RESERVED_NAMES = frozenset({"n", "context", "counts", "variant", "copy", "out", "rtol", "self", "agreement"})


class GraphRunner(PlanView):
    """Captures ``forward`` for a phase at a set of keys and replays it, padding each step up to a key.

    ``forward(**inputs, **variant)`` takes one tensor per declared :class:`StaticInput` (rows follow the
    input's axis: the step's token count, or its request count, ...) and returns any pytree of tensors;
    model state (weights, KV cache) is reached through the closure. Choose the backend with ``mode`` (a
    strategy name) or ``config`` (a parsed ``--device-graph-mode``). The arguments are resolved once into
    :attr:`plan` (:mod:`devgraph.runner.plan`): those the flag also has are checked as its values are, and
    the flag wins where both set one. See docs/user-guide.md.

    Thread safety: ``run``, ``verify``, ``capture`` and ``close`` hold one lock, so steps from several
    threads never interleave. What ``run`` returns is valid until the next ``run`` from any thread: threads
    sharing a runner pass ``copy=True`` (or ``out=``). ``single_thread=True`` drops the lock for an engine
    that calls the runner from one thread only.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        *,
        phase: str,
        inputs: Mapping[str, StaticInput],
        sizes: Sequence[int] | None = None,
        max_size: int | None = None,
        device: torch.device | str | None = None,
        mode: str | None = None,
        config: DeviceGraphConfig | str | None = None,
        compiler: str | None = None,
        features: Mapping[str, Any] | None = None,
        warmup_iters: int | None = None,
        capture_context: Callable[[GraphKey], Any] | None = None,
        process_group: Any = None,
        progress: bool | None = None,
        backend: DeviceGraphBackend | None = None,
        axes: Mapping[str, AxisSizes] | None = None,
        tokens_per_request: int | None = None,
        variants: Mapping[str, Sequence[Hashable]] | None = None,
        state: Any = None,
        output_axes: Sequence[str | None] | Mapping[str, str | None] | None = None,
        lazy: bool | None = None,
        max_graphs: int | None = None,
        max_graph_bytes: int | None = None,
        capture_hook: Callable[[], Any] | None = None,
        check_lockstep: bool = False,
        single_thread: bool = False,
        fallback: str | None = None,
        pool: GraphPool | None = None,
        address_guard: bool = True,
        dp_group: Any = None,
        record_steps: bool = False,
    ) -> None:
        if not callable(forward):
            raise ConfigError(f"GraphRunner forward must be callable, got {shorten(forward)}")
        self.forward = forward
        flag_keys = {"sizes": sizes, "max_size": max_size, "compiler": compiler, "warmup_iters": warmup_iters}
        flag_keys.update(lazy=lazy, max_graphs=max_graphs, max_graph_bytes=max_graph_bytes, fallback=fallback)
        self.plan, backend, second = plan_runner(
            phase=phase,
            inputs=inputs,
            reserved=RESERVED_NAMES,
            device=device,
            backend=backend,
            features=features,
            mode=mode,
            config=config,
            arguments=flag_keys,
            axes=axes,
            tokens_per_request=tokens_per_request,
            variants=variants,
            capture_context=capture_context,
            capture_hook=capture_hook,
            progress=progress,
            process_group=process_group,
            state=state,
            output_axes=output_axes,
            check_lockstep=check_lockstep,
            single_thread=single_thread,
            dp_group=dp_group,
            address_guard=address_guard,
        )
        plan = self.plan
        check_signature(forward, [*plan.inputs, *plan.schedule.variants], plan.phase)
        self.backend: DeviceGraphBackend = backend
        #: Check each step that every rank replays the same key (an all-gather); may flip between steps.
        self.check_lockstep: bool = plan.check_lockstep
        self._validator = StepValidator(plan)
        self._buffers = StaticBuffers(plan.inputs, plan.schedule.max_rows(), plan.device)
        # Decode's request count is its token count: an output following either is cut the same way.
        linked = frozenset({REQUESTS}) if plan.tokens_per_request == 1 else frozenset()
        self._layout = OutputLayout(plan.output_axes, same_as_tokens=linked)
        self._stats = RunnerStats(recorded=Counter() if record_steps else None)
        self._lock = contextlib.nullcontext() if plan.single_thread else threading.RLock()
        self._closed = self._captured = False
        self._released: lifecycle.Released | None = None
        self.report: CaptureReport | None = None
        self.pool: GraphPool | None = None
        self._steps: Stepper
        self._sets: GraphSets
        self._graphs: RunnerGraphs
        lifecycle.assemble(self, backend, second, pool)  # ... and tracks it for destroy_process_group()

    @property
    def static_inputs(self) -> Mapping[str, torch.Tensor]:
        """The full static buffers (as many rows as the largest key's axis)."""
        return self._buffers.buffers

    @property
    def keys(self) -> list[GraphKey]:
        """The keys holding a graph now."""
        return sorted(self.backend.captured_keys(), key=GraphKey.sort_key)

    def bucket(self, n: int) -> int | None:
        """The token size a step of ``n`` tokens would replay now (``None``: it would run eagerly)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return None
        counts = {TOKENS: n, **{a: 1 for a in self.schedule.axis_names}}
        variant = {name: values[0] for name, values in self.schedule.variants.items()}
        key = self._steps.route(counts, variant).key  # no per-step context here, so no backend veto
        return key.tokens if key is not None else None

    # -- capture ------------------------------------------------------------------------------------
    def capture(self) -> CaptureReport:
        """Capture every key, largest first, into one pool on one stream; returns the report.

        Per key: ``warmup_iters`` eager runs on the capture stream, a barrier across ``process_group``, the
        capture (which changes no older tensor, on a device as on the simulator). At most one more eager
        run learns the output layout (``output_axes=`` skips it). Declared ``state`` is restored after.
        A lazily capturing runner captures nothing here. On failure raises :class:`CaptureError` naming
        the key and what to do, after releasing every graph. See docs/user-guide.md.
        """
        with self._lock:
            self._check_open()
            if not self._captured:
                self.report = lifecycle.start_up(self)
                self._captured = True
            return self.report or self._graphs.empty_report()

    def refresh(self) -> CaptureReport:
        """Release every graph and capture again on the tensors the forward reaches now (user guide)."""
        with self._lock:
            self._check_open()
            lifecycle.release_all(self)
            return self.capture()

    def release(self) -> lifecycle.Released:
        """Free every graph and the graph pool (the bytes go back to the device); steps run eagerly,
        counted as ``released`` in :meth:`stats`, until :meth:`restore`. Compiled artifacts stay in memory.
        Refused during a background capture. Returns the keys released and the bytes they held. See
        docs/user-guide.md, "Start-up and memory"."""
        with self._lock:
            self._check_open()
            return lifecycle.release(self)

    def restore(self) -> CaptureReport:
        """Capture again the keys :meth:`release` freed, reusing the compiled forward (nothing is compiled
        again); outputs are those of before the release. A no-op when not released."""
        with self._lock:
            self._check_open()
            return lifecycle.restore(self)

    @property
    def released(self) -> bool:
        """Whether :meth:`release` freed the graphs and :meth:`restore` has not captured them again."""
        return self._released is not None

    def graph_memory(self) -> memory.GraphMemory:
        """Exact bytes the captured graphs hold, per key (each key's pool growth while captured)."""
        with self._lock:
            return memory.graph_memory(self)

    def estimate_graph_memory(self, *, probes: int | None = None) -> memory.GraphMemoryEstimate:
        """Before :meth:`capture`: the bytes every configured key's graph will hold, measured by capturing
        every key into a throw-away pool (then released), or with ``probes=N`` from N keys and a
        piecewise-linear fit of the rest. Call it before allocating the KV cache (see docs/user-guide.md,
        "Start-up and memory")."""
        with self._lock:
            self._check_open()
            return memory.estimate(self, probes)

    def check_addresses(self) -> None:
        """Check every tensor the graphs use, not only what an event reported (see the user guide)."""
        with self._lock:
            lifecycle.check_addresses(self)

    def retune(self, sizes: Sequence[int], *, lazy: bool = True) -> list[GraphKey]:
        """Switch to other token ``sizes`` while serving (tuned ones): graphs of keys that stay are kept,
        others released, new keys (returned) captured on first sight (``lazy``) or now. See the user guide."""
        with self._lock:
            self._check_open()
            return lifecycle.retune(self, sizes, lazy=lazy)

    def record_steps(self, on: bool = True) -> None:
        """Start (or stop) counting steps per count tuple: ``stats()["recorded"]``, :meth:`recorded_steps`."""
        with self._lock:
            self._stats.recorded = (self._stats.recorded or Counter()) if on else None

    def recorded_steps(self) -> PhaseSteps:
        """The steps recorded so far, with the schedule and graph bytes, for ``write_trace`` / ``tune``."""
        with self._lock:
            return lifecycle.recorded_steps(self)

    def agree(
        self, n: int | None = None, context: Any = None, *, counts: Mapping[str, int] | None = None,
        variant: Mapping[str, Hashable] | None = None,
    ) -> Agreement:  # fmt: skip
        """With ``dp_group``: agree on this step's key with the other ranks (one all-reduce); the counts every
        rank pads to. Pass it to :meth:`run` as ``agreement=``. See docs/tensor-parallel.md."""
        with self._lock:
            self._check_open()
            step, chosen = self._validator.validate_counts(n, counts, variant)
            return self._steps.agree(step, chosen, context)

    # -- run ----------------------------------------------------------------------------------------
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
        the forward's in-place changes to inputs reach the caller. Returned tensors are valid until the
        next ``run()`` of any thread; ``copy=True`` returns owned tensors, ``out=`` copies into the
        caller's tensors (checked against the step's outputs once the step ran).
        """
        if copy and out is not None:
            raise InputError("run() takes copy=True or out=, not both: out= already gives owned tensors")
        with self._lock:
            self._check_open()
            step, chosen = self._validator.validate(n, counts, variant, inputs)
            result = self._step(step, chosen, context, inputs, count=True, agreement=agreement)
            if out is not None:
                return copy_into_out(result, out)
            return copy_tree(result) if copy else result

    def _step(
        self,
        step: Batch,
        variant: dict[str, Any],
        context: Any,
        inputs: Mapping[str, torch.Tensor],
        *,
        count: bool,
        agreement: Agreement | None = None,
        decision: Decision | None = None,
    ) -> Any:
        steps = self._steps
        decision = decision or steps.decide(step, variant, context, agreement)
        if self.check_lockstep:
            assert_same_key(self.plan.process_group, decision.key)
        return steps.run(step, variant, context, inputs, decision, count=count)

    # -- checks -------------------------------------------------------------------------------------
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
            self._check_open()
            step, chosen = self._validator.validate(n, counts, variant, inputs)
            self._stats.verify_calls += 1
            decision = self._steps.decide(step, chosen, context, None)
            replay = lambda: self._step(step, chosen, context, inputs, count=False, decision=decision)  # noqa: E731
            return self._steps.verify(step, chosen, context, inputs, decision, replay, rtol)

    # -- inspection ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Run-time counters as plain data: replays per key, eager steps by reason, padding waste."""
        with self._lock:
            return {
                "phase": self.phase,
                "backend": self.backend.name,
                **self._stats.as_dict(),
                "released": self._released is not None,
                "graph_memory": memory.graph_memory(self).as_dict(),
                "strategy": self.backend.stats(),
            }

    def reset_stats(self) -> None:
        with self._lock:
            self._stats.reset()

    def inspect(self) -> dict[str, Any]:
        """What was set up and captured, as plain data (no private attributes needed)."""
        with self._lock:
            captured = self.report is not None
            info = describe_runner(self.plan, self.backend, self._graphs.reports, self._layout, captured)
            graph_memory = memory.graph_memory(self).as_dict()
            return {**info, **lifecycle.describe_extras(self), "graph_memory": graph_memory}

    # -- teardown -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Release graphs, their pool and the static buffers. Call before destroying the process group."""
        with self._lock:
            if self._closed:
                return
            try:
                for backend in self._sets.backends:
                    release_backend(backend, self.plan.process_group, self.platform)
            finally:
                lifecycle.let_go(self)
                self._buffers.clear()
                self._captured = False
                self.report = None
                self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"this {self.phase} runner was closed; build a new GraphRunner")

    def __enter__(self) -> GraphRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        sizes, captured = list(self.schedule.token_sizes), self._captured
        return (
            f"GraphRunner(phase={self.phase!r}, backend={self.backend.name!r}, "
            f"platform={self.platform.name!r}, sizes={sizes}, captured={captured})"
        )
