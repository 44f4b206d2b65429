"""The shared-memory board of the data-parallel agreement (devgraph/ranks/shared_board.py): ranks of one
host post their values and read each other's maximum, step after step, a late rank is an error after the
rank timeout, and the board is chosen only where every rank is on one host (the multi-process runs of the
whole agreement are in tests/test_dp.py)."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from devgraph.errors import ConfigError
from devgraph.ranks import AGREEMENT_ENV
from devgraph.ranks import shared_board as board_module
from devgraph.ranks import transport as transport_module
from devgraph.ranks.group import RANK_TIMEOUT_ENV, PeerLost
from devgraph.ranks.shared_board import SharedBoard, _map

pytestmark = pytest.mark.timeout(60)

WIDTH = 7


def boards(tmp_path: Path, ranks: int) -> list[SharedBoard]:
    """One board per rank over one file, each rank with a mapping of its own (as processes have)."""
    size = ranks * 2 * (WIDTH + 1) * 8
    path = tmp_path / "board"
    maps = [_map(path, size, create=True)] + [_map(path, size, create=False) for _ in range(ranks - 1)]
    return [SharedBoard(m, ranks, rank, WIDTH) for rank, m in enumerate(maps)]


def run_ranks(ranks: list[SharedBoard], steps: list[list[list[int]]]) -> list[list[list[int]]]:
    """Each rank in a thread of its own: ``steps[s][r]`` is rank r's message at step s."""
    answers: list[list[list[int]]] = [[] for _ in ranks]
    errors: list[BaseException] = []

    def rank_loop(r: int) -> None:
        try:
            for message in steps:
                answers[r].append(ranks[r].max(message[r]))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(len(ranks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return answers


@pytest.mark.parametrize("count", [2, 3])
def test_every_rank_reads_the_elementwise_maximum_at_every_step(tmp_path, count):
    rng = random.Random(count)
    # Negative values too: the agreement sends each code and its negation.
    big = 2**62
    steps = [[[rng.randint(-big, big) for _ in range(WIDTH)] for _ in range(count)] for _ in range(3000)]
    answers = run_ranks(boards(tmp_path, count), steps)
    expected = [[max(column) for column in zip(*step, strict=True)] for step in steps]
    for r in range(count):
        assert answers[r] == expected


def test_a_rank_that_stops_posting_is_an_error_after_the_rank_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv(RANK_TIMEOUT_ENV, "0.3")
    first, second = boards(tmp_path, 2)
    with pytest.raises(PeerLost, match="rank 1 did not post step 1 .* within 0.3 s"):
        first.max([1] * WIDTH)
    second.close()
    first.close()


def test_late_peers_share_one_deadline_for_the_step(tmp_path, monkeypatch):
    """With three ranks, rank 1 posting shortly before the timeout must not start a new timeout for rank 2:
    the step fails one rank timeout after the wait began (a deadline per peer took 1.8 s here)."""
    monkeypatch.setenv(RANK_TIMEOUT_ENV, "1.0")
    first, second, third = boards(tmp_path, 3)

    def rank_1_posts_late() -> None:
        with contextlib.suppress(PeerLost):  # rank 2 never posts: rank 1 gives up too
            second.max([2] * WIDTH)

    late = threading.Timer(0.8, rank_1_posts_late)
    late.start()
    started = time.monotonic()
    with pytest.raises(PeerLost, match="did not post step 1"):
        first.max([1] * WIDTH)
    waited = time.monotonic() - started
    late.join()
    assert waited < 1.5, waited
    for board in (first, second, third):
        board.close()


def test_a_message_of_another_width_is_refused(tmp_path):
    first, _ = boards(tmp_path, 2)
    with pytest.raises(ValueError, match="has 3 values, the board 7"):
        first.max([1, 2, 3])


def _fake_group(monkeypatch: pytest.MonkeyPatch, rank: int, answers: list[list[Any]]) -> None:
    """``exchange`` answers from a script (what the other ranks would report), this process as ``rank``."""
    script = iter(answers)

    def exchange(group: Any, payload: Any) -> list[Any]:
        found = next(script)
        found[rank] = payload
        return found

    monkeypatch.setattr(board_module, "exchange", exchange)
    monkeypatch.setattr(board_module, "rank_of", lambda group: rank)


def test_ranks_on_two_hosts_get_no_board_and_say_why(monkeypatch):
    _fake_group(monkeypatch, 0, [[None, ("elsewhere/boot", WIDTH)]])
    board, why = SharedBoard.build(object(), WIDTH)
    assert board is None and why == "the ranks span 2 hosts"


def test_a_rank_that_cannot_map_the_board_leaves_every_rank_without_one(monkeypatch):
    host = board_module.host_identity()
    _fake_group(monkeypatch, 0, [[None, (host, WIDTH)], [None, None], [None, "could not map it: denied"]])
    board, why = SharedBoard.build(object(), WIDTH)
    assert board is None and why == "rank 1: could not map it: denied"
    assert not list(board_module.shm_directory().glob(f"devgraph-agree-{os.getpid()}-*"))  # unlinked


def test_shm_asked_across_hosts_is_a_config_error_and_auto_takes_a_collective(monkeypatch):
    no_board = classmethod(lambda cls, group, width: (None, "the ranks span 2 hosts"))
    monkeypatch.setattr(transport_module.SharedBoard, "build", no_board)
    monkeypatch.setenv(AGREEMENT_ENV, "shm")
    with pytest.raises(ConfigError, match="needs every rank .* on one host.*the ranks span 2 hosts"):
        transport_module.transport_for(object(), WIDTH)
    monkeypatch.setenv(AGREEMENT_ENV, "auto")
    monkeypatch.setattr(transport_module, "_is_nccl", lambda group: False)
    assert transport_module.transport_for(object(), WIDTH).name == "host"


def test_a_rank_lost_while_the_board_is_built_leaves_no_file_behind(monkeypatch):
    """Rank 0 creates the file, then a peer dies before every rank mapped it: the exchange raises, and the
    file in /dev/shm (named by rank 0 alone) must still go."""
    host = board_module.host_identity()
    calls = []

    def exchange(group: Any, payload: Any) -> list[Any]:
        calls.append(payload)
        if len(calls) == 1:
            return [(host, WIDTH), (host, WIDTH)] if isinstance(payload, tuple) else [host, host]
        raise PeerLost("rank 1 died")

    monkeypatch.setattr(board_module, "exchange", exchange)
    monkeypatch.setattr(board_module, "rank_of", lambda group: 0)
    with pytest.raises(PeerLost, match="rank 1 died"):
        SharedBoard.build(object(), WIDTH)
    assert len(calls) == 2
    assert not list(board_module.shm_directory().glob(f"devgraph-agree-{os.getpid()}-*"))


def test_ranks_whose_messages_differ_in_width_are_told_so_on_every_rank(monkeypatch):
    """Ranks built with other axes send messages of other widths: the board's size differs, so no rank
    could map rank 0's file, and the collective it fell back to aborted the process (gloo: "Received data
    size doesn't match expected size"). Every rank raises instead, naming both widths."""
    host = board_module.host_identity()
    _fake_group(monkeypatch, 1, [[(host, WIDTH + 1), None]])
    with pytest.raises(ConfigError, match=r"rank 0: 8 values; rank 1: 7"):
        SharedBoard.build(object(), WIDTH)
