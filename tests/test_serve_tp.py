"""``devgraph serve --tp 2`` as a subprocess on tiny local checkpoints (Llama: untied, vocab-parallel LM
head, GQA; Qwen3: per-head q/k norms sliced per rank, against transformers' own greedy tokens): on the CPU two
processes over gloo, graphs simulated; ``multi_gpu``: two GPUs over NCCL.

Its greedy tokens equal the single-process server's for prompts sent together (deterministic mode, so a
request's tokens do not depend on its batch); SIGTERM stops rank 0 and its worker; a killed worker makes
the in-flight request end with an error and the server exit 1 with a message naming the rank.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from servers import ServerProcess

pytest.importorskip("aiohttp", reason="devgraph serve needs aiohttp")
pytest.importorskip("transformers", reason="the test checkpoint is written with transformers")
pytestmark = pytest.mark.timeout(180)

COMMON = ["--cpu-threads", "1", "--max-running-requests", "4", "--token-budget", "32", "--deterministic"]
# The third prompt is longer than the 32-token step: a chunked prefill crosses ranks too.
PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30], [7] * 40, [300, 5, 17, 42, 99, 100]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Checkpoints written on first use, per family."""
    from checkpoints import build_checkpoint

    root, built = tmp_path_factory.mktemp("tp"), {}

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, family: str) -> Path:
            built[family] = build_checkpoint(root / family, family)
            return built[family]

    yield Lazy()


def _greedy(server: ServerProcess, prompts: list[list[int]]) -> list[list[int]]:
    def one(prompt: list[int]) -> list[int]:
        status, body = server.post({"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0})
        assert status == 200, body
        return list(body["choices"][0]["token_ids"])

    with ThreadPoolExecutor(len(prompts)) as pool:  # together: batched steps on both servers
        return list(pool.map(one, prompts))


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return True
    return state == "Z"


@pytest.fixture
def servers(
    checkpoint_dirs: dict[str, Path], request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[dict[str, ServerProcess]]:
    """The single-process server and the ``--tp 2`` one, whose rank 0 records its step timeline."""
    device, family = request.param
    flags = ["--model", str(checkpoint_dirs[family]), "--device", device, *COMMON]
    started: dict[str, ServerProcess] = {}
    try:
        started["single"] = ServerProcess(*flags)
        timeline = {"DEVGRAPH_STEP_TIMELINE": str(tmp_path / "timeline.json")}
        started["tp"] = ServerProcess(*flags, "--tp", "2", env=timeline)
        yield started
    finally:
        for server in started.values():
            server.stop()


def _check_equal_then_stop(servers: dict[str, ServerProcess], timeline: Path) -> None:
    single, tp = servers["single"], servers["tp"]
    expected = _greedy(single, PROMPTS)
    assert all(len(tokens) == NEW_TOKENS for tokens in expected)
    assert _greedy(tp, PROMPTS) == expected
    workers = tp.workers()
    assert len(workers) == 1
    assert tp.stop() == 0
    assert all(_gone(pid) for pid in workers), "SIGTERM on rank 0 left a worker running"
    # Every step after the warm-up, written at exit: prefill (and mixed) steps, then decodes; one step
    # at least per token of the longest request.
    data = json.loads(timeline.read_text())
    steps = data["steps"]
    assert {s["phase"] for s in steps} == {"prefill", "decode"}
    assert len(steps) >= NEW_TOKENS
    assert all(s["device_end_ms"] >= s["device_start_ms"] for s in steps)
    assert all(s["host_end_s"] >= s["host_s"] for s in steps)
    # The worker's own file: a span per step it ran, every step of rank 0's (warm-up ones too), each got
    # after rank 0 began it (one host clock) and issued after it got it.
    worker = json.loads(timeline.with_name(timeline.name + ".rank1").read_text())["spans"]
    by_step = {span["step"]: span for span in worker}
    assert len(by_step) == len(worker)
    spans = data["spans"]
    assert spans and {span["step"] for span in spans} <= set(by_step)
    for span in spans:
        got = by_step[span["step"]]
        assert got["phase"] == span["phase"] and got["tokens"] == span["tokens"]
        assert span["host_s"] <= got["host_s"] <= got["host_end_s"]


@pytest.mark.parametrize("servers", [("cpu", "llama")], indirect=True, ids=["llama"])
def test_tp2_greedy_tokens_equal_the_single_process_server(
    servers: dict[str, ServerProcess], tmp_path: Path
) -> None:
    _check_equal_then_stop(servers, tmp_path / "timeline.json")


@pytest.mark.multi_gpu
@pytest.mark.parametrize(
    "servers", [("cuda", "llama"), ("cuda", "qwen3")], indirect=True, ids=["llama", "qwen3"]
)
def test_tp2_on_two_gpus_greedy_tokens_equal_one_gpu(
    servers: dict[str, ServerProcess], tmp_path: Path
) -> None:
    _check_equal_then_stop(servers, tmp_path / "timeline.json")


def _stream_until_end(server: ServerProcess, started: list[float]) -> dict[str, Any]:
    """A long streamed request; returns the error event (if any) and the tokens before it."""
    payload = {"prompt": [1, 2, 3], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    result: dict[str, Any] = {"tokens": 0, "error": None}
    for event in server.stream(payload, timeout=60):
        if "error" in event:
            result["error"] = event["error"]
            break
        result["tokens"] += 1
        if not started:
            started.append(time.monotonic())
    return result


def _kill_the_worker_mid_stream(server: ServerProcess) -> None:
    """SIGKILL the worker while a long request streams: the request ends with an error event naming the
    rank, the server exits 1 within seconds (on a GPU rank 0 may be stuck in a collective with the dead
    rank: it is ended after EXIT_GRACE_S), its log names the rank."""
    (worker,) = server.workers()
    started: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream_until_end, server, started)
        while not started and not stream.done():
            time.sleep(0.01)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        result = stream.result(timeout=60)
    assert started  # the stream had begun (status 200); its last event is the error
    assert result["error"] is not None, result
    assert "tensor-parallel rank" in result["error"]["message"]
    assert result["tokens"] < 200
    code = server.proc.wait(timeout=60)
    assert code == 1
    assert time.monotonic() - killed < 15
    log = "".join(server.stderr)
    assert "tensor-parallel rank 1" in log and "exiting (code 1)" in log


def test_qwen3_under_tp2_equals_transformers_then_a_killed_worker_stops_it(
    checkpoint_dirs: dict[str, Path],
) -> None:
    """Qwen3 (per-head q/k norms sliced per rank, tied head): greedy tokens equal transformers' own, then
    the worker is killed mid-stream: the request ends with an error naming the rank, the server exits 1."""
    from checkpoints import hf_greedy

    directory = checkpoint_dirs["qwen3"]
    server = ServerProcess("--model", str(directory), "--device", "cpu", *COMMON, "--tp", "2")
    try:
        expected = [greedy.tokens for greedy in hf_greedy(directory, PROMPTS[:2], NEW_TOKENS)]
        assert _greedy(server, PROMPTS[:2]) == expected
        _kill_the_worker_mid_stream(server)
    finally:
        server.stop()


@pytest.mark.multi_gpu
def test_a_worker_killed_on_two_gpus_fails_the_stream_and_the_server_exits(
    checkpoint_dirs: dict[str, Path],
) -> None:
    server = ServerProcess("--model", str(checkpoint_dirs["llama"]), "--device", "cuda", *COMMON, "--tp", "2")
    try:
        assert len(_greedy(server, PROMPTS[:1])[0]) == NEW_TOKENS
        _kill_the_worker_mid_stream(server)
    finally:
        server.stop()


@pytest.mark.slow  # ~15 s: it waits out a short rank timeout twice (idle, then stuck)
def test_heartbeats_keep_an_idle_server_and_a_stuck_worker_times_out(
    checkpoint_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DEVGRAPH_RANK_TIMEOUT_S=3: idle for longer than that, the server still answers (rank 0's heartbeats);
    a worker stopped with SIGSTOP (alive, not answering) fails the next request with a 500 naming the
    timeout, and the server exits 1 and takes the stuck worker with it."""
    monkeypatch.setenv("DEVGRAPH_RANK_TIMEOUT_S", "3")
    server = ServerProcess("--model", str(checkpoint_dirs["llama"]), "--device", "cpu", *COMMON, "--tp", "2")
    try:
        (worker,) = server.workers()
        time.sleep(7)
        assert server.post({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})[0] == 200
        os.kill(worker, signal.SIGSTOP)
        status, body = server.post({"prompt": [1, 2, 3], "max_tokens": 30, "temperature": 0})
        assert status == 500, body
        message = body["error"]["message"]
        assert "tensor-parallel rank was lost" in message and "DEVGRAPH_RANK_TIMEOUT_S=3" in message
        assert server.proc.wait(timeout=60) == 1
        deadline = time.monotonic() + 10
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker), "the stuck worker outlived rank 0"
    finally:
        server.stop()


@pytest.mark.parametrize(
    "flag", [["--enable-sleep-mode"], ["--capture-in-background"], ["--gpu-memory-utilization", "0.5"]]
)
def test_flags_that_act_on_rank_0_alone_are_refused_before_any_rank_starts(flag, capsys) -> None:
    from devgraph.cli.main import main

    assert main(["serve", "--model", "tiny", "--tp", "2", *flag]) == 2
    assert f"{flag[0]} is not available with --tp yet" in capsys.readouterr().err


def test_an_unknown_tp_comm_names_the_variable_and_the_accepted_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from devgraph.errors import ConfigError
    from devgraph.reference import ReferenceConfig
    from devgraph.serve.checkpoint.source import TP_COMM_ENV, _tp_model

    monkeypatch.setenv(TP_COMM_ENV, "pigeon")
    with pytest.raises(
        ConfigError, match="DEVGRAPH_TP_COMM='pigeon' is unknown; accepted: auto, torch, op, symm"
    ):
        _tp_model(ReferenceConfig.preset("tiny"), None, torch.device("cpu"), 0, "random")


def test_tp_fuse_takes_0_or_1_and_reaches_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from devgraph.errors import ConfigError
    from devgraph.reference import ReferenceConfig
    from devgraph.reference.tp import TPReferenceModel
    from devgraph.serve.checkpoint.source import TP_FUSE_ENV, _tp_model

    seen: list[bool] = []
    original = TPReferenceModel.__init__

    def spy(self, *args, fuse_all_reduce=True, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(fuse_all_reduce)
        original(self, *args, fuse_all_reduce=fuse_all_reduce, **kwargs)

    monkeypatch.setattr(TPReferenceModel, "__init__", spy)
    config = ReferenceConfig.preset("tiny")
    for value, fused in (("", True), ("1", True), ("0", False)):
        monkeypatch.setenv(TP_FUSE_ENV, value)
        _tp_model(config, None, torch.device("cpu"), 0, "random")
        assert seen[-1] is fused
    monkeypatch.setenv(TP_FUSE_ENV, "yes")
    with pytest.raises(
        ConfigError, match="DEVGRAPH_TP_FUSE='yes' is unknown; accepted: 0 .apart. or 1 .fused."
    ):
        _tp_model(config, None, torch.device("cpu"), 0, "random")
