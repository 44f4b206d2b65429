"""Serving before the graphs are ready: steps run eagerly while the keys are captured one at a time, each
key switches to its graph once captured, no step overlaps a capture, declared state is untouched by the
warm-ups, and outputs are bitwise those of a runner captured up front (CPU simulated graphs)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from switching import tokens_across_the_switch

from devgraph import BackgroundCapture, CaptureError, ConfigError, GraphRunner, StaticInput, is_capturing
from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.engine import EngineConfig, SamplingParams

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

SIZES = [2, 4, 8]
INPUTS = {"x": StaticInput(torch.float32, (16,), fill=0.0)}


class Stateful:
    """A forward that advances a step counter (declared state) and checks that no two runs overlap."""

    def __init__(self, fail_at: int | None = None) -> None:
        torch.manual_seed(0)
        self.weight = torch.randn(16, 16)
        self.step = torch.zeros(1)
        self.fail_at = fail_at
        self.active = 0
        self.overlaps = 0
        self.lock: Any = None
        self.held: list[bool] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.active += 1
        try:
            if self.active > 1:
                self.overlaps += 1
            if self.lock is not None:
                self.held.append(self.lock._is_owned())
            if self.fail_at == x.shape[0] and is_capturing():
                x.sum().item()  # a host sync: the capture of this key fails
            self.step.add_(1)
            return torch.tanh(x @ self.weight) + self.step
        finally:
            self.active -= 1


def _runner(fn: Stateful, **kwargs: object) -> GraphRunner:
    kwargs.setdefault("mode", "full")
    return GraphRunner(
        fn, phase="decode", inputs=INPUTS, device="cpu", sizes=SIZES, state=[fn.step], **kwargs
    )


def _inputs(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(SIZES[i % 3], 16, generator=generator) for i in range(count)]


def test_half_the_steps_before_the_graphs_equal_graphs_up_front_bitwise() -> None:
    steps = _inputs(12)
    ahead_fn = Stateful()
    ahead = _runner(ahead_fn)
    ahead.capture()
    expected = [ahead.run(x=x, copy=True) for x in steps]

    fn = Stateful()
    runner = _runner(fn)
    background = BackgroundCapture([runner])
    assert (background.total, background.captured, background.done) == (3, 0, False)
    outputs, visible = [], []
    for i, x in enumerate(steps):
        if i >= len(steps) // 2:
            background.step()  # one key between two steps
        visible.append([str(k) for k in runner.keys])
        outputs.append(runner.run(x=x, copy=True))
    for got, want in zip(outputs, expected, strict=True):
        assert torch.equal(got, want)
    # The warm-ups and captures left the counter as the steps alone advanced it.
    assert torch.equal(fn.step, ahead_fn.step) and fn.step.item() == len(steps)
    # Largest key first, one per step, each visible only once captured.
    assert visible[5:9] == [[], ["tokens=8"], ["tokens=4", "tokens=8"], ["tokens=2", "tokens=4", "tokens=8"]]
    stats = runner.stats()
    assert stats["eager_by_reason"]["capturing"] == 7 and stats["replays"] == 5
    assert background.done and background.progress()["ready"] and runner.report is not None
    assert [r.key.tokens for r in runner.report.keys] == SIZES
    assert runner.capture() is runner.report  # nothing left to capture
    assert runner.inspect()["background"] is None


def test_a_capture_thread_never_overlaps_a_step() -> None:
    fn = Stateful()
    runner = _runner(fn)
    background = BackgroundCapture([runner]).start(pause=0.0)
    steps = _inputs(60)
    reference = Stateful()
    for x in steps:
        got = runner.run(x=x, copy=True)
        assert torch.equal(got, reference(x.clone()))
    assert background.wait(60)
    for x in steps[:6]:
        assert torch.equal(runner.run(x=x, copy=True), reference(x.clone()))
    assert fn.overlaps == 0 and background.error is None
    assert [k.tokens for k in runner.keys] == SIZES
    assert runner.stats()["replays"] >= 6


def test_a_failed_key_releases_the_graphs_and_steps_stay_eager(caplog: pytest.LogCaptureFixture) -> None:
    fn = Stateful(fail_at=4)
    runner = _runner(fn)
    background = BackgroundCapture([runner])
    assert background.step()  # tokens=8 captured
    with pytest.raises(CaptureError, match="tokens=4"):
        background.step()
    assert runner.keys == [] and background.done and not background.progress()["ready"]
    assert "tokens=4" in background.progress()["error"]
    x = torch.randn(8, 16)
    runner.run(x=x)
    assert runner.stats()["eager_by_reason"]["before_capture"] == 1
    with pytest.raises(CaptureError):
        background.finish()


def test_abandon_stops_without_an_error_and_a_new_capture_takes_the_keys_again() -> None:
    done, capturing = _runner(Stateful()), _runner(Stateful())
    background = BackgroundCapture([done, capturing])
    while background.step() and not capturing.keys:
        pass
    assert done.keys and capturing.keys and not background.done
    background.abandon()
    assert background.done and background.error is None and not background.progress()["ready"]
    assert capturing.keys == [] and len(done.keys) == len(SIZES)  # a finished runner keeps its graphs
    capturing.run(x=torch.randn(8, 16))
    assert capturing.stats()["eager_by_reason"]["before_capture"] == 1
    again = BackgroundCapture([done, capturing])
    assert again.total == len(SIZES)
    again.finish()
    assert [k.tokens for k in sorted(capturing.keys, key=lambda k: k.tokens)] == sorted(SIZES)


def test_capture_finishes_the_rest_and_refresh_close_retune_behave() -> None:
    fn = Stateful()
    runner = _runner(fn)
    background = BackgroundCapture([runner])
    background.step()
    with pytest.raises(ConfigError, match="background"):
        runner.retune([2, 8])
    report = runner.capture()  # the two keys left, now
    assert [r.key.tokens for r in report.keys] == SIZES and background.done
    other = _runner(Stateful())
    second = BackgroundCapture([other])
    second.step()
    other.refresh()  # stops the background capture and captures every key
    assert len(other.keys) == 3 and other.inspect()["background"] is None
    third = _runner(Stateful())
    BackgroundCapture([third]).step()
    third.close()
    assert third.keys == []


def test_runners_it_cannot_take() -> None:
    fn = Stateful()
    with pytest.raises(ConfigError, match="fallback"):
        BackgroundCapture([_runner(fn, fallback="breakable")])
    single = _runner(Stateful(), single_thread=True)
    with pytest.raises(ConfigError, match="single_thread"):
        BackgroundCapture([single]).start()
    eager = _runner(Stateful(), mode="eager")
    assert BackgroundCapture([eager]).done


def test_engine_tokens_unchanged_across_the_switch_in_deterministic_mode() -> None:
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4), seed=0)
    config = EngineConfig(max_running_requests=4, token_budget=32, deterministic=True)
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (int(n),), generator=rng).tolist() for n in (5, 17, 9, 30)]
    params = SamplingParams(max_tokens=10)
    # The first five steps run before any graph exists.
    expected, got, engine = tokens_across_the_switch(model, config, prompts, params, eager_steps=5)
    assert got == expected
    runners = engine.stats()["runners"]
    assert runners["decode"]["eager_by_reason"]["capturing"] > 0 and runners["decode"]["replays"] > 0
    assert engine.stats()["graph_capture"]["ready"]
    engine.close()


def test_the_engine_lock_is_held_around_each_key() -> None:
    lock = threading.RLock()
    fn = Stateful()
    fn.lock = lock
    BackgroundCapture([_runner(fn)], lock=lock).finish()
    assert fn.held and all(fn.held)  # every warm-up and capture ran under the lock
