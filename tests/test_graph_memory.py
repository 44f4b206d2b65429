"""Graph memory before the KV cache: ``estimate_graph_memory()`` captures a few keys into a throw-away pool,
gives every byte back and predicts every key; ``graph_memory()`` is exact per key after capture (CPU
simulated graphs, whose pool counts the bytes of the storages each graph holds)."""

from __future__ import annotations

import gc

import pytest
import torch

from devgraph import ConfigError, GraphRunner, StaticInput
from devgraph.contract.keys import GraphKey
from devgraph.platforms.sim.device_memory import reserved_bytes
from devgraph.runner.memory import GraphMemoryEstimate, fit_bytes, probe_keys

pytestmark = pytest.mark.timeout(120)

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
INPUTS = {"x": StaticInput(torch.float32, (16,), fill=0.0)}
torch.manual_seed(0)
W1, W2 = torch.randn(16, 64), torch.randn(64, 16)


def forward(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ W1) @ W2


def make(**kwargs) -> GraphRunner:
    kwargs.setdefault("mode", "full")
    return GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", sizes=SIZES, **kwargs)


def test_probe_keys_take_the_largest_the_smallest_and_spread_the_rest():
    keys = [GraphKey(t) for t in SIZES]
    assert [k.tokens for k in probe_keys(keys, 3)] == [64, 48, 1]
    assert [k.tokens for k in probe_keys(keys, 4)] == [64, 48, 8, 1]
    assert [k.tokens for k in probe_keys(keys[:2], 3)] == [2, 1]


def test_fit_bytes_is_piecewise_linear_and_extends_the_end_segments():
    points = {1: 100, 5: 500, 9: 1300}
    assert fit_bytes(points, 3) == 300 and fit_bytes(points, 7) == 900
    assert fit_bytes(points, 11) == 1700 and fit_bytes(points, 0) == 0
    assert fit_bytes({4: 40}, 100) == 40 and fit_bytes({}, 3) == 0


@pytest.mark.parametrize("lazy", [False, True])
def test_estimate_before_capture_is_close_and_gives_every_byte_back(lazy):
    runner = make(lazy=lazy)
    gc.collect()  # pools of earlier tests' runners go now, not while this test measures
    base = reserved_bytes()
    estimate = runner.estimate_graph_memory(probes=3)
    assert isinstance(estimate, GraphMemoryEstimate)
    assert reserved_bytes() == base and runner.keys == []  # the throw-away pool is gone
    assert len(estimate.probed) == 3 and set(estimate.by_key) == {str(GraphKey(t)) for t in SIZES}
    assert estimate.total_bytes == sum(estimate.by_key.values()) > 0
    with pytest.raises(AttributeError):
        estimate.total_bytes = 0  # type: ignore[misc]  # frozen
    runner.capture()
    if lazy:
        for n in SIZES:
            runner.run(x=torch.ones(n, 16))  # a lazy runner captures each key on first sight
    measured = runner.graph_memory()
    assert measured.total_bytes == reserved_bytes() - base
    assert abs(estimate.total_bytes - measured.total_bytes) <= 0.10 * measured.total_bytes
    for key, nbytes in estimate.probed.items():  # probed keys: the same bytes as their real capture
        assert nbytes == pytest.approx(measured.by_key[key], rel=0.10)
    assert runner.stats()["graph_memory"] == measured.as_dict() == runner.inspect()["graph_memory"]
    runner.close()


def test_estimate_leaves_the_runner_as_before_capture():
    runner = make()
    x = torch.randn(5, 16)
    expected = forward(x)
    runner.estimate_graph_memory()
    runner.run(x=x)
    assert runner.stats()["eager_by_reason"]["before_capture"] == 1
    runner.capture()
    assert torch.equal(runner.run(x=x, copy=True), runner.run(x=x, copy=True))
    torch.testing.assert_close(runner.run(x=x), expected)
    assert len(runner.report.keys) == len(SIZES)
    runner.close()


def test_estimate_after_capture_is_refused_and_eager_mode_has_none():
    runner = make()
    runner.capture()
    with pytest.raises(ConfigError, match="graph_memory"):
        runner.estimate_graph_memory()
    with pytest.raises(ConfigError, match="probes"):
        make().estimate_graph_memory(probes=1)
    runner.close()
    eager = make(mode="eager")
    assert eager.estimate_graph_memory().total_bytes == 0
    eager.close()
