"""Phases as data: one PhaseSpec per phase that the size checks, the key schedule and ``auto`` read; verify
gets a default mode on every platform that runs decode's, and ``auto`` never picks no graphs without saying
why (a warning and ``inspect()``)."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
import torch

from devgraph import PHASES, GraphRunner, Phase, StaticInput, create_backend
from devgraph.contract.phases import PHASE_SPECS, PhaseSpec
from devgraph.flag.factory import auto_mode
from devgraph.flag.sizes import HARD_MAX_SIZE, default_max_size, resolve_sizes
from devgraph.platforms.sim.platform import CpuSimPlatform
from devgraph.registry.plugins import Registry
from devgraph.strategies import FullGraphBackend

INPUTS = {"x": StaticInput(torch.float32, (4,), fill=0.0)}


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_every_phase_has_one_spec_that_the_size_tables_read():
    assert set(PHASE_SPECS) == set(Phase) and tuple(p.value for p in Phase) == PHASES
    for phase, spec in PHASE_SPECS.items():
        assert isinstance(spec, PhaseSpec) and phase.spec is spec and phase.uniform == spec.uniform
        assert HARD_MAX_SIZE[phase.value] == spec.hard_max_size
        assert default_max_size(phase.value, None) == spec.largest_default
        top = spec.largest_default
        assert resolve_sizes(phase.value).sizes == tuple(
            sorted({s for s in spec.default_sizes if s < top} | {top})
        )
    assert Phase.VERIFY.spec.like is Phase.DECODE and Phase.ENCODE.spec.like is Phase.PREFILL


def test_a_uniform_phase_pads_whole_requests_by_the_same_rule():
    # decode and verify share one path: default sizes are requests times the tokens per request
    decode = GraphRunner(double, phase="decode", inputs=INPUTS, device="cpu", max_size=8)
    verify = GraphRunner(
        double, phase="verify", inputs=INPUTS, device="cpu", max_size=32, tokens_per_request=4
    )
    assert decode.sizes == (1, 2, 4, 8)
    assert verify.sizes == tuple(4 * s for s in decode.sizes)


def test_verify_auto_captures_graphs_on_the_cpu():
    # before: verify had no default anywhere, so auto resolved it to eager silently
    assert type(create_backend("cpu", "verify")) is FullGraphBackend
    runner = GraphRunner(
        double, phase="verify", inputs=INPUTS, device="cpu", sizes=[4, 8], tokens_per_request=4
    )
    assert runner.backend.name == "full" and runner.inspect()["eager_reason"] is None
    runner.capture()
    runner.run(x=torch.ones(4, 4))
    assert runner.stats()["replays"] == 1
    runner.close()


class LonelyPlatform(CpuSimPlatform):
    """A CPU platform whose plug-in registers ``full`` for decode only (it outranks the simulator)."""

    name: ClassVar[str] = "lonely"
    priority: ClassVar[int] = 100


@pytest.fixture
def lonely(monkeypatch: pytest.MonkeyPatch) -> Registry:
    registry = Registry(entry_points=False).load()
    registry.add_platform(LonelyPlatform, origin="test")
    registry.add_backend(FullGraphBackend, name="full", platform="lonely", phases=("decode",), origin="test")
    monkeypatch.setattr("devgraph.registry.plugins._registry", registry)
    return registry


def test_auto_follows_the_spec_then_the_phase_it_is_like(lonely: Registry):
    assert auto_mode("lonely", "decode", lonely) == ("full", None)
    mode, why = auto_mode("lonely", "prefill", lonely)
    assert mode == "eager" and why is not None
    assert "no backend there takes the phase" in why and "'breakable' (prefill's default)" in why
    mode, why = auto_mode("lonely", "verify", lonely)  # full takes decode only: verify finds none
    assert mode == "eager" and why is not None and "'full' (verify's default)" in why


def test_auto_says_why_it_picks_no_graphs(lonely: Registry, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="devgraph")
    runner = GraphRunner(double, phase="prefill", inputs=INPUTS, device="cpu", sizes=[4])
    assert runner.platform.name == "lonely" and runner.backend.name == "eager"
    reason = runner.inspect()["eager_reason"]
    assert reason is not None and "auto runs prefill eagerly on lonely" in reason
    assert reason in caplog.text
    runner.run(x=torch.ones(3, 4))
    assert runner.stats()["eager_by_reason"]["disabled"] == 1
