"""One step of a runner, from a validated :class:`~devgraph.contract.keys.Batch` to its outputs.

:meth:`Stepper.step` is the whole step on one screen: decide (the dispatcher, over what the graph life
allows now and its graph sets), agree with the other ranks of a data-parallel group
(:func:`~devgraph.ranks.dp.agree_counts`) or check the tensor-parallel ranks replay the same key, then
:meth:`Stepper.replay`: check that the graphs' memory has not moved (the address guard), stage the inputs,
replay the chosen set's graph and cut the outputs back; or run the forward eagerly. The stepper reads the
:class:`~devgraph.runner.life.GraphLife` and keeps no state of it.
:class:`~devgraph.runner.graph_runner.GraphRunner` holds the lock and the public API around it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.contract.context import forward_context
from devgraph.contract.keys import TOKENS, Batch, GraphKey
from devgraph.errors import ConfigError, InputError, ReplayError
from devgraph.ranks import GroupAgreement, assert_same_key, variant_code
from devgraph.runner.dispatch import Decision, EagerReason
from devgraph.runner.life import GraphLife
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


class Stepper:
    """Decides and runs one step of a runner (see the module docstring)."""

    def __init__(
        self,
        life: GraphLife,
        forward: Callable[..., Any],
        parts: tuple[StaticBuffers, OutputLayout, RunnerStats],
        check_lockstep: bool,
    ) -> None:
        self.life = life
        self.forward = forward
        self.buffers, self.layout, self.stats = parts
        #: Check each step that every rank replays the same key (an all-gather); may flip between steps.
        self.check_lockstep = check_lockstep
        self._group: GroupAgreement | None = None  # the data-parallel group's agreement, made at first use
        self._group_schedule: Any = None  # the schedule whose key set it compares (a retune makes it anew)

    # -- deciding -----------------------------------------------------------------------------------
    def route(
        self,
        counts: Mapping[str, int],
        variant: Mapping[str, Any],
        step: Batch | None = None,
        context: Any = None,
    ) -> Decision:
        """The decision for ``counts`` given what the graph life allows now; with ``step``, the backends'
        vetoes judge ``step`` padded to the key."""
        life = self.life
        return life.router.decide(counts, variant, life.readiness, life.sets.key_sets, step, context)

    def decide(
        self, step: Batch, variant: Mapping[str, Any], context: Any, agreement: Agreement | None
    ) -> Decision:
        """This step's decision; with a data-parallel group, the group's (``agreement``, else agreed now)."""
        plan = self.life.plan
        if plan.distributed.dp_group is None:
            return self.route(step.counts, variant, step, context)
        if agreement is None:
            agreement = self.agree(step, variant, context)
        elif dict(agreement.own) != dict(step.counts):
            raise InputError(
                f"{plan.phase} run() got an agreement for counts {dict(agreement.own)}, but this step "
                "has "
                f"{dict(step.counts)}; pass the agreement agree() returned for this step"
            )
        return agreement.decision

    def agree(self, step: Batch, variant: Mapping[str, Any], context: Any) -> Agreement:
        """One all-reduce with the data-parallel group: every rank routes the largest counts of the step."""
        plan = self.life.plan
        if plan.dp_group is None:
            raise ConfigError("agree() needs a runner built with dp_group= (a data-parallel group)")
        own = self.route(step.counts, variant, step, context)
        axes = (TOKENS, *plan.schedule.axis_names)
        if self._group is None or self._group_schedule is not plan.schedule:
            self._group = GroupAgreement(plan.dp_group, plan.schedule.keys())
            self._group_schedule = plan.schedule
        group = self._group([step.counts[a] for a in axes], own.key is None, variant_code(variant))
        self.stats.agreement_transport = self._group.transport
        largest = dict(zip(axes, group.counts, strict=True))
        if group.eager or not group.same_variant:
            decision = own if own.key is None else Decision(None, EagerReason.PEER_EAGER)
            return Agreement(dict(step.counts), largest, None, decision.reason, decision)
        decision = self.route(largest, variant, step, context)
        key = decision.key
        if key is None and decision.reason not in _GROUP_WIDE:
            raise ReplayError(
                f"this rank cannot replay the {plan.phase} key the data-parallel group agreed on for "
                "counts "
                f"{largest} ({decision.reason}), while its own key {own.key} would: every rank of the group "
                "must hold the same keys, and a backend's can_run must not depend on the key"
            )
        counts = {a: key.size(a) for a in axes} if key is not None else largest
        return Agreement(dict(step.counts), counts, key, decision.reason, decision)

    # -- running ------------------------------------------------------------------------------------
    def step(
        self,
        step: Batch,
        variant: dict[str, Any],
        context: Any,
        inputs: Mapping[str, torch.Tensor],
        *,
        count: bool = True,
        agreement: Agreement | None = None,
    ) -> Any:
        """One step: decide (or take the group's agreement), check the ranks replay the same key, replay."""
        decision = self.decide(step, variant, context, agreement)
        if self.check_lockstep:
            assert_same_key(self.life.plan.process_group, decision.key)
        return self.replay(step, variant, context, inputs, decision, count=count)

    def replay(
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
        stats, life = self.stats, self.life
        if count and stats.recorded is not None:
            stats.recorded[tuple(step.counts.values())] += 1
        key = decision.key
        if key is None:
            if count:
                stats.ran_eagerly(decision.reason)  # type: ignore[arg-type]
            return self.eager(context, variant, inputs)
        graphs = life.sets.for_decision(decision)
        if life.plan.capture.lazy:
            graphs.lazy.lookup(key, count)
        if life.guard is not None:  # after a lazy capture, which records the key's host values
            life.guard.check(key, context)
        self.buffers.stage(step.counts, key, inputs)
        backend = graphs.backend
        pool = life.pool
        checking = pool.replaying(life.owner) if pool is not None and pool.debug else contextlib.nullcontext()
        with checking, forward_context(context), backend.runtime_session():
            raw = backend.replay(key, self.buffers.buffers)
        if count:
            stats.replayed(key, step.n)
            if decision.fallback is not None:
                stats.fallback[decision.fallback] += 1
            if life.plan.distributed.dp_group is not None:
                stats.agreed_steps += 1
                own = life.router.route(step.counts, variant).key
                stats.peer_padded_rows += key.tokens - (own.tokens if own is not None else step.n)
        # The fallback's outputs are other tensors than the primary's: never the cached leaves of the key.
        return self.layout.slice(raw, step.counts, key, replay=decision.fallback is None)

    def verify(
        self,
        step: Batch,
        variant: dict[str, Any],
        context: Any,
        inputs: Mapping[str, torch.Tensor],
        rtol: float | None,
    ) -> VerifyResult:
        """``verify()``: the step through its graph (not counted), then the forward eagerly on the caller's
        rows and on the padded buffers, declared state restored before each; the largest differences."""
        # Owned copies: an input written into the static rows (GraphRunner.static_rows) is the buffer the
        # replay's forward may change and the padded run stages into.
        inputs = {name: value.clone() for name, value in inputs.items()}
        decision = self.decide(step, variant, context, None)
        key = decision.key
        if self.check_lockstep:
            assert_same_key(self.life.plan.process_group, key)
        with self.life.plan.state.preserved() as restore:
            graph = copy_tree(self.replay(step, variant, context, inputs, decision, count=False))
            restore()
            unpadded = copy_tree(self.eager(context, variant, inputs))
            padded = unpadded
            if key is not None:
                restore()
                self.buffers.stage(step.counts, key, inputs)
                forward = self.life.sets.for_decision(decision).forward
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
