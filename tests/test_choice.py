"""Compiled or plain per key (``full`` with a compiler): both graphs captured and timed, the faster kept; the
compiled path abandoned once it loses by 2x at the largest key; ``keep_compiled`` insists, with a warning
that gives the ratio; the report, ``inspect()`` and ``stats()`` show both times and the choice."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from devgraph import GraphRunner, StaticInput, create_backend
from devgraph.strategies.choice import ABANDON_RATIO, CompileChoice, Kept, time_pair

INPUTS = {"x": StaticInput(torch.float32, (8,), fill=0.0)}
W = torch.linspace(-1, 1, 64).reshape(8, 8)
SIZES = [1, 2, 4, 8]


def forward(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ W) * 2 + 1


class StandInTimer:
    """Seconds per replay by role: ``time_pair`` times the compiled graph first in every round, then the
    plain one, so the calls alternate compiled, plain, compiled, ..."""

    def __init__(self, compiled_s: float, plain_s: float) -> None:
        self.costs = (compiled_s, plain_s)
        self.calls = 0

    def __call__(self, replay: Callable[[], Any], iters: int) -> float:
        for _ in range(iters):
            replay()  # the graphs really replay: a broken one would fail here
        cost = self.costs[self.calls % 2]
        self.calls += 1
        return cost


def make(timer: StandInTimer | None, *, compiler: str = "eager", **options: Any) -> GraphRunner:
    backend = create_backend("cpu", "decode", "full", options={"compiler": compiler, **options})
    backend.replay_timer = timer  # type: ignore[attr-defined]
    return GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", sizes=SIZES, backend=backend)


def kept(runner: GraphRunner) -> dict[str, str]:
    keys = runner.inspect()["keys"]
    return {key: info["compiled_or_plain"]["kept"] for key, info in keys.items()}


def test_a_slower_compiled_graph_is_never_kept_and_loses_its_smaller_keys(caplog):
    runner = make(StandInTimer(compiled_s=3e-3, plain_s=1e-3))
    with caplog.at_level(logging.INFO, logger="devgraph.strategies"):
        report = runner.capture()
    assert set(kept(runner).values()) == {"plain"}
    info = runner.inspect()["compiled_or_plain"]
    largest = info["keys"]["tokens=8"]
    assert (largest["why"], largest["compiled_ms"], largest["plain_ms"]) == ("slower", 3.0, 1.0)
    assert largest["compiled_over_plain"] == 3.0
    # Lost by 3x (>= 2x) at the largest key: the smaller keys never captured the compiled forward.
    assert "3.00x slower" in info["abandoned"]
    assert {k: v["why"] for k, v in info["keys"].items() if k != "tokens=8"} == dict.fromkeys(
        ("tokens=1", "tokens=2", "tokens=4"), "abandoned"
    )
    assert any("3.00x slower than the plain forward's graph" in r.getMessage() for r in caplog.records)
    notes = "\n".join(report.notes)
    assert "0 of 4 keys keep the compiled graph" in notes and "compiled 3.000 ms, plain 1.000 ms" in notes
    assert runner.stats()["strategy"]["compiled_or_plain"] == {
        "compiled": [],
        "plain": [f"tokens={n}" for n in SIZES],
        "abandoned": True,
        "ms": {
            "tokens=1": [None, None],
            "tokens=2": [None, None],
            "tokens=4": [None, None],
            "tokens=8": [3.0, 1.0],
        },
    }
    for n in (1, 3, 8):
        x = torch.randn(n, 8)
        torch.testing.assert_close(runner.run(x=x), forward(x))


def test_slower_by_less_than_the_bound_is_measured_at_every_key():
    runner = make(StandInTimer(compiled_s=1.5e-3, plain_s=1e-3))
    runner.capture()
    info = runner.inspect()["compiled_or_plain"]
    assert info["abandoned"] is None
    assert {v["why"] for v in info["keys"].values()} == {"slower"}
    assert info["plain_keys"] == 4 and info["choice_seconds"] > 0


def test_a_faster_compiled_graph_is_kept_and_replays_right():
    runner = make(StandInTimer(compiled_s=1e-3, plain_s=2e-3))
    runner.capture()
    assert set(kept(runner).values()) == {"compiled"}
    assert runner.inspect()["compiles"] == 1
    for n in (1, 2, 5, 8):
        x = torch.randn(n, 8)
        torch.testing.assert_close(runner.run(x=x), forward(x))


def test_keep_compiled_insists_and_warns_with_the_ratio(caplog):
    runner = make(StandInTimer(compiled_s=5e-3, plain_s=2e-3), keep_compiled=True)
    with caplog.at_level(logging.WARNING, logger="devgraph.strategies"):
        runner.capture()
    assert set(kept(runner).values()) == {"compiled"}
    messages = [r.getMessage() for r in caplog.records]
    assert sum("keep_compiled" in m and "2.50x slower" in m for m in messages) == len(SIZES)


def test_the_simulator_keeps_compiled_graphs_untimed_unless_given_a_timer():
    flag = '{"decode": {"backend": "full", "compiler": "eager"}}'
    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", sizes=SIZES, config=flag)
    report = runner.capture()
    info = runner.inspect()["compiled_or_plain"]
    assert {v["why"] for v in info["keys"].values()} == {"not_timed"} and info["choice_seconds"] == 0
    assert not report.notes  # nothing compared: nothing in the report differs from the plan


def test_plain_full_measures_nothing():
    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", sizes=SIZES, mode="full")
    runner.capture()
    assert "compiled_or_plain" not in runner.inspect()
    assert runner.stats()["strategy"] == {}


def test_release_forgets_the_choice_and_cleanup_starts_afresh():
    runner = make(StandInTimer(compiled_s=3e-3, plain_s=1e-3))
    runner.capture()
    backend: Any = runner.backend
    backend.release(next(iter(backend.captured_keys())))
    assert len(backend.choice.choices) == len(SIZES) - 1
    backend.cleanup()
    assert backend.choice.choices == {} and backend.choice.trying


# -- a forward whose compiled form really is slower, timed by the simulator's own clock ---------------------
SLOW = torch.randn(192, 192)


def slow_when_compiled(x: torch.Tensor) -> torch.Tensor:
    y = torch.relu(x @ W) * 2 + 1
    if torch.compiler.is_compiling():
        # Only the compiled forward runs this: a product of large matrices that adds nothing to the result.
        waste = SLOW
        for _ in range(6):
            waste = waste @ SLOW / 14
        y = y + 0 * waste.sum()
    return y


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_really_slower_compiled_forward_keeps_plain_graphs_by_the_simulators_clock(one_thread):
    backend = create_backend("cpu", "decode", "full", options={"compiler": "eager"})
    backend.replay_timer = backend.platform.time_replays  # type: ignore[attr-defined]  # the host clock
    runner = GraphRunner(
        slow_when_compiled, phase="decode", inputs=INPUTS, device="cpu", sizes=[2, 4], backend=backend
    )
    runner.capture()
    info = runner.inspect()["compiled_or_plain"]
    largest = info["keys"]["tokens=4"]
    assert largest["kept"] == "plain" and largest["compiled_over_plain"] > ABANDON_RATIO, largest
    assert info["plain_keys"] == 2
    x = torch.randn(3, 8)
    torch.testing.assert_close(runner.run(x=x), slow_when_compiled(x))


# -- the rules on their own ------------------------------------------------------------------------------
def test_time_pair_interleaves_and_keeps_each_ones_fastest_round():
    seen: list[str] = []
    costs = iter([4e-3, 2e-3, 3e-3, 5e-3, 6e-3, 1e-3])

    def timer(replay: Callable[[], Any], iters: int) -> float:
        replay()
        return next(costs)

    compiled_s, plain_s = time_pair(timer, lambda: seen.append("c"), lambda: seen.append("p"))
    assert (compiled_s, plain_s) == (3e-3, 1e-3)
    assert seen == ["c", "p", "c", "p", "c", "p", "c", "p"]  # one untimed replay each, then 3 rounds


def test_a_slow_replay_is_decided_in_one_round():
    calls = []

    def timer(replay: Callable[[], Any], iters: int) -> float:
        calls.append(iters)
        return 0.2

    time_pair(timer, lambda: None, lambda: None)
    assert len(calls) == 2


def test_only_the_largest_key_can_abandon():
    from devgraph.contract.keys import GraphKey

    choice = CompileChoice("full", keep_compiled=False)
    assert choice.decide(GraphKey(8), 1.5e-3, 1e-3, 0.0).kept is Kept.PLAIN
    assert choice.trying  # 1.5x at the largest: measured again at the next key
    assert choice.decide(GraphKey(4), 9e-3, 1e-3, 0.0).kept is Kept.PLAIN
    assert choice.trying  # 9x, but not at the largest key


def test_the_ranks_of_a_group_choose_alike_whatever_their_own_clocks_say(tmp_path):
    from pathlib import Path

    from ranks_launch import launch_ranks

    found = launch_ranks(Path(__file__).parent / "choice_worker.py", "choice", tmp_path, limit=120)
    assert found[0]["exit"] == 0 and found[1]["exit"] == 0, found
    # The slowest time of each graph over the ranks: compiled 3 ms, plain 2 ms: plain everywhere, measured
    # at every key (1.5x is under the 2x that abandons).
    assert found[0]["keys"] == found[1]["keys"]
    assert {v[0] for v in found[0]["keys"].values()} == {"plain"}
    assert found[0]["keys"]["tokens=4"][2:] == [3.0, 2.0]
    assert found[0]["abandoned"] is None and found[0]["equal_to_eager"] and found[1]["equal_to_eager"]


def marked_when_compiled(x: torch.Tensor) -> torch.Tensor:
    y = torch.relu(x @ W) * 2 + 1
    return y + 1e-3 if torch.compiler.is_compiling() else y  # the compiled form is told apart by its values


@pytest.mark.parametrize(("compiled_s", "kept_graph"), [(1.5e-3, "plain"), (0.5e-3, "compiled")])
def test_verify_compares_each_key_with_the_forward_its_graph_runs(compiled_s, kept_graph):
    backend = create_backend("cpu", "decode", "full", options={"compiler": "eager"})
    backend.replay_timer = StandInTimer(compiled_s=compiled_s, plain_s=1e-3)  # type: ignore[attr-defined]
    runner = GraphRunner(
        marked_when_compiled, phase="decode", inputs=INPUTS, device="cpu", sizes=SIZES, backend=backend
    )
    runner.capture()
    assert set(kept(runner).values()) == {kept_graph}
    x = torch.randn(3, 8)
    result = runner.verify(x=x)
    assert result.replayed and result.max_abs_diff == 0  # the padded eager run is the kept graph's forward
    expected = marked_when_compiled(x) + (1e-3 if kept_graph == "compiled" else 0)
    torch.testing.assert_close(runner.run(x=x), expected)


@pytest.mark.cuda
def test_on_cuda_a_slower_compiled_forward_keeps_plain_graphs_by_cuda_events():
    weights, waste = W.cuda(), torch.randn(2048, 2048, device="cuda")

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x @ weights) * 2 + 1
        if torch.compiler.is_compiling():  # the compiled form alone multiplies large matrices for nothing
            w = waste
            for _ in range(8):
                w = w @ waste / 45
            y = y + 0 * w.sum()
        return y

    flag = '{"decode": {"backend": "full", "compiler": "eager"}}'
    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, device="cuda", sizes=[2, 8], config=flag)
    try:
        runner.capture()
        info = runner.inspect()["compiled_or_plain"]
        largest = info["keys"]["tokens=8"]
        assert largest["kept"] == "plain" and largest["compiled_over_plain"] > ABANDON_RATIO, largest
        assert info["keys"]["tokens=2"]["why"] == "abandoned"
        x = torch.randn(5, 8, device="cuda")
        torch.testing.assert_close(runner.run(x=x), torch.relu(x @ weights) * 2 + 1)
    finally:
        runner.close()


def test_a_warm_start_keeps_the_choices_of_the_process_that_wrote_cache_dir(tmp_path):
    # Timed near 1.0x, two processes could choose differently, and their outputs differ in the last bits
    # (compiled against plain). The first capture's choices travel in the artifact file; a later runner
    # with the same cache_dir replays what was chosen, without timing (one capture per key).
    cold_timer = StandInTimer(compiled_s=1.2e-3, plain_s=1e-3)  # slower, under the 2x that abandons
    cold = make(cold_timer, cache_dir=str(tmp_path))
    cold.capture()
    assert set(kept(cold).values()) == {"plain"} and cold_timer.calls > 0
    warm_timer = StandInTimer(compiled_s=0.5e-3, plain_s=1e-3)  # this process would keep compiled
    warm = make(warm_timer, cache_dir=str(tmp_path))
    report = warm.capture()
    assert warm_timer.calls == 0
    info = warm.inspect()["compiled_or_plain"]["keys"]
    assert {k: (v["kept"], v["why"]) for k, v in info.items()} == {
        f"tokens={n}": ("plain", "cached") for n in SIZES
    }
    assert info["tokens=8"]["compiled_ms"] == 1.2 and info["tokens=8"]["plain_ms"] == 1.0  # the cold times
    assert "as the process that wrote cache_dir chose" in "\n".join(report.notes)
    x = torch.randn(3, 8)
    torch.testing.assert_close(warm.run(x=x), forward(x))
    # keep_compiled decides again, whatever the file says.
    timer = StandInTimer(compiled_s=1.2e-3, plain_s=1e-3)
    insisting = make(timer, cache_dir=str(tmp_path), keep_compiled=True)
    insisting.capture()
    assert set(kept(insisting).values()) == {"compiled"}


def test_a_damaged_choice_in_the_artifact_file_is_timed_again(tmp_path):
    make(StandInTimer(compiled_s=1.2e-3, plain_s=1e-3), cache_dir=str(tmp_path)).capture()
    (path,) = tmp_path.glob("*.dgcache")
    blob = path.read_bytes()
    path.write_bytes(blob.replace(b'"kept": "plain"', b'"kept": "neither"', 1))  # one key's entry unreadable
    timer = StandInTimer(compiled_s=0.5e-3, plain_s=1e-3)
    warm = make(timer, cache_dir=str(tmp_path))
    warm.capture()
    whys = {k: v["why"] for k, v in warm.inspect()["compiled_or_plain"]["keys"].items()}
    assert sorted(whys.values()) == ["cached", "cached", "cached", "faster"] and timer.calls > 0


def test_a_time_in_the_artifact_file_too_large_for_a_float_is_ignored(tmp_path):
    """The header is not covered by the payload's checksum: a number JSON holds but a float cannot (an
    int of 400 digits) failed the warm start's capture with OverflowError instead of being ignored."""
    make(StandInTimer(compiled_s=1.2e-3, plain_s=1e-3), cache_dir=str(tmp_path)).capture()
    (path,) = tmp_path.glob("*.dgcache")
    blob = path.read_bytes()
    path.write_bytes(blob.replace(b'"compiled_s": 0.0012', b'"compiled_s": 1' + b"0" * 400, 1))
    timer = StandInTimer(compiled_s=0.5e-3, plain_s=1e-3)
    warm = make(timer, cache_dir=str(tmp_path))
    warm.capture()
    info = warm.inspect()["compiled_or_plain"]["keys"]
    assert {v["why"] for v in info.values()} == {"cached"} and timer.calls == 0
    assert None in {v["compiled_ms"] for v in info.values()}  # the unreadable time, not the choice, dropped


def test_a_lazy_runners_later_keys_keep_their_choices_for_a_warm_start(tmp_path):
    """A lazy runner captures each key at its first step, in a capture session of its own: the file was
    written after the first one only, so a warm start timed the later keys again (and chose compiled where
    the cold process had chosen plain). Each later key's choice is added to the file's header."""

    def lazy(timer: StandInTimer) -> GraphRunner:
        options = {"compiler": "eager", "cache_dir": str(tmp_path)}
        backend = create_backend("cpu", "decode", "full", options=options)
        backend.replay_timer = timer  # type: ignore[attr-defined]
        return GraphRunner(
            forward, phase="decode", inputs=INPUTS, device="cpu", sizes=SIZES, backend=backend, lazy=True
        )

    cold = lazy(StandInTimer(compiled_s=1.2e-3, plain_s=1e-3))
    cold.capture()
    for rows in (1, 3, 8):
        cold.run(x=torch.randn(rows, 8))
    assert set(kept(cold).values()) == {"plain"} and len(kept(cold)) == 3
    (path,) = tmp_path.glob("*.dgcache")
    payload = path.read_bytes().split(b"\n", 2)[2]
    warm_timer = StandInTimer(compiled_s=0.5e-3, plain_s=1e-3)
    warm = lazy(warm_timer)
    warm.capture()
    for rows in (1, 3, 8):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(warm.run(x=x), forward(x))
    info = warm.inspect()["compiled_or_plain"]["keys"]
    assert {k: (v["kept"], v["why"]) for k, v in info.items()} == {
        k: ("plain", "cached") for k in ("tokens=1", "tokens=4", "tokens=8")
    }
    assert warm_timer.calls == 0
    assert path.read_bytes().split(b"\n", 2)[2] == payload  # the artifacts as written, the header grown


def test_a_warm_start_whose_every_key_was_kept_plain_compiles_nothing(tmp_path):
    cold = make(StandInTimer(compiled_s=1.5e-3, plain_s=1e-3), cache_dir=str(tmp_path))
    cold.capture()
    assert set(kept(cold).values()) == {"plain"}
    warm_backend = create_backend(
        "cpu", "decode", "full", options={"compiler": "eager", "cache_dir": str(tmp_path)}
    )
    warm_backend.replay_timer = StandInTimer(compiled_s=0.5e-3, plain_s=1e-3)  # type: ignore[attr-defined]
    warm = GraphRunner(
        forward, phase="decode", inputs=INPUTS, device="cpu", sizes=SIZES, backend=warm_backend
    )
    warm.capture()
    assert set(kept(warm).values()) == {"plain"}
    assert warm_backend.compiles == 0  # the warm-ups ran the plain forward too: dynamo never traced it
    x = torch.randn(3, 8)
    torch.testing.assert_close(warm.run(x=x), forward(x))
