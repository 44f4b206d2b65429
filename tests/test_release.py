"""``release()`` / ``restore()``: every graph and its pool's bytes go (the simulator's pool counts them),
steps run eagerly as ``released`` meanwhile, ``restore()`` captures the same keys again without compiling
again, and outputs are bitwise those of before (CPU simulated graphs)."""

from __future__ import annotations

import gc

import pytest
import torch

from devgraph import BackgroundCapture, ConfigError, GraphRunner, StaticInput
from devgraph.platforms.sim.device_memory import reserved_bytes

pytestmark = pytest.mark.timeout(120)

SIZES = [1, 2, 4, 8]
INPUTS = {"x": StaticInput(torch.float32, (16,), fill=0.0)}
torch.manual_seed(0)
W1, W2 = torch.randn(16, 64), torch.randn(64, 16)


def forward(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ W1) @ W2  # an intermediate of 64 columns per token: pool bytes grow with tokens


def make(**kwargs) -> GraphRunner:
    kwargs.setdefault("mode", "full")
    kwargs.setdefault("sizes", SIZES)
    return GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", **kwargs)


def outputs(runner: GraphRunner) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [runner.run(x=torch.randn(n, 16), copy=True) for n in (1, 3, 8)]


def test_release_frees_every_graph_and_restore_gives_identical_outputs():
    runner = make()
    gc.collect()  # pools of earlier tests' runners go now, not while this test measures
    base = reserved_bytes()
    runner.capture()
    held = reserved_bytes() - base
    assert held > 0 and runner.graph_memory().total_bytes == held
    before = outputs(runner)
    released = runner.release()
    assert runner.released and runner.keys == [] and reserved_bytes() == base
    assert released.graph_bytes == held and [k.tokens for k in released.keys] == SIZES
    runner.reset_stats()
    eager = outputs(runner)
    stats = runner.stats()
    assert stats["eager_by_reason"]["released"] == 3 and stats["replays"] == 0 and stats["released"]
    assert stats["graph_memory"]["total_bytes"] == 0
    report = runner.restore()
    assert not runner.released and [k.tokens for k in runner.keys] == SIZES
    assert [k.key.tokens for k in report.keys] == SIZES and report.bytes == held
    assert reserved_bytes() - base == held
    runner.reset_stats()
    after = outputs(runner)
    assert runner.stats()["replays"] == 3
    for a, b, c in zip(before, after, eager, strict=True):
        assert torch.equal(a, b)  # bitwise: the same graphs on the same buffers
        torch.testing.assert_close(a, c)
    runner.close()


def test_release_twice_and_restore_unreleased_are_no_ops():
    runner = make()
    runner.capture()
    first = runner.release()
    assert runner.release() is first
    runner.restore()
    report = runner.report
    assert runner.restore() is report and len(runner.keys) == len(SIZES)
    runner.close()


def test_release_before_capture_restores_to_uncaptured():
    runner = make()
    runner.release()
    runner.run(x=torch.ones(2, 16))
    assert runner.stats()["eager_by_reason"]["released"] == 1
    report = runner.restore()
    assert report.keys == [] and runner.keys == []
    runner.run(x=torch.ones(2, 16))
    assert runner.stats()["eager_by_reason"]["before_capture"] == 1
    runner.close()


def test_restore_does_not_compile_again():
    runner = make(mode="tc_piecewise", sizes=[1, 2])
    runner.capture()
    x = torch.randn(2, 16)
    before = runner.run(x=x, copy=True)
    compiles = runner.inspect()["compiles"]
    assert compiles >= 1
    runner.release()
    runner.run(x=x)  # eager through the compiled forward: no compile either
    runner.restore()
    info = runner.inspect()
    assert (info["compiles"], info["recompiles"]) == (compiles, 0)
    assert torch.equal(runner.run(x=x, copy=True), before)
    runner.close()


def test_lazy_runner_restores_the_keys_it_held():
    runner = make(lazy=True)
    runner.capture()
    runner.run(x=torch.ones(3, 16))  # captures the key of 4 tokens
    held = [k.tokens for k in runner.keys]
    assert held == [4]
    runner.release()
    assert runner.keys == []
    runner.restore()
    assert [k.tokens for k in runner.keys] == held
    runner.reset_stats()
    runner.run(x=torch.ones(3, 16))
    stats = runner.stats()
    assert stats["replays"] == 1 and stats["lazy"]["misses"] == 0
    runner.close()


def test_release_during_background_capture_is_refused():
    runner = make()
    background = BackgroundCapture([runner])
    background.step()
    with pytest.raises(ConfigError, match="BackgroundCapture.finish"):
        runner.release()
    background.finish()
    runner.release()
    assert runner.keys == []
    runner.close()


@pytest.mark.cuda
def test_cuda_release_returns_the_graph_pool_bytes():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    w1, w2 = torch.randn(1024, 4096, device="cuda"), torch.randn(4096, 1024, device="cuda")

    def big(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w1) @ w2

    runner = GraphRunner(
        big,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (1024,), fill=0.0)},
        device="cuda",
        mode="full",
        sizes=[256, 512, 1024, 2048],
    )
    runner.capture()
    x = torch.randn(700, 1024, device="cuda")
    before = runner.run(x=x, copy=True)
    torch.cuda.synchronize()
    held = runner.graph_memory().total_bytes
    free_before, _ = torch.cuda.mem_get_info()
    runner.release()
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    assert held > 0 and free_after - free_before >= 0.95 * held
    eager = runner.run(x=x, copy=True)  # released: eager at 700 rows (cuBLAS picks other kernels)
    torch.testing.assert_close(eager, before, rtol=1e-4, atol=1e-4 * float(before.abs().max()))
    runner.restore()
    assert torch.equal(runner.run(x=x, copy=True), before)  # the same graph at 1024 rows: same bits
    runner.close()


def test_release_frees_the_fallback_set_too_and_restore_captures_both():
    runner = make(mode=None, config='{"decode": {"backend": "full", "fallback": "breakable"}}')
    gc.collect()
    base = reserved_bytes()
    runner.capture()
    held = reserved_bytes() - base
    memory = runner.graph_memory()
    assert memory.fallback_bytes > 0 and memory.total_bytes == held
    x = torch.randn(3, 16)
    before = runner.run(x=x, copy=True)
    runner.release()
    assert reserved_bytes() == base and runner.inspect()["fallback"]["keys"] == {}
    runner.restore()
    assert reserved_bytes() - base == held and len(runner.inspect()["fallback"]["keys"]) == len(SIZES)
    assert torch.equal(runner.run(x=x, copy=True), before)
    runner.close()
