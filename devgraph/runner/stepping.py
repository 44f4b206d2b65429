"""One step of a runner, from a validated :class:`~devgraph.contract.keys.Batch` to its outputs.

:class:`Stepper` asks the dispatcher for a decision (graph or eager, which key, which graph set), agrees on
it with the other ranks of a data-parallel group (:func:`~devgraph.ranks.dp.agree_counts`), checks that the
graphs' memory has not moved (the address guard), stages the inputs, replays the chosen set's graph and cuts
the outputs back; or runs the forward eagerly. :class:`~devgraph.runner.graph_runner.GraphRunner` holds the
lock and the public API around it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.context import forward_context
from devgraph.contract.keys import TOKENS, Batch, GraphKey
from devgraph.errors import ConfigError, InputError, ReplayError
from devgraph.ranks import GroupAgreement, variant_code
from devgraph.runner.capture.pool import GraphPool
from devgraph.runner.capture.sets import GraphSets
from devgraph.runner.dispatch import Decision, Dispatcher, EagerReason, SecondSet
from devgraph.runner.guard import AddressGuard
from devgraph.runner.outputs.layout import OutputLayout
from devgraph.runner.outputs.trees import copy_tree
from devgraph.runner.staging import StaticBuffers
from devgraph.runner.stats import RunnerStats
from devgraph.runner.verify import VerifyResult, compare

__all__ = ["Agreement", "Stepper"]

#: Eager reasons every rank of a data-parallel group reaches alike from the agreed counts.
_GROUP_WIDE = frozenset(
    {EagerReason.PAST_LARGEST, EagerReason.AXIS_PAST_LARGEST, EagerReason.VARIANT_NOT_CAPTURED}
)


@dataclass(frozen=True)
class Agreement:
    """A step as the ranks of a data-parallel group agreed on it (``GraphRunner.agree``).

    ``own``: this rank's counts per axis; ``counts``: what every rank pads to (the agreed key's size on
    each axis; when the step runs eagerly, the largest count of each axis over the group); ``key``: the key
    every rank replays (``None``: every rank runs eagerly, for ``reason``).
    """

    own: Mapping[str, int]
    counts: Mapping[str, int]
    key: GraphKey | None
    reason: EagerReason | None
    decision: Decision

    @property
    def eager(self) -> bool:
        return self.key is None


def _overrides(backend: DeviceGraphBackend) -> bool:
    return type(backend).can_run is not DeviceGraphBackend.can_run


class Stepper:
    """Decides and runs one step of a runner (see the module docstring)."""

    def __init__(
        self,
        plan: Any,
        forward: Callable[..., Any],
        sets: GraphSets,
        buffers: StaticBuffers,
        layout: OutputLayout,
        stats: RunnerStats,
        captured: Callable[[], bool],
    ) -> None:
        self.plan = plan
        self.forward = forward
        self.sets = sets
        self.buffers = buffers
        self.layout = layout
        self.stats = stats
        self.captured = captured
        self.dispatcher = Dispatcher(plan.schedule)
        self.guard: AddressGuard | None = None
        self.pool: GraphPool | None = None
        self.owner: Any = None  # the runner, named by the pool's checks
        #: Keys are being captured in the background (devgraph.runner.capture.background): route steps as
        #: if captured; a key without its graph yet runs eagerly, counted as ``capturing``.
        self.capturing = False
        #: ``release()`` freed the graphs: every step runs eagerly, as ``released``, until ``restore()``.
        self.released = False
        self._group: GroupAgreement | None = (
            None  # the data-parallel group's agreement, resolved at first use
        )
        self._veto = _overrides(sets.primary.backend)
        fallback = sets.fallback
        self._second_veto = fallback is not None and _overrides(fallback.backend)

    def set_plan(self, plan: Any) -> None:
        """A retuned plan: new keys to route to (the buffers stay)."""
        self.plan = plan
        self.dispatcher = Dispatcher(plan.schedule)
        self.sets.set_plan(plan)
        self._group = None  # the agreement compares the new key set from the next step on

    # -- deciding -----------------------------------------------------------------------------------
    def route(
        self,
        counts: Mapping[str, int],
        variant: Mapping[str, Any],
        step: Batch | None = None,
        context: Any = None,
    ) -> Decision:
        """The decision for ``counts`` given the graph sets' state; with ``step``, the backends' vetoes
        judge ``step`` padded to the key."""
        primary, fallback = self.sets.primary, self.sets.fallback
        if self.released and primary.backend.uses_graphs:
            return Decision(None, EagerReason.RELEASED)
        can_run = second = None
        if step is not None and self._veto:
            backend = primary.backend
            can_run = lambda key: backend.can_run(step.routed(key, context))  # noqa: E731
        if fallback is not None:
            other = fallback.backend
            veto = (
                (lambda key: other.can_run(step.routed(key, context)))
                if step is not None and self._second_veto
                else None
            )
            second = SecondSet(other.has_shape, veto)
        return self.dispatcher.decide(
            counts,
            variant,
            uses_graphs=primary.backend.uses_graphs,
            captured=self.captured() or self.capturing,
            has_shape=primary.backend.has_shape,
            lazy=self.plan.capture.lazy,
            failed=primary.lazy.failed,
            can_run=can_run,
            second=second,
            capturing=self.capturing,
        )

    def decide(
        self, step: Batch, variant: Mapping[str, Any], context: Any, agreement: Agreement | None
    ) -> Decision:
        """This step's decision; with a data-parallel group, the group's (``agreement``, else agreed now)."""
        if self.plan.dp_group is None:
            return self.route(step.counts, variant, step, context)
        if agreement is None:
            agreement = self.agree(step, variant, context)
        elif dict(agreement.own) != dict(step.counts):
            raise InputError(
                f"{self.plan.phase} run() got an agreement for counts {dict(agreement.own)}, but this step "
                "has "
                f"{dict(step.counts)}; pass the agreement agree() returned for this step"
            )
        return agreement.decision

    def agree(self, step: Batch, variant: Mapping[str, Any], context: Any) -> Agreement:
        """One all-reduce with the data-parallel group: every rank routes the largest counts of the step."""
        if self.plan.dp_group is None:
            raise ConfigError("agree() needs a runner built with dp_group= (a data-parallel group)")
        own = self.route(step.counts, variant, step, context)
        axes = (TOKENS, *self.plan.schedule.axis_names)
        if self._group is None:
            self._group = GroupAgreement(self.plan.dp_group, self.plan.schedule.keys())
        group = self._group([step.counts[a] for a in axes], own.key is None, variant_code(variant))
        largest = dict(zip(axes, group.counts, strict=True))
        if group.eager or not group.same_variant:
            decision = own if own.key is None else Decision(None, EagerReason.PEER_EAGER)
            return Agreement(dict(step.counts), largest, None, decision.reason, decision)
        decision = self.route(largest, variant, step, context)
        key = decision.key
        if key is None and decision.reason not in _GROUP_WIDE:
            raise ReplayError(
                f"this rank cannot replay the {self.plan.phase} key the data-parallel group agreed on for "
                "counts "
                f"{largest} ({decision.reason}), while its own key {own.key} would: every rank of the group "
                "must hold the same keys, and a backend's can_run must not depend on the key"
            )
        counts = {a: key.size(a) for a in axes} if key is not None else largest
        return Agreement(dict(step.counts), counts, key, decision.reason, decision)

    # -- running ------------------------------------------------------------------------------------
    def run(
        self,
        step: Batch,
        variant: dict[str, Any],
        context: Any,
        inputs: Mapping[str, torch.Tensor],
        decision: Decision,
        *,
        count: bool,
    ) -> Any:
        """Replay ``decision``'s graph for ``step`` (or run eagerly); ``count`` it in the statistics."""
        stats = self.stats
        if count and stats.recorded is not None:
            stats.recorded[tuple(step.counts.values())] += 1
        key = decision.key
        if key is None:
            if count:
                stats.ran_eagerly(decision.reason)  # type: ignore[arg-type]
            return self.eager(context, variant, inputs)
        graphs = self.sets.for_decision(decision)
        if self.plan.capture.lazy:
            graphs.lazy.lookup(key, count)
        if self.guard is not None:  # after a lazy capture, which records the key's host values
            self.guard.check(key, context)
        self.buffers.stage(step.counts, key, inputs)
        backend = graphs.backend
        pool = self.pool
        checking = pool.replaying(self.owner) if pool is not None and pool.debug else contextlib.nullcontext()
        with checking, forward_context(context), backend.runtime_session():
            raw = backend.replay(key, self.buffers.buffers)
        if count:
            stats.replayed(key, step.n)
            if decision.fallback is not None:
                stats.fallback[decision.fallback] += 1
            if self.plan.dp_group is not None:
                stats.agreed_steps += 1
                own = self.dispatcher.route(step.counts, variant).key
                stats.peer_padded_rows += key.tokens - (own.tokens if own is not None else step.n)
        # The fallback's outputs are other tensors than the primary's: never the cached leaves of the key.
        return self.layout.slice(raw, step.counts, key, replay=decision.fallback is None)

    def verify(
        self,
        step: Batch,
        variant: dict[str, Any],
        context: Any,
        inputs: Mapping[str, torch.Tensor],
        decision: Decision,
        replay: Callable[[], Any],
        rtol: float | None,
    ) -> VerifyResult:
        """``verify()``: ``replay()`` (the step through its graph), then the forward eagerly on the caller's
        rows and on the padded buffers, declared state restored before each; the largest differences."""
        key = decision.key
        with self.plan.state.preserved() as restore:
            graph = copy_tree(replay())
            restore()
            unpadded = copy_tree(self.eager(context, variant, inputs))
            padded = unpadded
            if key is not None:
                restore()
                self.buffers.stage(step.counts, key, inputs)
                forward = self.sets.for_decision(decision).forward
                with forward_context(context), torch.no_grad():
                    raw = forward(**self.buffers.views(key), **variant)
                padded = copy_tree(self.layout.slice(raw, step.counts, key, replay=False))
        return compare(step.n, key, graph, padded, unpadded, rtol)

    def eager(self, context: Any, variant: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]) -> Any:
        # The forward gets its own copies, as on the graph path: its in-place changes never reach the caller.
        owned = {name: value.clone() for name, value in inputs.items()}
        # The plain forward, never the compiled one: an eager step can never trigger a recompile.
        with forward_context(context), torch.no_grad():
            return self.forward(**owned, **variant)
