"""A second graph set: steps the primary strategy declines replay the fallback strategy's graphs, counted by
reason; the flag states it; capture leaves a key the primary cannot capture to the fallback."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import host_read_at_four

from devgraph import GraphRunner, StaticInput
from devgraph.contract.keys import Batch
from devgraph.errors import CaptureError, ConfigError
from devgraph.flag.config import DeviceGraphConfig
from devgraph.flag.factory import resolve_platform
from devgraph.strategies.full import FullGraphBackend

INPUTS = {"x": StaticInput(torch.float32, (4,))}
SIZES = [2, 4, 8]
FALLBACK = '{"decode": {"backend": "full", "fallback": "breakable"}}'


def forward(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(host_read_at_four(x * 1.5)) + x


class Declining(FullGraphBackend):
    """``full`` that declines the steps whose context asks it to (a veto, as a backend gives one)."""

    def can_run(self, batch: Batch) -> bool:
        return batch.context != "decline"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"decode": {"backend": "full", "fallback": "full"}}', "is the phase's own mode"),
        ('{"decode": {"backend": "full", "fallback": "eager"}}', "captures no graphs"),
        ('{"decode": {"backend": "full", "fallback": "auto"}}', "captures no graphs"),
        ('{"decode": {"backend": "disabled", "fallback": "breakable"}}', "backs a mode that captures"),
        ('{"decode": {"backend": "full", "fallback": "breakable", "lazy": true}}', "drop one of them"),
        ('{"decode": {"backend": "full", "fallback": "brekable"}}', "did you mean 'breakable'"),
    ],
)
def test_the_flag_checks_the_fallback(value, message):
    with pytest.raises(ConfigError, match=message):
        DeviceGraphConfig.parse(value)


def test_the_flag_holds_the_fallback():
    config = DeviceGraphConfig.parse(FALLBACK)
    assert config.for_phase("decode").fallback == "breakable"
    assert config.for_phase("decode").to_json() == {"backend": "full", "fallback": "breakable"}


def plain(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * 1.5) + x


def test_a_backend_veto_replays_the_fallback_graph():
    platform = resolve_platform("cpu")
    forward = plain
    runner = GraphRunner(
        forward,
        phase="decode",
        inputs=INPUTS,
        sizes=SIZES,
        backend=Declining(platform, phase="decode"),
        config=FALLBACK,
    )
    report = runner.capture()
    assert [r.key.tokens for r in report.fallback] == [2, 4, 8] and not report.failed
    x = torch.randn(3, 4)
    for context in (None, "decline", "decline"):
        torch.testing.assert_close(runner.run(x=x, context=context), forward(x))
    stats = runner.stats()
    assert stats["replays"] == 3 and stats["eager"] == 0
    assert stats["fallback"] == {"replays": 2, "by_reason": {"backend_declined": 2, "not_captured": 0}}
    inspected = runner.inspect()["fallback"]
    assert inspected["backend"] == "breakable" and len(inspected["keys"]) == 3
    assert inspected["keys"]["tokens=4"] == {"graphs": 1, "segments": 1, "break_ops": 0}
    result = runner.verify(x=x, context="decline")
    assert result.replayed and result.ok


def test_a_key_the_primary_cannot_capture_is_left_to_the_fallback(caplog):
    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, sizes=SIZES, device="cpu", config=FALLBACK)
    report = runner.capture()
    assert [str(k) for k in report.failed] == ["tokens=4"] and "host" in report.failed[
        next(iter(report.failed))
    ]
    assert "breakable fallback's graph will replay it" in caplog.text
    assert "failed, the fallback replays it" in report.table()
    assert [k.tokens for k in runner.keys] == [2, 8]
    for n in (1, 3, 4, 7):
        x = torch.randn(n, 4)
        torch.testing.assert_close(runner.run(x=x), forward(x))
    stats = runner.stats()
    assert stats["fallback"]["by_reason"] == {"backend_declined": 0, "not_captured": 2}
    assert stats["replays_by_key"] == {"tokens=2": 1, "tokens=4": 2, "tokens=8": 1}


def test_without_a_fallback_the_same_failure_fails_capture():
    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, sizes=SIZES, device="cpu", mode="full")
    with pytest.raises(CaptureError, match="tokens=4"):
        runner.capture()
    assert runner.keys == []


def test_a_key_neither_set_can_capture_fails_capture_and_leaves_no_graphs():
    def broken(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 4:
            return x * float(x.sum().item() >= 0)  # a host read in a segment: no strategy captures it
        return x + 1

    runner = GraphRunner(broken, phase="decode", inputs=INPUTS, sizes=SIZES, device="cpu", config=FALLBACK)
    with pytest.raises(CaptureError, match="tokens=4"):
        runner.capture()
    assert runner.keys == [] and runner.inspect()["fallback"]["keys"] == {}


def test_the_fallback_is_dropped_when_the_phase_resolves_to_it(caplog):
    caplog.set_level(logging.INFO, logger="devgraph")
    # auto resolves to full for decode on the CPU: a full fallback behind full is no second set.
    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, sizes=SIZES, device="cpu", fallback="full")
    assert runner.backend.name == "full"
    assert runner.inspect()["fallback"] is None and "fallback full dropped" in caplog.text


def test_the_fallback_shares_the_primary_pool():
    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, sizes=SIZES, device="cpu", config=FALLBACK)
    runner.capture()
    pool = runner.inspect()["pool"]
    assert pool["name"] == "decode" and pool["runners"] == ["decode:full"]
    runner.close()
    assert runner.pool is not None and runner.pool.runners == []
