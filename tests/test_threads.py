"""GraphRunner from several threads: steps never interleave, owned outputs never mix, teardown is safe.

The rule (GraphRunner's docstring): ``run``/``verify``/``capture``/``close`` hold one lock; what ``run``
returns without ``copy=True`` is valid until the next ``run`` of *any* thread, so threads sharing a
runner pass ``copy=True`` or ``out=``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from devgraph import ConfigError, GraphRunner, StaticInput

SIZES = [1, 2, 4, 8]
INPUTS = {"x": StaticInput(torch.float32, (4,), fill=0.0)}


def forward(x: torch.Tensor) -> dict[str, torch.Tensor]:
    # Several ops per step, so an unlocked runner has room to interleave two steps.
    y = x * 3
    y = y + 1
    return {"y": y, "row_sum": y.sum(dim=1)}


def make_runner(mode: str = "full") -> GraphRunner:
    return GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", mode=mode, sizes=SIZES)


@pytest.fixture
def busy_switching() -> Iterator[None]:
    """Switch threads as often as the interpreter allows, so races show up in a few hundred steps."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def run_threads(target: Callable[[int], None], count: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def wrapped(index: int) -> None:
        try:
            target(index)
        except BaseException as exc:  # collected and re-raised by the test, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


@pytest.mark.parametrize("mode", ["full", "disabled"])
def test_threads_with_copy_never_see_each_others_outputs(mode, busy_switching):
    runner = make_runner(mode)
    runner.capture()
    steps_per_thread = 150
    wrong: list[tuple[int, int]] = []

    def worker(tid: int) -> None:
        for i in range(steps_per_thread):
            n = 1 + (tid * 7 + i) % 10  # captured sizes, padded sizes and past the largest (eager)
            x = torch.full((n, 4), float(tid * 1000 + i))
            out = runner.run(x=x, copy=True)
            if not (torch.equal(out["y"], x * 3 + 1) and torch.equal(out["row_sum"], (x * 3 + 1).sum(1))):
                wrong.append((tid, i))

    errors = run_threads(worker, 4)
    assert not errors, errors
    assert wrong == []
    stats = runner.stats()
    assert stats["steps"] == 4 * steps_per_thread  # every step was counted once: none was lost or doubled
    if mode == "full":
        assert stats["replays"] > 0 and stats["eager_by_reason"]["past_largest"] > 0


def test_threads_with_out_buffers_get_their_own_rows(busy_switching):
    runner = make_runner()
    runner.capture()
    wrong: list[int] = []

    def worker(tid: int) -> None:
        out = {"y": torch.empty(3, 4, dtype=torch.float64), "row_sum": torch.empty(3, dtype=torch.float64)}
        for i in range(100):
            x = torch.full((3, 4), float(tid * 1000 + i))
            got = runner.run(x=x, out=out)
            if got is not out or not torch.equal(out["y"], (x * 3 + 1).double()):
                wrong.append(tid)

    assert not run_threads(worker, 3)
    assert wrong == []


def test_views_are_overwritten_by_the_next_run_of_another_thread():
    """The documented rule, observed: a view returned to one thread changes when another thread runs."""
    runner = make_runner()
    runner.capture()
    first = runner.run(x=torch.ones(4, 4))
    kept = first["y"].clone()
    run_threads(lambda tid: runner.run(x=torch.full((4, 4), 5.0)), 1)
    assert not torch.equal(first["y"], kept)  # the other thread's step replaced it
    torch.testing.assert_close(first["y"], torch.full((4, 4), 16.0))


def test_concurrent_capture_and_close_are_safe(busy_switching):
    for _ in range(3):
        runner = make_runner()
        barrier = threading.Barrier(4)

        def capture_or_close(
            tid: int, runner: GraphRunner = runner, barrier: threading.Barrier = barrier
        ) -> None:
            barrier.wait()
            if tid % 2 == 0:
                try:
                    runner.capture()
                except ConfigError as exc:  # close() won the race: a clear error, nothing half-done
                    assert "closed" in str(exc)
            else:
                runner.close()

        assert not run_threads(capture_or_close, 4)
        # Whatever the order, the runner ends closed with no graph left behind.
        assert runner.backend.captured_keys() == []
        assert runner.static_inputs == {}
        with pytest.raises(ConfigError, match="closed"):
            runner.run(x=torch.ones(2, 4))


def test_run_while_another_thread_closes_either_runs_or_says_closed(busy_switching):
    runner = make_runner()
    runner.capture()
    outcomes: list[str] = []

    def stepper(tid: int) -> None:
        for i in range(200):
            x = torch.full((3, 4), float(i))
            try:
                out = runner.run(x=x, copy=True)
            except ConfigError as exc:
                assert "closed" in str(exc)
                outcomes.append("closed")
                return
            assert torch.equal(out["y"], x * 3 + 1)
            outcomes.append("ran")

    def closer(tid: int) -> None:
        runner.close()

    assert not run_threads(lambda tid: stepper(tid) if tid else closer(tid), 2)
    assert outcomes and outcomes[-1] in ("closed", "ran")
    assert runner.backend.captured_keys() == []
