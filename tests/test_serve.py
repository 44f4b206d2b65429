"""``devgraph serve`` as a real subprocess on a free local port (127.0.0.1 only), tiny preset on the CPU:
streaming equals the eager engine, every bad input gets its 4xx, disconnects and 1000 requests leave no
KV block behind, SIGTERM drains and exits 0. Plus the tokenizer, protocol and load-generator pieces."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from servers import ServerProcess

from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.api.completions import parse_completion
from devgraph.serve.api.protocol import ApiError
from devgraph.serve.bench.report import percentile, summarize
from devgraph.serve.checkpoint.byte_tokenizer import ByteTokenizer, StreamDecoder
from devgraph.serve.engine import Engine, EngineConfig, SamplingParams

aiohttp = pytest.importorskip("aiohttp", reason="devgraph serve needs aiohttp (pip install aiohttp)")

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
# Small shapes so capture takes a second or two; one torch thread (the CPU runners share two cores).
COMMON = ["--preset", "tiny", "--device", "cpu", "--cpu-threads", "1", "--max-running-requests", "8"]


class Server(ServerProcess):
    def __init__(self, *flags: str) -> None:
        super().__init__(*COMMON, *flags)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """Deterministic mode with graphs: each request's tokens are what the eager engine gives it alone."""
    srv = Server(
        "--device-graph-mode", "auto", "--deterministic", "--token-budget", "32", "--body-timeout", "2"
    )
    yield srv
    assert srv.stop() == 0, "".join(srv.stderr)[-2000:]


@pytest.fixture(scope="module")
def mixed_server() -> Iterator[Server]:
    """The default engine (size ladders, mixed prefill + decode steps) with graphs."""
    srv = Server("--device-graph-mode", "auto", "--token-budget", "32", "--drain-timeout", "30")
    yield srv
    srv.stop()


async def _stream(url: str, payload: dict[str, Any]) -> tuple[list[int], str | None, str]:
    tokens: list[int] = []
    text, reason = "", None
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json={**payload, "stream": True}) as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += choice["token_ids"]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
    return tokens, reason, text


# -- over HTTP ------------------------------------------------------------------------------------------
def test_concurrent_streams_equal_the_eager_engine(server: Server) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(2, 60))] for _ in range(10)]
    lengths = [rng.randint(1, 12) for _ in prompts]
    sampled = {3: 5, 7: 6}  # request index -> seed (temperature 0.8); the rest greedy

    def payload(i: int) -> dict[str, Any]:
        extra = {"temperature": 0.8, "seed": sampled[i]} if i in sampled else {"temperature": 0}
        return {"prompt": prompts[i], "max_tokens": lengths[i], **extra}

    async def all_streams() -> list[tuple[list[int], str | None, str]]:
        return await asyncio.gather(*(_stream(server.url, payload(i)) for i in range(len(prompts))))

    served = asyncio.run(all_streams())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=8), seed=0)
        engine = Engine(
            model, EngineConfig(8, 32, deterministic=True), device_graph_mode="disabled", progress=False
        )
        params = [
            SamplingParams(max_tokens=n, temperature=0.8 if i in sampled else 0.0, seed=sampled.get(i))
            for i, n in enumerate(lengths)
        ]
        expected = engine.generate(prompts, params)
    finally:
        torch.set_num_threads(threads)
    assert [tokens for tokens, _, _ in served] == expected
    assert all(reason == "length" for _, reason, _ in served)
    assert served[0][2] == ByteTokenizer().decode(expected[0])
    stats = server.wait_idle()
    assert stats["runners"]["decode"]["replays"] > 0


def test_text_prompt_and_non_streaming_response(server: Server) -> None:
    status, body = server.post({"model": "tiny", "prompt": "héllo", "max_tokens": 3, "temperature": 0})
    assert status == 200
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"
    assert choice["text"] == ByteTokenizer().decode(choice["token_ids"])
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
    status, models = server.request("GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny" and models["data"][0]["vocab_size"] == 512


@pytest.mark.parametrize(
    ("payload", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        ({"max_tokens": 3}, 400, "missing field 'prompt'"),
        ({"prompt": list(range(1, 300)), "max_tokens": 4}, 400, "context"),
        ({"prompt": "x" * 300}, 400, "context"),
        ({"prompt": [1, 2], "max_tokens": -5}, 400, "max_tokens"),
        ({"prompt": [1, 2], "max_tokens": "ten"}, 400, "max_tokens"),
        ({"prompt": [1, 2], "model": "gpt-4"}, 404, "not served"),
        ({"prompt": [1, 9999]}, 400, "token ids"),
        ({"prompt": []}, 400, "empty"),
        ({"prompt": ["a", 7]}, 400, "a list of those"),
        ({"prompt": ["a", []]}, 400, "prompt[1]: the prompt is empty"),
        ({"prompt": [[1]] * 257}, 400, "at most 256 prompts"),
        ({"prompt": [1], "temperature": "hot"}, 400, "temperature"),
        ({"prompt": [1], "top_p": 0}, 400, "top_p"),
        ({"prompt": [1], "stop": [""]}, 400, "at most 16 strings of 1 to 256 characters"),
        ({"prompt": [1], "stop": ["x"] * 17}, 400, "at most 16 strings"),
        ({"prompt": [1], "prompt_logprobs": 21}, 400, "prompt_logprobs must be an integer from 0 to 20"),
        ({"prompt": [1], "logprobs": 21}, 400, "logprobs must be an integer from 0 to 20"),
        ({"prompt": [1], "top_k": -2}, 400, "top_k must be an int >= 0"),
        ({"prompt": [1], "presence_penalty": 0.1}, 400, "presence_penalty 0.1 is not implemented"),
        ({"prompt": [1], "frequency_penalty": -1}, 400, "frequency_penalty -1 is not implemented"),
        ({"prompt": [1], "logit_bias": {"5": 1}}, 400, "logit_bias"),
        ({"prompt": [1], "best_of": 2, "n": 3}, 400, "best_of must be an integer from n (3)"),
        ({"prompt": [1], "best_of": 2, "stream": True}, 400, "best_of > n cannot stream"),
        ({"prompt": [1], "suffix": "x"}, 400, "suffix"),
        ({"prompt": [1], "frobnicate": 1}, 400, "does not take the field 'frobnicate'"),
        ({"prompt": [1], "stream_options": {"include_usage": True}}, 400, "only allowed with stream"),
        ({"prompt": [1], "stream": True, "stream_options": {"x": 1}}, 400, "stream_options does not take"),
        ({"prompt": [1], "stream": "yes"}, 400, "stream"),
        ({"prompt": [1], "n": 0}, 400, "n must be an integer from 1 to 64"),
        ({"prompt": [1], "n": 9}, 400, "at most 8 requests run at once"),
        (
            {"prompt": [1], "stream": True, "stream_options": {"continuous_usage_stats": 1}},
            400,
            "stream_options",
        ),
        (b'{"prompt": "' + b"a" * (1 << 21) + b'"}', 413, "too large"),
        ({"prompt": [1], "temperature": 1e-40}, 400, "0 (greedy) or a number from 0.0001 to 100"),
        ({"prompt": [1], "top_p": 1e-50}, 400, "top_p must be a number from 0.0001 to 1"),
        ({"prompt": [1], "seed": -3}, 400, "seed must be an int >= 0"),
        ({"prompt": [1], "stop": [7] * 100_000}, 400, "at most 64 stop token ids"),
        ({"prompt": [1], "stop": [7] * 40, "stop_token_ids": [8] * 40}, 400, "at most 64 stop token ids"),
        (b'{"prompt": "\\ud800"}', 400, "not valid Unicode"),
        (b'{"prompt": [1' + b"1" * 5000 + b"]}", 400, "not valid JSON"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested too deeply"),
    ],
)
def test_bad_input_gets_a_4xx_json_error_and_the_server_keeps_serving(
    server: Server, payload: Any, status: int, needle: str
) -> None:
    got, body = server.post(payload)
    assert got == status, body
    assert needle in body["error"]["message"]
    assert body["error"]["code"] == status
    assert _healthy(server)


def _raw(server: Server, method: str, path: str, body: bytes | None) -> tuple[int, str, Any, str]:
    """Status, Content-Type, the JSON body and the Allow header of one request (any method)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request(method, path, body)
    response = connection.getresponse()
    raw = response.read()
    connection.close()
    content_type = response.headers.get("Content-Type", "")
    return response.status, content_type, json.loads(raw) if raw else None, response.headers.get("Allow", "")


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "needle"),
    [
        (
            "GET",
            "/nope",
            None,
            404,
            "Not Found; routes: POST /v1/completions, POST /v1/chat/completions, GET",
        ),
        (
            "POST",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}]}',
            400,
            "no chat",
        ),
        ("GET", "/v1/models/gpt-4", None, 404, "model 'gpt-4' is not served here"),
        ("GET", "/v1/completions", None, 405, "Method Not Allowed"),
        ("DELETE", "/health", None, 405, "Method Not Allowed"),
        ("PUT", "/v1/models", b"{}", 405, "Method Not Allowed"),
        ("POST", "/v1/completions", b"{bad", 400, "not valid JSON"),
        ("POST", "/v1/completions", b"x" * (1 << 21), 413, "too large"),
    ],
)
def test_every_route_answers_every_error_as_openai_json(
    server: Server, method: str, path: str, body: bytes | None, status: int, needle: str
) -> None:
    got, content_type, payload, allow = _raw(server, method, path, body)
    assert (got, content_type.split(";")[0]) == (status, "application/json"), payload
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    assert needle in payload["error"]["message"] and payload["error"]["code"] == status
    assert payload["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if status == 405:
        assert allow, "405 names the methods the route takes"


def test_unexpected_failures_and_a_missing_metrics_extra_are_json_too() -> None:
    """In-process: a handler that raises (a bug) answers 500 JSON; /metrics without prometheus_client
    answers 501 JSON with the install hint."""
    from aiohttp.test_utils import TestClient, TestServer

    from devgraph.serve.api.app import ServerState, build_app

    async def broken(request: Any) -> Any:
        raise RuntimeError("a bug in a handler")

    async def main() -> list[tuple[int, dict[str, Any]]]:
        app = build_app(ServerState(engine=None, model_name="tiny", metrics=None, max_queued=1))  # type: ignore[arg-type]
        app.router.add_get("/broken", broken)
        answers = []
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            for path in ("/broken", "/metrics"):
                response = await client.get(path)
                answers.append((response.status, await response.json()))
        return answers

    (status, broken_body), (metrics_status, metrics_body) = asyncio.run(main())
    assert status == 500 and broken_body["error"]["type"] == "server_error"
    assert "see its log" in broken_body["error"]["message"]
    assert metrics_status == 501
    assert metrics_body["error"]["message"] == (
        "GET /metrics needs prometheus_client, which is not installed: pip install 'devgraph[serve]'"
    )


def test_a_failure_after_a_stream_began_ends_the_stream_with_an_error_event() -> None:
    """In-process: a bug while a stream is under way (the first events sent) ends it with an error event
    and [DONE]; it answered a 500 response written into the open stream (a corrupt chunked body)."""
    from types import SimpleNamespace

    from aiohttp.test_utils import TestClient, TestServer

    from devgraph.serve.api import generate
    from devgraph.serve.api.app import ServerState, build_app

    aborted = []

    async def failing_next(queue: Any) -> Any:
        raise ValueError("a bug while streaming")

    run = SimpleNamespace(
        generation=SimpleNamespace(model="tiny", continuous_usage=False, include_usage=True),
        groups={"cmpl-1": None},
        choices={0: SimpleNamespace(index=0)},
        open=1,
        failed=None,
        next=failing_next,
        abort=lambda: aborted.append(True),
    )
    shape = SimpleNamespace(object="text_completion", opening=lambda choice: {"index": 0, "text": ""})

    async def streaming(request: Any) -> Any:
        return await generate._stream(request, run, shape, asyncio.Queue())  # type: ignore[arg-type]

    async def main() -> tuple[int, bytes]:
        app = build_app(ServerState(engine=None, model_name="tiny", metrics=None, max_queued=1))  # type: ignore[arg-type]
        app.router.add_get("/streaming", streaming)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            response = await client.get("/streaming")
            return response.status, await response.read()

    status, body = asyncio.run(main())
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and b"HTTP/1.1" not in body, body
    assert json.loads(events[0])["choices"] == [{"index": 0, "text": ""}]
    assert json.loads(events[1])["error"]["message"].startswith("the server failed while streaming")
    assert events[2:] == ["[DONE]"] and aborted == [True]


def test_start_up_logs_each_stage_when_stderr_is_not_a_terminal(server: Server) -> None:
    # The server fixture's stderr is a pipe: no bar, one INFO line per stage and per captured graph (in the
    # background, the default; test_serve_background.py has the lines of a capture before listening).
    log = "".join(server.stderr)
    for line in (
        "devgraph.serve.startup INFO building the model: preset 'tiny', random weights",
        "devgraph.serve.startup INFO model ready in",
        "devgraph.serve.startup INFO serving before the graphs (--device-graph-mode auto): captured between",
        "devgraph.serve.startup INFO graphs set up in",
        "devgraph.runner.life INFO captured decode graph 1/1 (tokens=8,requests=8, full) in the background",
        "devgraph.runner.life INFO captured prefill graph 1/1",
        "devgraph.serve.api.server INFO warm-up requests served in",
        "devgraph.serve.engine.engine_thread INFO all 2 graphs captured in the background",
    ):
        assert line in log, log[-3000:]


def test_a_client_that_stalls_mid_body_gets_408_after_the_body_timeout(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        reply = sock.recv(4096)
        waited = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"did not arrive within 2 s" in reply
    assert 1.5 < waited < 12
    assert _healthy(server)


def test_client_disconnect_mid_stream_frees_its_blocks(server: Server) -> None:
    total = server.wait_idle()["kv_blocks_total"]
    aborted_before = server.stats()["finished"].get("abort", 0)
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"prompt": [1, 2, 3, 4], "max_tokens": 240, "temperature": 0, "stream": True})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the first token arrived: the request is running
    connection.close()
    stats = server.wait_idle()
    assert stats["kv_blocks_free"] == total
    assert stats["finished"].get("abort", 0) == aborted_before + 1


def _quiet_hang_ups(server: Server, logged: int, count: int) -> list[str]:
    """The server's log since line ``logged`` once it has told of ``count`` clients that hung up."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = server.stderr[logged:]
        if sum("the client closed the connection" in line for line in lines) >= count:
            return lines
        time.sleep(0.05)
    raise AssertionError("".join(server.stderr[logged:])[-3000:])


def test_a_client_that_hangs_up_is_no_server_error(server: Server) -> None:
    # Mid-body (the body's read fails) and mid-stream (where the next token's write fails): each is logged
    # as the client's doing in one line, never as a failed request with a traceback.
    logged = len(server.stderr)
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"prompt": [1, 2, 3, 4], "max_tokens": 200, "n": 2, "stream": True})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert connection.getresponse().readline().startswith(b"data: ")
    connection.close()
    server.wait_idle()
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt"')
    lines = _quiet_hang_ups(server, logged, 1)  # the body's, at least (a stream may end unwritten)
    assert not any("Traceback" in line or " ERROR " in line for line in lines), "".join(lines)
    assert server.post({"prompt": [1, 2], "max_tokens": 2})[0] == 200


def test_metrics_expose_runner_statistics_and_latency_histograms(server: Server) -> None:
    pytest.importorskip("prometheus_client")
    server.post({"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0})
    status, text = server.request("GET", "/metrics")
    assert status == 200
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)

    def value(prefix: str, **labels: str) -> float:
        hits = [
            v
            for k, v in samples.items()
            if k.split("{")[0] == prefix and all(f'{a}="{b}"' in k for a, b in labels.items())
        ]
        assert len(hits) == 1, (prefix, labels, hits)
        return hits[0]

    assert value("devgraph_replays_total", phase="decode", key="tokens=8,requests=8") > 0
    assert value("devgraph_eager_steps_total", phase="prefill", reason="past_largest") == 0
    assert value("devgraph_padding_waste_ratio", phase="decode") == 0  # the engine pads, not the runner
    assert value("devgraph_engine_padding_tokens_total") > 0
    assert value("vllm:time_to_first_token_seconds_count", model_name="tiny") > 0
    assert value("vllm:inter_token_latency_seconds_count", engine="0") > 0
    assert value("vllm:request_success_total", finished_reason="length") > 0
    assert value("vllm:num_requests_running") == 0
    assert value("vllm:kv_cache_usage_perc") == 0
    assert value("devgraph_serve_kv_blocks_free") == value("devgraph_serve_kv_blocks_total")


def test_a_thousand_requests_leave_the_allocator_full(mixed_server: Server) -> None:
    total = mixed_server.wait_idle()["kv_blocks_total"]
    rng = random.Random(1)

    async def one(session: Any, i: int, gate: asyncio.Semaphore) -> int:
        payload = {
            "prompt": [rng.randrange(512) for _ in range(rng.randint(1, 6))],
            "max_tokens": rng.randint(1, 2),
            "temperature": 0,
            "stream": i % 2 == 0,
        }
        async with gate, session.post(f"{mixed_server.url}/v1/completions", json=payload) as response:
            await response.read()
            return response.status

    async def run() -> list[int]:
        gate = asyncio.Semaphore(48)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(one(session, i, gate) for i in range(1000)))

    start = time.monotonic()
    statuses = asyncio.run(run())
    assert statuses == [200] * 1000
    stats = mixed_server.wait_idle()
    assert stats["kv_blocks_free"] == total
    assert sum(stats["finished"].values()) >= 1000
    assert stats["steps"].get("mixed", 0) > 0
    assert time.monotonic() - start < 120


def test_sigterm_drains_in_flight_streams_and_exits_zero(mixed_server: Server) -> None:
    result: dict[str, Any] = {}
    # A slowloris client (headers and part of a body, then nothing) must not hold the exit past the drain.
    stalled = socket.create_connection(("127.0.0.1", mixed_server.port), timeout=30)
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    signalled: list[float] = []

    async def stream_then_signal() -> None:
        async with aiohttp.ClientSession() as session:
            payload = {"prompt": [7, 8, 9], "max_tokens": 200, "temperature": 0, "stream": True}
            async with session.post(f"{mixed_server.url}/v1/completions", json=payload) as response:
                tokens, reason, done = 0, None, False
                async for raw in response.content:
                    line = raw.strip()
                    if line == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data: "):
                        choice = json.loads(line[6:])["choices"][0]
                        tokens += len(choice["token_ids"])
                        reason = choice["finish_reason"] or reason
                        if tokens == 1:
                            mixed_server.proc.send_signal(signal.SIGTERM)
                            signalled.append(time.monotonic())
                result.update(tokens=tokens, reason=reason, done=done)

    asyncio.run(stream_then_signal())
    drained = time.monotonic()
    try:
        assert mixed_server.proc.wait(timeout=60) == 0, "".join(mixed_server.stderr)[-2000:]
    finally:
        stalled.close()
    # The stream finished well inside --drain-timeout 30; the stalled body gets a grace second, not 60.
    assert time.monotonic() - drained < 10, time.monotonic() - signalled[0]
    assert result == {"tokens": 200, "reason": "length", "done": True}  # drained, not cut
    assert "shutting down" in "".join(mixed_server.stderr)


def test_load_generator_reports_percentiles_over_http(server: Server) -> None:
    from devgraph.serve.bench.loadgen import make_trace, run_load

    trace = make_trace(6, (2, 20), (2, 5), vocab=512, max_seq_len=256, seed=3)
    run = asyncio.run(run_load(server.url, trace, concurrency=3, progress=False))
    summary = run["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_tokens"] == sum(t.max_tokens for t in trace)
    assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["p99"] >= summary["itl_ms"]["p50"]
    assert [len(r["token_ids"]) for r in run["results"]] == [t.max_tokens for t in trace]


def test_load_generator_counts_failures_by_kind_and_shows_the_first(server: Server) -> None:
    from devgraph.serve.bench.loadgen import TraceRequest, run_load
    from devgraph.serve.bench.report import summary_table

    trace = [TraceRequest(0, [1, 2], 2), TraceRequest(1, [1, 9999], 2), TraceRequest(2, [3], 2)]
    summary = asyncio.run(run_load(server.url, trace, concurrency=2, progress=False))["summary"]
    assert summary["failed"] == 1 and summary["errors"] == {"HTTP 400": 1}
    assert "token ids must be ints in [0, 512)" in summary["first_errors"][0]
    table = summary_table(summary)
    assert "failed 1 (HTTP 400: 1)" in table and "9999" in table


def test_bench_serve_cuts_lengths_to_the_context_and_survives_a_closed_stdout(
    server: Server, tmp_path: Path
) -> None:
    out = tmp_path / "run.json"
    command = [
        *(sys.executable, "-m", "devgraph.serve", "bench", "--url", server.url, "--num-requests", "2"),
        *("--concurrency", "1", "--prompt-len", "236:250", "--output-len", "20", "--no-progress"),
        *("--json", str(out)),
    ]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head`: the reader is gone before the summary is printed
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
    assert "context of 256: longer requests are cut to fit" in stderr
    record = json.loads(out.read_text())
    assert record["sent"]["prompt_len"] == {"min": 236, "max": 236, "mean": 236.0}  # 256 - 20
    assert record["sent"]["output_len"] == {"min": 20, "max": 20, "mean": 20.0}
    assert record["sent"]["cut"] and record["summary"]["failed"] == 0


# -- in-process pieces ----------------------------------------------------------------------------------
def test_bench_serve_checks_lengths_and_the_json_path_before_the_run(tmp_path: Path) -> None:
    import argparse

    from devgraph.errors import ConfigError
    from devgraph.serve.bench.loadgen import check_lengths, make_trace, run_from_args, trace_lengths
    from devgraph.serve.cli import add_bench_serve_parser

    with pytest.raises(ConfigError, match="cannot fit the server's context of 256 tokens"):
        check_lengths((200, 300), (60, 80), 256)
    assert "cut to fit" in (check_lengths((1, 250), (1, 20), 256) or "")
    assert check_lengths((1, 200), (1, 56), 256) is None
    lengths = trace_lengths(make_trace(4, (250, 250), (30, 30), vocab=512, max_seq_len=256, seed=0))
    assert lengths["prompt_len"] == {"min": 226, "max": 226, "mean": 226.0}
    parser = add_bench_serve_parser(argparse.ArgumentParser().add_subparsers())
    args = parser.parse_args(["--url", "http://127.0.0.1:9", "--json", str(tmp_path / "no" / "run.json")])
    with pytest.raises(ConfigError, match="--json .* cannot be written"):
        run_from_args(args)  # refused before it tries the (absent) server


def test_a_kv_cache_too_large_for_memory_or_too_small_for_the_warm_up_is_refused_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from devgraph.errors import ConfigError
    from devgraph.serve import startup as server_module
    from devgraph.serve.cli import add_serve_parser

    parser = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    args = parser.parse_args(["--device", "cpu", "--num-blocks", str(1 << 24)])
    monkeypatch.setattr(server_module, "_free_bytes", lambda device: 1 << 30)
    with pytest.raises(
        ConfigError, match=r"needs 128.0 GiB .* 1.0 GiB free: lower --max-seq-len, --num-blocks"
    ):
        server_module.build_engine(args)
    # A cache too small for the start-up warm-up is refused before the model is built or captured.
    args = parser.parse_args(["--device", "cpu", "--num-blocks", "4"])
    with pytest.raises(
        ConfigError, match="too small for the start-up warm-up.*--num-blocks\\) to at least 8"
    ):
        server_module.build_engine(args)


def test_start_up_errors_name_the_flags_the_user_set_and_values_that_work() -> None:
    import argparse

    from devgraph.errors import ConfigError
    from devgraph.serve import startup as server_module
    from devgraph.serve.cli import add_serve_parser

    parser = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    args = parser.parse_args(["--device", "cpu", "--token-budget", "4"])
    with pytest.raises(ConfigError) as info:
        server_module.build_engine(args)
    assert str(info.value) == (
        "--token-budget 4 is below --max-running-requests 8, the default on cpu: every running request "
        "must fit one step; give --token-budget 8 or more, or --max-running-requests 4 or less"
    )
    # The smallest context the flag accepts starts: the warm-up fits it (it asked for 3 tokens before).
    args = parser.parse_args(["--device", "cpu", "--max-seq-len", "2", "--device-graph-mode", "disabled"])
    engine = server_module.build_engine(args)
    try:
        engine.warm_up()
        assert engine.model_config.max_seq_len == 2
    finally:
        engine.close()


def test_byte_tokenizer_round_trip_and_streaming_split_characters() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("hé€")
    assert ids == [104, 195, 169, 226, 130, 172]
    assert tokenizer.decode(ids) == "hé€"
    assert tokenizer.decode([104, 300, 105]) == "h<|300|>i"
    decoder = StreamDecoder()
    pieces = [decoder.feed([t]) for t in ids]
    assert pieces == ["h", "", "é", "", "", "€"]
    assert decoder.feed([226]) == "" and decoder.flush() == "\ufffd"


def test_protocol_defaults_and_field_checks() -> None:
    def parse(body: Any) -> Any:
        return parse_completion(body, ByteTokenizer(), "tiny", defaults={}, eos_token_ids=())[0]

    request = parse({"prompt": "ab", "stop": 7, "stop_token_ids": [8]})
    assert request.prompt == [97, 98] and not request.stream
    params = request.params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (16, 1.0, 1.0, None)
    assert params.stop_token_ids == (7, 8) and params.top_k == 0 and params.logprobs is None
    with pytest.raises(ApiError) as info:
        parse({"prompt": [1], "seed": 1.5})
    assert info.value.status == 400 and info.value.param == "seed"


def test_percentiles_and_summary() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    rows = [
        {
            "ok": True,
            "ttft": 0.1,
            "itl": [0.01, 0.03],
            "token_times": [0.1, 0.11, 0.14],
            "token_ids": [1, 2, 3],
        },
        {"ok": False, "ttft": None, "itl": [], "token_times": [], "token_ids": []},
    ]
    summary = summarize(rows, wall_seconds=1.5)
    assert summary["completed"] == 1 and summary["failed"] == 1
    assert summary["output_tokens_per_s"] == pytest.approx(2.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(20.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(20.0)


def test_serve_cli_parsers() -> None:
    import argparse

    from devgraph.flag.config import DeviceGraphConfig
    from devgraph.serve.cli import add_bench_serve_parser, add_serve_parser

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command")
    add_bench_serve_parser(bench)
    args = parser.parse_args(
        ["serve", "--device-graph-mode", "decode=full", "--port", "0", "--deterministic"]
    )
    assert isinstance(args.device_graph_mode, DeviceGraphConfig) and args.port == 0 and args.deterministic
    args = parser.parse_args(["bench", "serve", "--request-rate", "2.5", "--prompt-len", "8:16"])
    assert args.request_rate == 2.5 and args.prompt_len == (8, 16) and args.concurrency is None
    from devgraph.serve.api.server import listen_url

    assert (
        listen_url("::1", 8000) == "http://[::1]:8000"
        and listen_url("127.0.0.1", 80) == "http://127.0.0.1:80"
    )
    args = parser.parse_args(["serve", "--drain-timeout", "0"])
    assert args.drain_timeout == 0.0 and args.body_timeout == 30.0
    args = parser.parse_args(["bench", "serve", "--url", "http://127.0.0.1:8000/"])
    assert args.url == "http://127.0.0.1:8000"
    for bad in (
        ["serve", "--port", "70000"],
        ["serve", "--device-graph-mode", "sideways"],
        ["serve", "--drain-timeout", "nan"],
        ["serve", "--drain-timeout", "-1"],
        ["serve", "--drain-timeout", "inf"],
        ["serve", "--body-timeout", "0"],
        ["bench", "serve", "--url", "ftp://127.0.0.1:8000"],
        ["bench", "serve", "--url", "http://127.0.0.1:8000/v1/completions"],
        ["bench", "serve", "--url", "127.0.0.1:8000"],
        ["bench", "serve", "--url", "http://127.0.0.1:99999"],
        ["bench", "serve", "--request-rate", "1e-9"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def _healthy(server: ServerProcess) -> bool:
    """/health answers 200 ``ok`` (with the background capture's progress: the default captures there)."""
    status, body = server.request("GET", "/health")
    return status == 200 and body["status"] == "ok" and body.get("graphs", {"error": None})["error"] is None


def test_the_in_flight_limit_counts_every_prompt_of_a_request() -> None:
    # --max-queued-requests 2: a list of 3 prompts alone can never fit (400, not a 429 to retry); with two
    # prompts streaming, one more prompt is past the limit (429) whether it comes alone or in a list.
    srv = Server("--device-graph-mode", "disabled", "--max-queued-requests", "2", "--token-budget", "32")
    try:
        status, body = srv.post({"prompt": [[5, 6], [7, 8], [9, 10]], "max_tokens": 1})
        assert status == 400 and "3 prompts" in body["error"]["message"], body
        assert "--max-queued-requests" in body["error"]["message"]
        streaming = srv.stream({"prompt": [[5, 6, 7], [8, 9, 10]], "max_tokens": 240, "ignore_eos": True})
        next(streaming)  # both prompts are in flight now
        for prompt in ([3, 4], [[3, 4]]):
            status, body = srv.post({"prompt": prompt, "max_tokens": 1})
            assert status == 429 and body["error"]["type"] == "overloaded", body
        streaming.close()
        srv.wait_idle()
        status, body = srv.post({"prompt": [[5, 6], [7, 8]], "max_tokens": 1})
        assert status == 200 and len(body["choices"]) == 2, body
    finally:
        assert srv.stop() == 0


def test_switch_interval_flag_sets_pythons_and_is_left_alone_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse
    import sys

    from devgraph.serve.api import server as server_module
    from devgraph.serve.cli import add_serve_parser

    parser = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    seen: list[float] = []
    monkeypatch.setattr(server_module, "_serve", lambda *a: seen.append(sys.getswitchinterval()) or 0)
    before = sys.getswitchinterval()
    try:
        assert server_module.serve(parser.parse_args(["--device", "cpu", "--switch-interval-us", "250"])) == 0
        assert seen[-1] == pytest.approx(250e-6)
        sys.setswitchinterval(before)
        assert server_module.serve(parser.parse_args(["--device", "cpu"])) == 0
        assert seen[-1] == before  # no flag: Python's own interval stays
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(SystemExit):
        parser.parse_args(["--switch-interval-us", "0"])


def test_the_output_delivery_flag_reaches_the_engine_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse
    import types

    from devgraph.serve.api import server as server_module
    from devgraph.serve.cli import add_serve_parser
    from devgraph.serve.engine import OutputDelivery

    parser = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    chosen: list[OutputDelivery] = []

    class Stop(Exception):
        pass

    class Loop:
        def __init__(self, engine: object, delivery: object) -> None:
            chosen.append(OutputDelivery.parse(delivery))
            raise Stop

    engine = types.SimpleNamespace(warm_up=lambda: None)
    monkeypatch.delenv("DEVGRAPH_STEP_TIMELINE", raising=False)
    monkeypatch.setattr(server_module, "build_engine", lambda *a, **k: engine)
    monkeypatch.setattr(server_module, "EngineLoop", Loop)
    source = types.SimpleNamespace(name="m")
    for flags, expected in (
        ([], OutputDelivery.AT_ONCE),
        (["--output-delivery", "next-issue"], OutputDelivery.NEXT_ISSUE),
    ):
        args = parser.parse_args(["--device", "cpu", *flags])
        with pytest.raises(Stop):
            server_module._serve_model(args, 0.0, server_module.Startup(), None, source)
        assert chosen[-1] is expected
    with pytest.raises(SystemExit):
        parser.parse_args(["--output-delivery", "later"])
