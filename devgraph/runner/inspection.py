"""``GraphRunner.inspect()``: what a runner set up and captured, as plain data."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from devgraph.contract.keys import GraphKey
from devgraph.runner.capture.loop import KeyReport
from devgraph.runner.outputs.layout import OutputLayout
from devgraph.runner.state import DeclaredState

__all__ = ["describe_runner"]


def describe_runner(
    runner: Any, reports: Mapping[GraphKey, KeyReport], layout: OutputLayout, state: DeclaredState
) -> dict[str, Any]:
    """Per key: graphs, segments, break ops, capture seconds and pool bytes; the schedule, inputs,
    output layout, declared state, and the backend's compiles and recompiles."""
    keys = {}
    for key in runner.keys:
        report = reports.get(key)
        keys[str(key)] = {
            "capture_seconds": report.seconds if report else None,
            "pool_bytes": report.bytes if report else None,
            **runner.backend.describe_key(key),
        }
    return {
        "phase": runner.phase,
        "backend": runner.backend.name,
        "platform": runner.platform.name,
        "device": str(runner.device),
        "mode": str(runner.config),
        "downgrades": [d.rule for d in runner.resolved.downgrades],
        "captured": runner.report is not None,
        "lazy": runner.lazy,
        "warmup_iters": runner.warmup_iters,
        "schedule": runner.schedule.describe(),
        "inputs": {name: spec.describe(name) for name, spec in runner.input_specs.items()},
        "outputs": layout.describe(),
        "state": state.describe(),
        "keys": keys,
        "pool_bytes": sum(r.bytes for r in reports.values()),
        **runner.backend.describe(),
    }
