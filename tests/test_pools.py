"""Shared graph pools: runners that replay one at a time capture into one pool; the debug mode checks that
promise."""

from __future__ import annotations

import threading

import pytest
import torch

from devgraph import GraphPool, GraphRunner, StaticInput, graph_break
from devgraph.errors import ConfigError, ReplayError
from devgraph.flag.factory import resolve_platform
from devgraph.reference import ReferenceConfig, ReferenceModel, make_decode_batch, reference_inputs

INPUTS = {"x": StaticInput(torch.float32, (4,))}
SIZES = [2, 4, 8, 16]


def greedy_runner(model: ReferenceModel, pool: GraphPool | None) -> GraphRunner:
    """A decode runner that samples greedily in the graph: its outputs are token ids, its working memory
    the logits (as in an engine that samples inside the graph)."""

    def step(**batch: torch.Tensor) -> torch.Tensor:
        return model.decode_step(**batch).argmax(-1)

    return GraphRunner(
        step,
        phase="decode",
        inputs=reference_inputs(model),
        sizes=SIZES,
        device="cpu",
        mode="full",
        pool=pool,
    )


def models() -> tuple[ReferenceModel, ReferenceModel]:
    config = ReferenceConfig.preset("tiny", vocab_size=4096)
    target = ReferenceModel(config, seed=0)
    draft = ReferenceModel(ReferenceConfig.preset("tiny", vocab_size=4096, num_layers=1), seed=1)
    return draft, target


def test_a_draft_and_a_target_sharing_a_pool_hold_at_most_six_tenths_of_two_pools():
    draft, target = models()
    separate = [GraphPool(name="draft"), GraphPool(name="target")]
    runners = [greedy_runner(draft, separate[0]), greedy_runner(target, separate[1])]
    for runner in runners:
        runner.capture()
    two_pools = sum(p.describe()["modelled_bytes"] for p in separate)
    shared = GraphPool()
    together = [greedy_runner(draft, shared), greedy_runner(target, shared)]
    for runner in together:
        runner.capture()
    one_pool = shared.describe()["modelled_bytes"]
    assert 0 < one_pool <= 0.6 * two_pools, (one_pool, two_pools)
    assert shared.describe()["runners"] == ["decode:full", "decode:full"]
    # Replaying one after the other, each runner's outputs are its own and equal eager.
    for seed, n in enumerate((3, 7, 16)):
        for model, runner in zip((draft, target), together, strict=True):
            batch = make_decode_batch(model, n, seq_lens=9, seed=seed)
            tokens = runner.run(**batch, copy=True)
            assert torch.equal(tokens, model.decode_step(**batch).argmax(-1))


@graph_break("devgraph_test::wait_for")
def wait_for(x: torch.Tensor) -> torch.Tensor:
    """Blocks until the test lets it go (a replay kept in progress on purpose)."""
    if GATE.entered is not None:
        GATE.entered.set()
        GATE.release.wait(10)
    return x + 0


class _Gate:
    entered: threading.Event | None = None
    release = threading.Event()


GATE = _Gate()


def test_debug_mode_catches_two_runners_of_a_pool_replaying_at_once():
    pool = GraphPool(debug=True)
    slow = GraphRunner(
        lambda x: wait_for(x) * 2,
        phase="decode",
        inputs=INPUTS,
        sizes=[4],
        device="cpu",
        mode="breakable",
        pool=pool,
    )
    fast = GraphRunner(
        lambda x: x * 3, phase="decode", inputs=INPUTS, sizes=[4], device="cpu", mode="full", pool=pool
    )
    slow.capture()
    fast.capture()
    GATE.entered, GATE.release = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: slow.run(x=torch.ones(4, 4)))
    thread.start()
    try:
        assert GATE.entered.wait(10)
        with pytest.raises(ReplayError, match="must replay one at a time"):
            fast.run(x=torch.ones(4, 4))
    finally:
        GATE.release.set()
        thread.join(10)
        GATE.entered = None
    torch.testing.assert_close(fast.run(x=torch.ones(4, 4)), torch.full((4, 4), 3.0))  # in turn: fine


class BusyStream:
    """A stream whose work has not finished (what a device stream says while a replay runs on it)."""

    def query(self) -> bool:
        return False


def test_debug_mode_catches_replays_on_two_streams_without_ordering():
    pool = GraphPool(debug=True)
    a = GraphRunner(
        lambda x: x * 2, phase="decode", inputs=INPUTS, sizes=[4], device="cpu", mode="full", pool=pool
    )
    b = GraphRunner(
        lambda x: x * 3, phase="decode", inputs=INPUTS, sizes=[4], device="cpu", mode="full", pool=pool
    )
    a.capture()
    b.capture()
    platform = resolve_platform("cpu")
    with platform.stream(BusyStream()):
        a.run(x=torch.ones(4, 4))
    with pytest.raises(ReplayError, match="has not finished"):
        b.run(x=torch.ones(4, 4))
    a.run(x=torch.ones(4, 4))  # the same runner again: ordered by its own stream use, nothing to check
    # torch hands out a new Stream object per current_stream() call; equal handles are one stream: ordered.
    with platform.stream(HandleStream(7)):
        a.run(x=torch.ones(4, 4))
    with platform.stream(HandleStream(7)):
        b.run(x=torch.ones(4, 4))


class HandleStream(BusyStream):
    """Busy, and equal to any other wrapper of the same handle (as ``torch.cuda.Stream`` objects are)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HandleStream) and other.handle == self.handle

    def __hash__(self) -> int:
        return self.handle


def test_without_debug_nothing_is_checked(monkeypatch):
    monkeypatch.delenv("DEVGRAPH_DEBUG", raising=False)
    assert GraphPool().debug is False
    monkeypatch.setenv("DEVGRAPH_DEBUG", "1")
    assert GraphPool().debug is True


def test_what_cannot_share_a_pool_is_refused():
    with pytest.raises(ConfigError, match="pool= must be a devgraph.GraphPool"):
        GraphRunner(lambda x: x, phase="decode", inputs=INPUTS, sizes=[4], device="cpu", pool="shared")
    with pytest.raises(ConfigError, match="debug= must be"):
        GraphPool(debug="yes")  # type: ignore[arg-type]
    pool = GraphPool()
    other = GraphRunner(lambda x: x, phase="decode", inputs=INPUTS, sizes=[4], device="cpu", mode="disabled")
    pool.attach(other, [], resolve_platform("cpu"), torch.device("meta"))
    with pytest.raises(ConfigError, match="one pool lives on one device"):
        GraphRunner(lambda x: x, phase="decode", inputs=INPUTS, sizes=[4], device="cpu", pool=pool)
    eager = GraphRunner(
        lambda x: x + 1,
        phase="decode",
        inputs=INPUTS,
        sizes=[4],
        device="cpu",
        mode="disabled",
        pool=GraphPool(),
    )
    torch.testing.assert_close(eager.run(x=torch.ones(4, 4)), torch.full((4, 4), 2.0))


@pytest.mark.cuda
def test_on_a_gpu_a_shared_pool_holds_about_one_runners_working_memory():
    config = ReferenceConfig.preset("tiny", vocab_size=32768, max_seq_len=64)
    models = [ReferenceModel(config, device="cuda", seed=s) for s in (0, 1)]

    def build(model: ReferenceModel, pool: GraphPool) -> GraphRunner:
        def step(**batch: torch.Tensor) -> torch.Tensor:
            return model.decode_step(**batch).argmax(-1)

        inputs = reference_inputs(model)
        return GraphRunner(
            step, phase="decode", inputs=inputs, sizes=SIZES, device="cuda", mode="full", pool=pool
        )

    def grown(make) -> tuple[list[GraphRunner], int]:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        made = make()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return made, torch.cuda.memory_reserved() - before

    separate = 0
    for model in models:
        runners, nbytes = grown(lambda m=model: [_captured(build(m, GraphPool()))])
        separate += nbytes
        runners[0].close()
    shared = GraphPool(debug=True)
    pair, together = grown(lambda: [_captured(build(m, shared)) for m in models])
    assert together <= 0.6 * separate, (together, separate)
    batch = make_decode_batch(models[0], 5, seq_lens=9)
    for model, runner in zip(models, pair, strict=True):
        assert torch.equal(runner.run(**batch, copy=True), model.decode_step(**batch).argmax(-1))


def _captured(runner: GraphRunner) -> GraphRunner:
    runner.capture()
    return runner
