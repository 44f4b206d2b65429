"""A runner's graph life (devgraph/runner/life.py): every order of capture, refresh, release, restore,
retune, a background capture and the memory estimate works or is refused with a ConfigError that leaves the
runner usable; retune with a fallback set, a background capture's progress after a failed key and the
estimate of a fallback set tell the truth (CPU simulated graphs)."""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Callable

import pytest
import torch
from conftest import host_read_at_four

from devgraph import (
    BackgroundCapture,
    CaptureError,
    ConfigError,
    GraphRunner,
    LifeState,
    StaticInput,
    is_capturing,
)
from devgraph.platforms.sim.device_memory import reserved_bytes

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

SIZES = [1, 4]
INPUTS = {"x": StaticInput(torch.float32, (8,), fill=0.0)}
torch.manual_seed(0)
WEIGHT = torch.randn(8, 8)
FALLBACK = '{"decode": {"backend": "full", "fallback": "breakable"}}'


def forward(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ WEIGHT) + x


def fails_full_at_four(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(host_read_at_four(x @ WEIGHT)) + x


def make(fn: Callable[..., torch.Tensor] = forward, **kwargs: object) -> GraphRunner:
    kwargs.setdefault("mode", "full")
    kwargs.setdefault("sizes", SIZES)
    return GraphRunner(fn, phase="decode", inputs=INPUTS, device="cpu", **kwargs)  # type: ignore[arg-type]


# -- every call order -------------------------------------------------------------------------------------
def _background_step(runner: GraphRunner) -> None:
    BackgroundCapture([runner]).step()


#: The transitions of a runner's life, as a caller makes them (public API only).
CALLS: dict[str, Callable[[GraphRunner], object]] = {
    "capture": GraphRunner.capture,
    "refresh": GraphRunner.refresh,
    "release": GraphRunner.release,
    "restore": GraphRunner.restore,
    "retune": lambda r: r.retune([1, 2, 4], lazy=False),
    "background_step": _background_step,
    "background_finish": lambda r: BackgroundCapture([r]).finish(),
    "estimate": lambda r: r.estimate_graph_memory(),
}


def _check_usable(runner: GraphRunner, order: tuple[str, ...]) -> None:
    x = torch.randn(3, 8)
    torch.testing.assert_close(runner.run(x=x), forward(x), msg=lambda m: f"after {order}: {m}")
    stats = runner.stats()
    assert stats["released"] == runner.released, order
    if runner.released:
        assert runner.keys == [] and stats["eager_by_reason"]["released"] > 0, order


def test_every_order_of_two_calls_works_or_is_refused_and_leaves_the_runner_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The collection before each start-up capture walks the whole heap (0.4 s here, 80% of this test); it
    # only keeps capture fast, and these captures are of one tiny forward.
    monkeypatch.setattr(gc, "collect", lambda *args: 0)
    # Each order is followed by the calls that must bring any runner back to replaying (a third and more).
    for order in itertools.product(CALLS, repeat=2):
        runner = make()
        for name in order:
            with contextlib.suppress(ConfigError):  # refused: the runner goes on as before (checked below)
                CALLS[name](runner)
            _check_usable(runner, order)
        # Whatever came before, the runner can end up with every key captured and replaying.
        BackgroundCapture([runner]).finish()
        runner.restore()
        runner.capture()
        assert runner.keys and [k.tokens for k in runner.keys] == list(runner.sizes), order
        runner.reset_stats()
        _check_usable(runner, order)
        assert runner.stats()["replays"] == 1, order
        runner.close()


def test_capture_refresh_or_a_background_capture_after_release_then_restore() -> None:
    # before: restore() raised "already captured; call cleanup()" and the runner kept 0 keys for good
    for again in ("capture", "refresh", "background_finish"):
        runner = make()
        runner.capture()
        x = torch.randn(3, 8)
        before = runner.run(x=x, copy=True)
        runner.release()
        CALLS[again](runner)
        assert not runner.released and runner.life.state is LifeState.CAPTURED, again
        assert runner.restore() is runner.report  # nothing released any more: a no-op
        assert [k.tokens for k in runner.keys] == SIZES
        assert torch.equal(runner.run(x=x, copy=True), before)
        runner.close()


def test_the_state_follows_the_calls() -> None:
    runner = make()
    life = runner.life
    assert life.state is LifeState.FRESH
    background = BackgroundCapture([runner])
    assert life.state is LifeState.CAPTURING and runner.inspect()["life"] == "capturing"
    with pytest.raises(ConfigError, match="BackgroundCapture.finish"):
        runner.release()
    assert life.state is LifeState.CAPTURING  # refused: unchanged
    background.finish()
    assert life.state is LifeState.CAPTURED
    runner.release()
    assert life.state is LifeState.RELEASED and runner.released
    with pytest.raises(ConfigError, match="before capture"):
        runner.estimate_graph_memory()
    runner.restore()
    assert life.state is LifeState.CAPTURED
    runner.close()
    assert life.state is LifeState.CLOSED
    with pytest.raises(ConfigError, match="closed"):
        runner.restore()


def test_a_failed_restore_stays_released_and_can_be_tried_again() -> None:
    calls = {"fail": False}

    def flaky(x: torch.Tensor) -> torch.Tensor:
        if calls["fail"] and is_capturing():
            x.sum().item()  # a host sync: this capture fails
        return forward(x)

    runner = make(flaky)
    runner.capture()
    runner.release()
    calls["fail"] = True
    with pytest.raises(CaptureError):
        runner.restore()
    assert runner.released and runner.keys == []
    calls["fail"] = False
    runner.restore()
    assert not runner.released and [k.tokens for k in runner.keys] == SIZES
    runner.close()


# -- retune with a fallback set ---------------------------------------------------------------------------
def test_retune_with_a_fallback_set_keeps_the_primary_graphs_and_leaves_the_declined_key_to_the_fallback():
    # before: retune() raised the tokens=4 CaptureError and deleted every primary graph
    runner = make(fails_full_at_four, mode=None, config=FALLBACK, sizes=[2, 8])
    runner.capture()
    assert [k.tokens for k in runner.keys] == [2, 8]
    added = runner.retune([2, 4, 8])
    assert [k.tokens for k in added] == [4]
    assert [k.tokens for k in runner.keys] == [2, 8]  # the primary's graphs stay; 4 is the fallback's
    fallback = runner.inspect()["fallback"]
    assert (
        set(fallback["keys"]) == {"tokens=2", "tokens=4", "tokens=8"} and "tokens=4" in fallback["declined"]
    )
    runner.reset_stats()
    for n in (2, 3, 8):
        x = torch.randn(n, 8)
        torch.testing.assert_close(runner.run(x=x), fails_full_at_four(x))
    stats = runner.stats()
    assert stats["replays"] == 3 and stats["fallback"]["by_reason"]["not_captured"] == 1
    runner.close()


def test_retune_without_a_fallback_raises_for_the_new_key_and_the_other_graphs_keep_serving():
    # before: the failed new key's cleanup released every graph of the runner
    runner = make(fails_full_at_four, sizes=[2, 8])
    runner.capture()
    with pytest.raises(CaptureError, match="tokens=4"):
        runner.retune([2, 4, 8], lazy=False)
    assert [k.tokens for k in runner.keys] == [2, 8]
    runner.reset_stats()
    runner.run(x=torch.randn(8, 8))
    runner.run(x=torch.randn(3, 8))
    stats = runner.stats()
    assert stats["replays"] == 1 and stats["eager_by_reason"]["not_captured"] == 1
    runner.close()


# -- a background capture's progress after a failed key ---------------------------------------------------
def test_progress_after_a_failed_key_counts_only_the_graphs_still_held():
    # before: "9 of 9 captured" while only the first runner's 3 graphs were held
    def failing(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 4 and is_capturing():
            x.sum().item()  # the second runner's tokens=4 capture fails
        return forward(x)

    sizes = [1, 2, 4]
    first = make(sizes=sizes)
    second = make(failing, sizes=sizes)
    third = make(sizes=sizes)
    background = BackgroundCapture([first, second, third])
    assert background.total == 9
    with pytest.raises(CaptureError, match="tokens=4"):
        background.finish()
    held = sum(len(r.keys) for r in (first, second, third))
    progress = background.progress()
    assert held == 3 and progress["captured"] == held and progress["total"] == 9
    assert not progress["ready"] and "tokens=4" in progress["error"]


# -- the estimate covers every graph set ------------------------------------------------------------------
@pytest.mark.parametrize("fn", [forward, fails_full_at_four], ids=["both_sets", "primary_declines_a_key"])
def test_the_estimate_covers_the_fallback_set(fn: Callable[..., torch.Tensor]) -> None:
    # before: 3.9 MB estimated for 7.8 MB captured (the fallback set left out), and a key the primary
    # declines failed the estimate
    runner = make(fn, mode=None, config=FALLBACK, sizes=[1, 2, 4, 8])
    gc.collect()
    base = reserved_bytes()
    estimate = runner.estimate_graph_memory()
    assert reserved_bytes() == base and runner.keys == []
    runner.capture()
    measured = runner.graph_memory()
    assert measured.fallback_bytes > 0 and estimate.fallback_bytes == measured.fallback_bytes
    assert estimate.total_bytes == measured.total_bytes == reserved_bytes() - base
    assert "fallback" in estimate.method
    runner.close()
