"""Capture in the background on CUDA: outputs identical to graphs captured up front, from the engine's own
thread (one key between two steps) and from a capture thread that takes the runner's lock per key."""

from __future__ import annotations

import pytest
import torch
from switching import tokens_across_the_switch

from devgraph import BackgroundCapture, GraphRunner, StaticInput
from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.engine import EngineConfig, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

SIZES = [8, 16, 32]


class Counter:
    """A forward that advances a device-side step counter (declared state)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.randn(256, 256, generator=generator).cuda()
        self.step = torch.zeros(1, device="cuda")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)
        return torch.relu(x @ self.weight) @ self.weight + self.step


def _runner(fn: Counter) -> GraphRunner:
    inputs = {"x": StaticInput(torch.float32, (256,), fill=0.0)}
    return GraphRunner(
        fn, phase="decode", inputs=inputs, device="cuda", mode="full", sizes=SIZES, state=[fn.step]
    )


def _steps(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(SIZES[i % 3], 256, generator=generator).cuda() for i in range(count)]


def _up_front(steps: list[torch.Tensor]) -> list[torch.Tensor]:
    runner = _runner(Counter())
    runner.capture()
    out = [runner.run(x=x, copy=True) for x in steps]
    runner.close()
    return out


def test_key_by_key_between_steps_gives_identical_outputs() -> None:
    steps = _steps(12)
    expected = _up_front(steps)
    fn = Counter()
    runner = _runner(fn)
    background = BackgroundCapture([runner])
    got = []
    for i, x in enumerate(steps):
        if i >= 6:
            background.step()
        got.append(runner.run(x=x, copy=True))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert fn.step.item() == len(steps)
    stats = runner.stats()
    assert stats["eager_by_reason"]["capturing"] > 0 and stats["replays"] > 0
    runner.close()


def test_a_capture_thread_gives_identical_outputs() -> None:
    steps = _steps(90)
    expected = _up_front(steps)
    fn = Counter()
    runner = _runner(fn)
    background = BackgroundCapture([runner]).start(pause=0.0)
    got = [runner.run(x=x, copy=True) for x in steps]
    assert background.wait(120) and background.error is None
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert fn.step.item() == len(steps)
    runner.close()


def test_engine_tokens_identical_across_the_switch() -> None:
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=8), device="cuda", seed=0)
    config = EngineConfig(8, 64, deterministic=True)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 500, (int(n),), generator=generator).tolist() for n in (3, 20, 41, 9)]
    params = SamplingParams(max_tokens=16)
    expected, got, engine = tokens_across_the_switch(model, config, prompts, params, eager_steps=4)
    assert got == expected
    assert engine.stats()["runners"]["decode"]["eager_by_reason"]["capturing"] > 0
    engine.close()
