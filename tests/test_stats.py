"""Run-time statistics, ``inspect()`` and the optional Prometheus collector, counted over scripted steps."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import devgraph
from devgraph import BackendUnavailableError, GraphRunner, StaticInput, resolve_platform
from devgraph.strategies import FullGraphBackend

SIZES = [1, 2, 4]
INPUTS = {"x": StaticInput(torch.float32, (4,), fill=0.0)}
W = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 10


class Picky(FullGraphBackend):
    """A backend whose ``can_run`` refuses steps whose context says so."""

    def can_run(self, batch):
        return batch.context != "no graph"


def forward(x: torch.Tensor, lora: bool) -> torch.Tensor:
    return x @ W + (1.0 if lora else 0.0)


def x_of(n: int) -> torch.Tensor:
    return torch.ones(n, 4)


def scripted_runner() -> GraphRunner:
    """Runs the scripted sequence the tests below count."""
    runner = GraphRunner(
        forward,
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        sizes=SIZES,
        variants={"lora": (False, True)},
        backend=Picky(resolve_platform("cpu"), phase="decode"),
    )
    off, on = {"lora": False}, {"lora": True}
    runner.run(x=x_of(2), variant=off)  # before capture
    runner.capture()
    runner.run(x=x_of(1), variant=off)  # a captured size
    runner.run(x=x_of(4), variant=on)  # a captured size, the other variant
    runner.run(x=x_of(3), variant=off)  # padded 3 -> 4
    runner.run(x=x_of(3), variant=off)  # again
    runner.run(x=x_of(6), variant=off)  # past the largest size
    runner.run(x=x_of(2), context="no graph", variant=off)  # can_run said no
    runner.run(x=x_of(2), variant={"lora": "maybe"})  # a variant value not declared for capture
    runner.verify(x=x_of(2), variant=off)  # verify is not a step
    return runner


def test_scripted_steps_give_exact_counts():
    stats = scripted_runner().stats()
    assert stats["phase"] == "decode" and stats["backend"] == "full"
    assert stats["steps"] == 8
    assert stats["replays"] == 4
    assert stats["replays_by_key"] == {
        "tokens=1,lora=False": 1,
        "tokens=4,lora=False": 2,
        "tokens=4,lora=True": 1,
    }
    assert stats["eager"] == 4
    assert stats["eager_by_reason"] == {
        "disabled": 0,
        "before_capture": 1,
        "past_largest": 1,
        "axis_past_largest": 0,
        "variant_not_captured": 1,
        "not_captured": 0,
        "capturing": 0,
        "released": 0,
        "backend_declined": 1,
        "peer_eager": 0,
    }
    assert stats["real_rows"] == 1 + 4 + 3 + 3 and stats["padded_rows"] == 2
    assert stats["padding_waste"] == pytest.approx(2 / 11)
    assert stats["verify_calls"] == 1
    assert stats["lazy"] == {"hits": 0, "misses": 0, "evictions": 0, "capture_seconds": 0.0}


def test_reset_stats_zeroes_every_counter():
    runner = scripted_runner()
    runner.reset_stats()
    stats = runner.stats()
    assert stats["steps"] == stats["replays"] == stats["eager"] == 0
    assert stats["replays_by_key"] == {} and set(stats["eager_by_reason"].values()) == {0}
    assert stats["real_rows"] == stats["padded_rows"] == 0 and stats["padding_waste"] == 0.0
    runner.run(x=x_of(3), variant={"lora": True})
    assert runner.stats()["replays_by_key"] == {"tokens=4,lora=True": 1}


def test_disabled_mode_counts_every_step_as_disabled():
    runner = GraphRunner(
        forward,
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        mode="disabled",
        sizes=SIZES,
        variants={"lora": (False,)},
    )
    runner.capture()
    for n in (1, 3, 9):
        runner.run(x=x_of(n), variant={"lora": False})
    stats = runner.stats()
    assert stats["eager_by_reason"]["disabled"] == 3 and stats["steps"] == 3 and stats["replays"] == 0


@devgraph.graph_break("test_stats::scale")
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def with_break(x: torch.Tensor) -> torch.Tensor:
    return scale(x + 1) - 1


@pytest.mark.parametrize(
    ("mode", "per_key", "compiles"),
    [
        ("full", {"graphs": 1, "segments": 1, "break_ops": 0}, 0),
        ("breakable", {"graphs": 2, "segments": 2, "break_ops": 1}, None),
        ("tc_piecewise", {"graphs": 2, "segments": 2, "break_ops": 1}, 1),
    ],
)
def test_inspect_lists_what_was_captured_per_key(mode, per_key, compiles):
    # Rows of 5: no captured size equals the row width (see test_compile.py for why that matters).
    inputs = {"x": StaticInput(torch.float32, (5,), fill=0.0)}
    runner = GraphRunner(with_break, phase="decode", inputs=inputs, device="cpu", mode=mode, sizes=[2, 4])
    before = runner.inspect()
    assert before["captured"] is False and before["keys"] == {}
    runner.capture()
    info = runner.inspect()
    assert info["phase"] == "decode" and info["backend"] == mode and info["platform"] == "cpu"
    assert info["captured"] is True and info["warmup_iters"] == 2
    assert info["schedule"]["token_sizes"] == [2, 4]
    assert info["inputs"] == {"x": "x: torch.float32 (n, 5) on the device, fill 0.0"}
    assert set(info["keys"]) == {"tokens=2", "tokens=4"}
    for key in info["keys"].values():
        assert {k: key[k] for k in per_key} == per_key
        assert key["capture_seconds"] > 0 and key["pool_bytes"] >= 0
    assert info["pool_bytes"] == sum(k["pool_bytes"] for k in info["keys"].values())
    if compiles is not None:
        assert info["compiles"] == compiles and info["recompiles"] == 0
    runner.close()
    assert runner.inspect()["keys"] == {}


# -- Prometheus -----------------------------------------------------------------------------------------
needs_prometheus = pytest.mark.skipif(
    importlib.util.find_spec("prometheus_client") is None,
    reason="prometheus_client is not installed (optional extra: pip install prometheus-client)",
)


@needs_prometheus
def test_prometheus_collector_exposes_the_counters():
    from prometheus_client import CollectorRegistry, generate_latest

    from devgraph.runner.metrics import register_runners

    runner = scripted_runner()
    registry = CollectorRegistry()
    collector = register_runners(runner, registry=registry)
    labels = {"phase": "decode", "backend": "full"}
    value = registry.get_sample_value
    assert value("devgraph_replays_total", {**labels, "key": "tokens=4,lora=False"}) == 2
    assert value("devgraph_replays_total", {**labels, "key": "tokens=1,lora=False"}) == 1
    assert value("devgraph_eager_steps_total", {**labels, "reason": "past_largest"}) == 1
    assert value("devgraph_eager_steps_total", {**labels, "reason": "backend_declined"}) == 1
    assert value("devgraph_eager_steps_total", {**labels, "reason": "not_captured"}) == 0
    assert value("devgraph_real_rows_total", labels) == 11
    assert value("devgraph_padded_rows_total", labels) == 2
    for name in ("hits", "misses", "evictions"):
        assert value(f"devgraph_lazy_{name}_total", labels) == 0
    for reason in ("backend_declined", "not_captured"):  # no fallback graph set: nothing replayed by one
        assert value("devgraph_fallback_replays_total", {**labels, "reason": reason}) == 0
    runner.run(x=x_of(3), variant={"lora": False})  # read at scrape time: no step pays for metrics
    assert value("devgraph_replays_total", {**labels, "key": "tokens=4,lora=False"}) == 3
    assert b"devgraph_eager_steps_total" in generate_latest(registry)
    collector.remove(runner)
    assert value("devgraph_real_rows_total", labels) is None


@needs_prometheus
def test_prometheus_collector_labels_each_runner():
    from prometheus_client import CollectorRegistry

    from devgraph.runner.metrics import register_runners

    decode = GraphRunner(
        forward,
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        mode="full",
        sizes=[2],
        variants={"lora": (False,)},
    )
    prefill = GraphRunner(
        forward,
        phase="prefill",
        inputs=INPUTS,
        device="cpu",
        mode="breakable",
        sizes=[4],
        variants={"lora": (False,)},
    )
    registry = CollectorRegistry()
    collector = register_runners(decode, registry=registry)
    collector.add(prefill)
    collector.add(prefill)  # once only
    for runner in (decode, prefill):
        runner.capture()
        runner.run(x=x_of(1), variant={"lora": False})
    value = registry.get_sample_value
    assert (
        value("devgraph_replays_total", {"phase": "decode", "backend": "full", "key": "tokens=2,lora=False"})
        == 1
    )
    assert (
        value(
            "devgraph_replays_total",
            {"phase": "prefill", "backend": "breakable", "key": "tokens=4,lora=False"},
        )
        == 1
    )
    assert value("devgraph_padded_rows_total", {"phase": "prefill", "backend": "breakable"}) == 3


def test_metrics_without_prometheus_client_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    from devgraph.runner.metrics import RunnerCollector, register_runners

    hint = (
        r"devgraph.runner.metrics needs prometheus_client, "
        r"which is not installed: pip install 'devgraph\[metrics\]'"
    )
    with pytest.raises(BackendUnavailableError, match=hint):
        register_runners()
    with pytest.raises(BackendUnavailableError, match=hint):
        RunnerCollector()
