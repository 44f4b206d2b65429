"""Sleep mode of the serving engine and of ``devgraph serve --enable-sleep-mode`` (in-process server on the
CPU): sleep frees the graphs (the simulator's pool bytes back to zero) and the KV cache, requests while
asleep get 503 JSON naming /wake_up, wake-up allocates the cache and captures the graphs again, and the
tokens are those of before (deterministic mode)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import threading
import time
from typing import Any

import pytest
import torch

from devgraph import ConfigError
from devgraph.platforms.sim.device_memory import reserved_bytes
from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.cli import add_serve_parser
from devgraph.serve.engine import Engine, EngineAsleep, EngineConfig, EngineLoop, SamplingParams
from devgraph.serve.engine.request import FinishReason, RequestOutput

pytest.importorskip("aiohttp", reason="devgraph serve needs aiohttp (pip install aiohttp)")

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

PROMPT = [5, 6, 7, 8, 9]


def make_engine() -> Engine:
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4), seed=0)
    return Engine(model, EngineConfig(4, 16, deterministic=True), device_graph_mode="full", progress=False)


def test_the_flag_parses() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve", "--enable-sleep-mode"]).enable_sleep_mode
    assert not parser.parse_args(["serve"]).enable_sleep_mode


def test_engine_sleeps_frees_graphs_and_kv_cache_and_wakes_with_the_same_tokens() -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=5)
    before = engine.generate([PROMPT], params)[0]
    gc.collect()  # pools of earlier tests' runners go now, not while this test measures
    held = reserved_bytes()
    graph_bytes = sum(r.graph_memory().total_bytes for r in (engine.decode_runner, engine.prefill_runner))
    assert held > 0 and graph_bytes > 0
    freed = engine.sleep(1)
    assert engine.is_sleeping and freed["graph_bytes"] == graph_bytes and freed["kv_cache_bytes"] > 0
    assert reserved_bytes() == held - graph_bytes
    assert all(c.numel() == 0 for c in (*engine.model.k_cache, *engine.model.v_cache))
    with pytest.raises(ConfigError, match="asleep"):
        engine.add_request(PROMPT, params)
    with pytest.raises(ConfigError, match="sleep level"):
        engine.sleep(2)
    took = engine.wake_up()
    assert not engine.is_sleeping and took["graphs_s"] >= 0
    assert all(c.numel() > 0 for c in engine.model.k_cache)
    assert reserved_bytes() == held
    engine.decode_runner.reset_stats()
    assert engine.generate([PROMPT], params)[0] == before
    assert engine.decode_runner.stats()["replays"] > 0
    engine.close()


@pytest.mark.parametrize("keys_before", [0, 1])
def test_sleep_during_a_background_capture_stops_it_and_wake_up_captures_again(keys_before: int) -> None:
    # The server captures in the background by default: a sleep right after it starts used to be a 409
    # ("the graphs are still being captured") although /health said ok.
    expected = make_engine().generate([PROMPT], SamplingParams(max_tokens=5))[0]
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4), seed=0)
    config = EngineConfig(4, 16, deterministic=True)
    engine = Engine(model, config, device_graph_mode="full", progress=False, capture=False)
    background = engine.capture_in_background()
    for _ in range(keys_before):
        background.step()
    assert not background.done
    freed = engine.sleep(1)
    assert engine.is_sleeping and background.done and background.error is None
    assert freed["graph_bytes"] > 0 if keys_before else freed["graph_bytes"] == 0
    assert engine.stats()["graph_capture"] is None  # nothing is being captured while asleep
    engine.wake_up()
    again = engine.background
    assert again is not None and again is not background and not again.done
    # A runner whose keys were all captured was restored up front; the others capture key by key again.
    assert again.total == background.total - keys_before and again.captured == 0
    again.finish()
    engine.decode_runner.reset_stats()
    assert engine.generate([PROMPT], SamplingParams(max_tokens=5))[0] == expected
    assert engine.decode_runner.stats()["replays"] > 0
    engine.close()


def test_the_engine_thread_captures_again_after_wake_up_without_waiting_for_a_request() -> None:
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4), seed=0)
    engine = Engine(model, EngineConfig(4, 16), device_graph_mode="full", progress=False, capture=False)
    engine.capture_in_background()
    loop = EngineLoop(engine)
    loop.sleep(1)  # before the engine thread's first key: it stops the capture
    loop.start()  # idle and asleep: the thread waits
    try:
        loop.wake_up()
        background = engine.background
        assert background is not None
        deadline = time.monotonic() + 30
        while not background.done and time.monotonic() < deadline:  # no request sent: the thread is idle
            time.sleep(0.01)
        assert background.progress()["ready"], background.progress()
    finally:
        loop.shutdown()
        engine.close()


def test_engine_refuses_to_sleep_with_requests_in_flight() -> None:
    engine = make_engine()
    engine.add_request(PROMPT, SamplingParams(max_tokens=3))
    with pytest.raises(ConfigError, match="in flight"):
        engine.sleep()
    assert not engine.is_sleeping
    engine.close()


def test_a_level_that_can_never_work_is_named_before_the_requests_in_flight() -> None:
    # POST /sleep?level=3 while busy: the level is the client's mistake (400), not a 409 to retry later.
    loop = EngineLoop(make_engine())
    try:
        loop.submit(PROMPT, SamplingParams(max_tokens=8), lambda output: None)  # queued: never started
        with pytest.raises(ConfigError, match="sleep level must be one of"):
            loop.sleep(3)
        with pytest.raises(ConfigError, match="in flight"):
            loop.sleep(1)
    finally:
        loop.engine.close()


def test_server_sleep_wake_up_is_sleeping_and_503_while_asleep() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from devgraph.serve.api.app import ServerState, build_app

    loop = EngineLoop(make_engine())
    loop.start()
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}

    async def main() -> list[tuple[int, Any]]:
        app = build_app(ServerState(loop, "tiny", None, 8, sleep_mode=True))
        answers: list[tuple[int, Any]] = []
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:

            async def call(method: str, path: str, **kwargs: Any) -> None:
                response = await client.request(method, path, **kwargs)
                answers.append((response.status, await response.json()))

            await call("POST", "/v1/completions", json=body)  # 0
            await call("GET", "/is_sleeping")  # 1
            await call("POST", "/sleep?level=3")  # 2
            await call("POST", "/sleep?level=1")  # 3
            await call("GET", "/is_sleeping")  # 4
            await call("POST", "/v1/completions", json=body)  # 5
            await call("GET", "/health")  # 6
            await call("POST", "/wake_up")  # 7
            await call("GET", "/is_sleeping")  # 8
            await call("POST", "/v1/completions", json=body)  # 9
        return answers

    try:
        answers = asyncio.run(main())
    finally:
        loop.shutdown()
        loop.engine.close()
    statuses = [a[0] for a in answers]
    assert statuses == [200, 200, 400, 200, 200, 503, 200, 200, 200, 200], answers
    assert answers[1][1] == {"is_sleeping": False} and answers[4][1] == {"is_sleeping": True}
    assert "level" in answers[2][1]["error"]["message"]
    assert answers[3][1]["is_sleeping"] and answers[3][1]["graph_bytes"] > 0
    assert "/wake_up" in answers[5][1]["error"]["message"]
    assert answers[6][1] == {"status": "sleeping"} and answers[8][1] == {"is_sleeping": False}
    assert answers[9][1]["choices"][0]["token_ids"] == answers[0][1]["choices"][0]["token_ids"]


def test_routes_absent_without_the_flag_and_submit_refused_while_asleep() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from devgraph.serve.api.app import ServerState, build_app

    async def main() -> int:
        app = build_app(ServerState(engine=None, model_name="tiny", metrics=None, max_queued=1))  # type: ignore[arg-type]
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            return (await client.post("/sleep")).status

    assert asyncio.run(main()) == 404
    loop = EngineLoop(make_engine())
    loop.start()
    try:
        loop.sleep(1)
        with pytest.raises(EngineAsleep, match="wake_up"):
            loop.submit(PROMPT, SamplingParams(max_tokens=2), lambda output: None)
        loop.wake_up()
        assert not loop.is_sleeping
    finally:
        loop.shutdown()
        loop.engine.close()


@pytest.mark.cuda
def test_cuda_sleep_hands_the_graph_pool_back_and_wakes_with_the_same_tokens() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4), device="cuda", seed=0)
    engine = Engine(model, EngineConfig(4, 16, deterministic=True), device_graph_mode="full", progress=False)
    params = SamplingParams(max_tokens=5)
    before = engine.generate([PROMPT], params)[0]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    freed = engine.sleep(1)
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0]
    assert freed["graph_bytes"] > 0 and free_after - free_before >= 0.95 * freed["graph_bytes"]
    engine.wake_up()
    assert engine.generate([PROMPT], params)[0] == before
    engine.close()


class _SlowToLock:
    """The engine loop's state lock, reached a little late by the engine thread: the window between taking
    requests off the queue and locking the engine, where ``sleep()`` used to find no work, made wide
    enough to hit every time instead of in about half of the rounds."""

    def __init__(self, lock: Any, engine_thread: str) -> None:
        self.lock, self.engine_thread = lock, engine_thread

    def __enter__(self) -> None:
        if threading.current_thread().name == self.engine_thread:
            time.sleep(0.02)
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_a_request_racing_sleep_completes_or_is_refused_before_it_starts() -> None:
    """Each round submits a request and at once puts the engine to sleep: the request is refused
    (EngineAsleep: 503 before its stream starts) or accepted and then completes (sleep is refused while it
    is in flight); never accepted and then failed (a 500 error event, before the fix)."""
    loop = EngineLoop(make_engine())
    loop._state_lock = _SlowToLock(loop._state_lock, "devgraph-engine")  # type: ignore[assignment]
    loop.start()
    try:
        for round_ in range(20):
            outcome = _race_once(loop)
            assert outcome in ("completed", "refused"), (round_, outcome)
    finally:
        loop.shutdown()
        loop.engine.close()


def _race_once(loop: EngineLoop) -> str:
    outputs: list[RequestOutput] = []
    finished = threading.Event()

    def sink(output: RequestOutput) -> None:
        outputs.append(output)
        if output.finished:
            finished.set()

    try:
        loop.submit(PROMPT, SamplingParams(max_tokens=2), sink)
    except EngineAsleep:
        return "refused"
    time.sleep(0.002)  # the engine thread takes the request off the queue, then reaches for its lock
    with contextlib.suppress(ConfigError):  # refused while a request is in flight
        loop.sleep(1)
    slept = loop.is_sleeping
    assert finished.wait(30)
    if slept:
        loop.wake_up()
    last = outputs[-1]
    tokens = sum(len(o.token_ids) for o in outputs)
    if last.finish_reason is FinishReason.LENGTH and tokens == 2:
        return "completed"
    return f"failed: {last.finish_reason} {last.error}"
