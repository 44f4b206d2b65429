"""``GraphRunner.inspect()``: what a runner set up and captured, as plain data."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.keys import GraphKey
from devgraph.runner.capture.job import KeyReport
from devgraph.runner.options import RunnerPlan
from devgraph.runner.outputs.layout import OutputLayout

__all__ = ["describe_runner"]


def describe_runner(
    plan: RunnerPlan,
    backend: DeviceGraphBackend,
    reports: Mapping[GraphKey, KeyReport],
    layout: OutputLayout,
    captured: bool,
) -> dict[str, Any]:
    """Per key: graphs, segments, break ops, capture seconds and pool bytes; the schedule, inputs,
    output layout, declared state, and the backend's compiles and recompiles."""
    keys = {}
    for key in sorted(backend.captured_keys(), key=GraphKey.sort_key):
        report = reports.get(key)
        keys[str(key)] = {
            "capture_seconds": report.seconds if report else None,
            "pool_bytes": report.bytes if report else None,
            **backend.describe_key(key),
        }
    return {
        "phase": plan.phase,
        "backend": backend.name,
        "platform": plan.platform.name,
        "device": str(plan.device),
        "mode": str(plan.flag),
        "downgrades": [d.rule for d in plan.resolved.downgrades],
        "eager_reason": plan.resolved.eager_reason,
        "captured": captured,
        "lazy": plan.capture.lazy,
        "warmup_iters": plan.capture.warmup_iters,
        "schedule": plan.schedule.describe(),
        "inputs": {name: spec.describe(name) for name, spec in plan.inputs.items()},
        "outputs": layout.describe(),
        "state": plan.state.describe(),
        "keys": keys,
        "pool_bytes": sum(r.bytes for r in reports.values()),
        **backend.describe(),
    }
