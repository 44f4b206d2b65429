"""What a runner's plan resolved, read as the runner's own attributes (``runner.phase``, ``runner.sizes``,
...): one place for these read-only views, so the runner's module keeps to what it does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from devgraph.contract.inputs import StaticInput
from devgraph.flag.config import DeviceGraphConfig
from devgraph.flag.factory import ResolvedPhase
from devgraph.runner.plan import RunnerPlan
from devgraph.runner.schedule import KeySchedule


class PlanView:
    """Read-only properties over ``self.plan`` (a :class:`~devgraph.runner.plan.RunnerPlan`)."""

    plan: RunnerPlan

    # -- what the plan resolved --------------------------------------------
    @property
    def phase(self) -> str:
        return self.plan.phase

    @property
    def platform(self) -> Any:
        return self.plan.platform

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def input_specs(self) -> Mapping[str, StaticInput]:
        return self.plan.inputs

    @property
    def schedule(self) -> KeySchedule:
        return self.plan.schedule

    @property
    def tokens_per_request(self) -> int | None:
        return self.plan.tokens_per_request

    @property
    def warmup_iters(self) -> int:
        return self.plan.capture.warmup_iters

    @property
    def lazy(self) -> bool:
        return self.plan.capture.lazy

    @property
    def config(self) -> DeviceGraphConfig:
        return self.plan.flag

    @property
    def resolved(self) -> ResolvedPhase:
        return self.plan.resolved

    @property
    def sizes(self) -> tuple[int, ...]:
        """The token sizes this runner captures."""
        return self.schedule.token_sizes
