"""Lazy capture (the encoder graph cache): a key is captured the first time a step needs it, at most
``max_graphs`` graphs are kept, the least recently used is evicted, and every hit, miss and eviction
counts."""

from __future__ import annotations

import pytest
import torch

from devgraph import ConfigError, GraphRunner, StaticInput, is_capturing
from devgraph.contract.keys import GraphKey
from devgraph.runner.capture.lazy import LruKeys
from devgraph.runner.options import LazyPolicy

SIZES = [16, 32, 48, 64]
INPUTS = {"x": StaticInput(torch.float32, (3,), fill=0.0)}


class Recorder:
    def __init__(self) -> None:
        self.captures: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if is_capturing():
            self.captures.append(x.shape[0])
        return x * 2 + 1


def lazy_runner(fn, **kwargs) -> GraphRunner:
    kwargs.setdefault("max_graphs", 2)
    runner = GraphRunner(
        fn, phase="encode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES, lazy=True, **kwargs
    )
    runner.capture()
    return runner


def test_capture_on_first_sight_lru_eviction_and_counts():
    fn = Recorder()
    runner = lazy_runner(fn)
    assert runner.keys == [] and fn.captures == []
    steps = [
        (10, [16], ["tokens=16"]),  # miss: captured now
        (12, [], ["tokens=16"]),  # hit
        (30, [32], ["tokens=16", "tokens=32"]),  # miss
        (20, [], ["tokens=16", "tokens=32"]),  # hit: 32 is now the most recently used
        (50, [64], ["tokens=32", "tokens=64"]),  # miss: evicts 16, the least recently used
        (5, [16], ["tokens=16", "tokens=64"]),  # miss again: evicts 32
        (70, [], ["tokens=16", "tokens=64"]),  # past the largest size: eager, the cache is untouched
    ]
    for n, captured, keys in steps:
        fn.captures.clear()
        x = torch.randn(n, 3)
        out = runner.run(x=x)
        torch.testing.assert_close(out, x * 2 + 1)
        assert fn.captures == captured, n
        assert [str(k) for k in runner.keys] == keys, n
    stats = runner.stats()
    assert (stats["lazy"]["hits"], stats["lazy"]["misses"], stats["lazy"]["evictions"]) == (2, 4, 2)
    assert stats["lazy"]["capture_seconds"] > 0
    assert stats["replays_by_key"] == {"tokens=16": 3, "tokens=32": 2, "tokens=64": 1}
    assert stats["eager_by_reason"]["past_largest"] == 1
    assert set(runner.inspect()["keys"]) == {"tokens=16", "tokens=64"}  # evicted keys are gone from inspect


def test_lazy_runner_before_capture_runs_eagerly():
    fn = Recorder()
    runner = GraphRunner(fn, phase="encode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES, lazy=True)
    runner.run(x=torch.ones(10, 3))
    assert fn.captures == [] and runner.stats()["eager_by_reason"]["before_capture"] == 1


def test_lazy_capture_failure_leaves_the_cache_usable():
    def fails_at_32(x: torch.Tensor) -> torch.Tensor:
        if is_capturing() and x.shape[0] == 32:
            x.sum().item()
        return x * 2

    from devgraph import CaptureError

    runner = lazy_runner(fails_at_32)
    runner.run(x=torch.ones(10, 3))
    with pytest.raises(CaptureError, match="tokens=32"):
        runner.run(x=torch.ones(20, 3))
    assert [str(k) for k in runner.keys] == ["tokens=16"]  # the other graph survives
    torch.testing.assert_close(runner.run(x=torch.ones(10, 3)), torch.full((10, 3), 2.0))


def test_lazy_policy_bounds():
    lru = LruKeys(LazyPolicy(max_graphs=None, max_bytes=100))
    for tokens, nbytes in ((1, 40), (2, 40), (3, 40)):
        lru.add(GraphKey(tokens), nbytes)
    assert lru.make_room() == []
    assert lru.over_bytes(keep=GraphKey(3)) == [GraphKey(1)]
    lru.touch(GraphKey(1))
    assert lru.over_bytes(keep=GraphKey(3)) == [GraphKey(2)]
    with pytest.raises(ConfigError, match="max_graphs must be an int >= 1"):
        LazyPolicy(max_graphs=0)
    with pytest.raises(ConfigError, match="max_bytes must be an int >= 0"):
        LazyPolicy(max_bytes=-1)


def test_a_failed_lazy_capture_raises_once_then_runs_eagerly_counted():
    def fails_at_32(x: torch.Tensor) -> torch.Tensor:
        if is_capturing() and x.shape[0] == 32:
            x.sum().item()
        return x * 2

    from devgraph import CaptureError

    runner = lazy_runner(fails_at_32)
    with pytest.raises(CaptureError, match="tokens=32"):
        runner.run(x=torch.ones(20, 3))
    # The same bucket again: no second capture attempt, no error, an eager step counted as not captured.
    torch.testing.assert_close(runner.run(x=torch.ones(20, 3)), torch.full((20, 3), 2.0))
    assert runner.stats()["eager_by_reason"]["not_captured"] == 1
    assert GraphKey(32) not in runner.keys
    assert (runner.bucket(20), runner.bucket(10)) == (None, 16)  # bucket() agrees with run(): 32 runs eagerly


def test_a_lazy_key_whose_layout_fails_is_released_not_left_half_captured():
    # Another output structure at the second bucket: the capture succeeds in the backend, the layout check
    # fails after it; the key must not stay captured (every later step of it would say "already captured").
    def shape_shifter(x: torch.Tensor) -> object:
        return (x * 2,) if x.shape[0] <= 16 else {"y": x * 2}

    from devgraph import ConfigError as LayoutError

    runner = lazy_runner(shape_shifter)
    runner.run(x=torch.ones(10, 3))
    with pytest.raises(LayoutError, match="different output structure"):
        runner.run(x=torch.ones(20, 3))
    assert [str(k) for k in runner.keys] == ["tokens=16"]
    out = runner.run(x=torch.ones(20, 3))  # eager now: no "already captured", no second capture
    torch.testing.assert_close(out["y"], torch.full((20, 3), 2.0))
    assert runner.stats()["eager_by_reason"]["not_captured"] == 1
