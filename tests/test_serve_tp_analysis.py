"""``benchmarks/serve_tp/analysis.py``: the host figures ``serve_tp_check.py`` draws from the servers' step
timelines (rank 0's spans and runs, a worker's spans), on timelines written by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _analysis() -> ModuleType:
    path = ROOT / "benchmarks" / "serve_tp" / "analysis.py"
    spec = importlib.util.spec_from_file_location("serve_tp_analysis_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _span(step: int, phase: str, host: float, issue_ms: float) -> dict[str, Any]:
    # The thread ran for 40% of each issue and waited for the rest.
    return {"phase": phase, "step": step, "tokens": 1, "requests": 1, "host_s": host,
            "host_end_s": host + issue_ms / 1e3, "host_cpu_ms": 0.4 * issue_ms,
            "device_start_ms": 0.0, "device_end_ms": 0.0}  # fmt: skip


def _run(host: float, run_ms: float) -> dict[str, Any]:
    return {"phase": "decode", "tokens": 1, "requests": 1, "host_s": host, "host_end_s": host + run_ms / 1e3,
            "device_start_ms": 0.0, "device_end_ms": 0.0}  # fmt: skip


def test_a_decode_issue_is_split_at_its_run_and_matched_to_the_worker_by_step() -> None:
    hosts = _analysis().hosts
    # Rank 0: a forward every 4 ms from t=10 s, each issued in 1 ms: 0.2 ms before its run, a 0.5 ms run,
    # 0.3 ms after it; step 3 is a prefill (its run is the prefill runner's, not split).
    spans, runs, worker = [], [], []
    for step in range(6):
        start = 10.0 + 0.004 * step
        phase = "prefill" if step == 3 else "decode"
        spans.append(_span(step, phase, start, 1.0))
        runs.append(_run(start + 0.0002, 0.5))
        # The worker gets each step 0.15 ms after rank 0 began it and issues it in 0.6 ms.
        worker.append(_span(step, phase, start + 0.00015, 0.6))
    # Runs no span of the window holds: warm-up ones before it, and one between two spans (a step whose
    # span was not recorded); and a decode span whose run went unrecorded (the limit): none is split.
    runs += [_run(9.0, 7.0), _run(9.5, 9.0), _run(10.0035, 9.0)]
    spans.append(_span(6, "decode", 10.0185, 1.0))  # the next run found (step 5's) ends after it: not its
    spans.sort(key=lambda span: span["host_s"])
    found = hosts(spans, runs, worker, 10.0, 10.1)
    assert found["kinds"] == {"decode": 6, "prefill": 1}
    assert abs(found["issue_ms"]["p50"] - 1.0) < 1e-6
    assert abs(found["cadence_ms"]["p50"] - 4.0) < 1e-6  # 4, 4, 4, 4, 2.5, 1.5
    decode = found["decode"]
    assert all(decode[part]["mean"] == decode[part]["p50"] for part in ("before_run_ms", "run_ms"))
    assert abs(decode["before_run_ms"]["p50"] - 0.2) < 1e-6
    assert abs(decode["run_ms"]["p50"] - 0.5) < 1e-6
    assert abs(decode["after_run_ms"]["p50"] - 0.3) < 1e-6
    assert abs(decode["cpu_ms"]["p50"] - 0.4) < 1e-6 and abs(decode["waiting_share"] - 0.6) < 1e-4
    got = found["worker"]
    assert got["steps_matched"] == 6
    assert abs(got["lag_ms"]["p50"] - 0.15) < 1e-6
    assert abs(got["issue_ms"]["p50"] - 0.6) < 1e-6
    assert abs(got["behind_ms"]["p50"] - 3.4) < 1e-6  # 4 ms apart, 0.6 of them issuing


def test_only_the_window_counts_and_a_timeline_without_host_ends_gives_nothing() -> None:
    hosts = _analysis().hosts
    spans = [_span(0, "decode", 5.0, 1.0), _span(1, "decode", 20.0, 2.0), _span(2, "decode", 20.004, 3.0)]
    found = hosts(spans, [], [], 19.0, 21.0)
    assert found["kinds"] == {"decode": 2} and "worker" not in found
    assert abs(found["issue_ms"]["p50"] - 2.5) < 1e-6
    assert found["decode"]["run_ms"] == {}  # no runs timed: no split
    old = [{k: v for k, v in s.items() if k != "host_end_s"} for s in spans]  # a server before the field
    assert hosts(old, [], [], 0.0, 100.0) == {}
