"""``devgraph serve --record-steps PATH`` end to end on the CPU: a server records its traffic (written while
it serves and again at shutdown), ``devgraph tune`` reads the file, and a second server starts with
``--tuned`` and captures the tuned sizes, saying which size it adds."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from servers import ServerProcess

from devgraph.cli import main
from devgraph.flag.trace import load_steps

pytest.importorskip("aiohttp", reason="devgraph serve needs aiohttp (pip install aiohttp)")

pytestmark = [pytest.mark.timeout(300)]

FLAGS = ["--preset", "tiny", "--device", "cpu", "--max-running-requests", "4", "--token-budget", "64"]


def _traffic(server: ServerProcess, rounds: int) -> None:
    """Concurrent requests of several prompt lengths: prefill chunks of many sizes, decode batches of 1-4."""
    lengths = [3, 5, 9, 17, 30]

    def one(i: int) -> None:
        prompt = list(range(5, 5 + lengths[i % len(lengths)]))
        status, body = server.post({"prompt": prompt, "max_tokens": 3 + i % 4, "temperature": 0})
        assert status == 200, body

    for _ in range(rounds):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def test_serve_records_steps_that_tune_reads_and_serve_tuned_uses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "steps.json"
    server = ServerProcess(*FLAGS, "--record-steps", str(trace), "--record-interval", "0.5")
    try:
        _traffic(server, 3)
        deadline = time.monotonic() + 30
        while not trace.exists() and time.monotonic() < deadline:  # written while serving
            time.sleep(0.1)
        assert trace.exists(), "".join(server.stderr)[-2000:]
        while_serving = load_steps(trace)
        _traffic(server, 2)
    finally:
        assert server.stop() == 0
    recorded = load_steps(trace)
    decode, prefill = recorded["decode"], recorded["prefill"]
    assert decode.steps > 0 and prefill.steps > 0
    assert decode.steps > while_serving["decode"].steps  # the last steps were written at shutdown
    assert prefill.axes == ("tokens", "requests") and decode.sizes and decode.graph_bytes

    tuned = tmp_path / "tuned.json"
    assert main(["tune", str(trace), "--graphs", "2", "--out", str(tuned)]) == 0
    capsys.readouterr()
    sizes = json.loads(tuned.read_text())
    assert len(sizes["decode"]["sizes"]) <= 2 and len(sizes["prefill"]["sizes"]) <= 2

    second = ServerProcess(*FLAGS, "--tuned", str(tuned))
    try:
        status, body = second.post({"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
        assert status == 200, body
        runners = second.stats()["runners"]
    finally:
        assert second.stop() == 0
    log = "".join(second.stderr)
    for phase, limit in (("decode", 4), ("prefill", 64)):
        captured = {int(key.split(",")[0].split("=")[1]) for key in runners[phase]["graph_memory"]["by_key"]}
        assert set(sizes[phase]["sizes"]) | {limit} == captured, (phase, captured)
        if limit not in sizes[phase]["sizes"]:  # the engine's largest step: added, and the log says so
            assert f"{phase} graphs: [{limit}] besides the sizes asked for" in log, log[-3000:]


def test_a_record_path_that_cannot_be_written_is_refused_before_start_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path, needle in (
        (tmp_path, "is a directory"),
        (tmp_path / "no" / "steps.json", "does not exist"),
    ):
        assert main(["serve", *FLAGS, "--port", "0", "--record-steps", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1 and err[0].startswith("devgraph serve: error: --record-steps") and needle in err[0]
        )
