"""``devgraph bench serve`` against servers that misbehave: one that accepts and never answers, one whose
completions hang, and ones whose model card (``GET /v1/models``) is junk. Every request honours
``--timeout``; a bad card is one error line and exit code 2. The servers are tiny asyncio HTTP servers on
free local ports, so these tests need no model."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from devgraph.cli.main import main
from devgraph.serve.api.protocol import ModelCard, model_list, parse_model_card

pytest.importorskip("aiohttp", reason="devgraph bench serve needs aiohttp (pip install 'devgraph[serve]')")

pytestmark = pytest.mark.timeout(60)  # a hang fails here, not after aiohttp's 300 s default

GOOD_CARD = json.dumps(model_list(ModelCard("tiny", 512, 256))).encode()
HANG = None  # a route that reads the request and never answers


@contextmanager
def tiny_http(routes: dict[str, Any]) -> Iterator[str]:
    """An HTTP/1.1 server on a free local port: ``routes`` maps a path to (status, JSON body), to a
    function returning one (called for each request), or to ``HANG``; other paths get 404. Yields its base
    URL."""
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            answer = routes.get(path, (404, b'{"error": {"message": "no"}}'))
            if callable(answer):
                answer = answer()
            if answer is HANG:
                await asyncio.Event().wait()  # until the server closes
                return
            status, body = answer
            writer.write(
                f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        state["port"] = server.sockets[0].getsockname()[1]
        state["stop"] = stop = asyncio.Event()
        state["loop"] = asyncio.get_running_loop()
        ready.set()
        async with server:
            await stop.wait()
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{state['port']}"
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(10)


def _bench(capsys: pytest.CaptureFixture[str], url: str, *flags: str) -> tuple[int, list[str]]:
    code = main(["bench", "serve", "--url", url, "--no-progress", *flags])
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_server_that_accepts_and_never_answers_fails_within_the_timeout(capsys) -> None:
    with socket.socket() as listener:  # the kernel completes the handshake; nobody ever reads or replies
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        code, err = _bench(capsys, url, "--timeout", "0.5")
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        f"devgraph bench serve: error: GET {url}/v1/models got no answer within --timeout 0.5 s (the server "
        "accepted the connection but did not reply); is it still starting or stuck? Raise --timeout, or "
        "check the server"
    )


def test_every_completion_request_honours_the_timeout(capsys, tmp_path) -> None:
    out = tmp_path / "run.json"
    routes = {"/v1/models": (200, GOOD_CARD), "/v1/completions": HANG}
    with tiny_http(routes) as url:
        code, _ = _bench(
            capsys, url, "--timeout", "0.5", "--num-requests", "3", "--concurrency", "3", "--json", str(out)
        )
    assert code == 1  # the run finished; its requests failed
    record = json.loads(out.read_text())
    assert record["summary"]["failed"] == 3 and record["summary"]["errors"] == {"timeout": 3}


@pytest.mark.parametrize(
    ("answer", "fragment"),
    [
        ((200, b"<html>not json</html>"), "did not answer with devgraph serve's model card: "),
        ((200, b"[1, 2]"), "expected {'data': [{model card}, ...]}, got [1, 2]"),
        ((200, b'{"data": []}'), "expected {'data': [{model card}, ...]}"),
        ((200, b'{"data": [{"id": "m", "vocab_size": 512}]}'), "'max_seq_len' must be an integer >= 2"),
        ((200, b'{"data": [{"id": "m", "vocab_size": "x", "max_seq_len": 9}]}'), "'vocab_size' must be"),
        ((200, b'{"data": [{"vocab_size": 5, "max_seq_len": 9}]}'), "'id' must be a non-empty string"),
        ((500, b'{"error": {"message": "boom"}}'), "answered HTTP 500 ('boom'); is --url the base URL"),
    ],
)
def test_a_malformed_model_card_is_one_line_and_exit_code_2(capsys, answer, fragment) -> None:
    with tiny_http({"/v1/models": answer}) as url:
        code, err = _bench(capsys, url, "--timeout", "5")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"devgraph bench serve: error: GET {url}/v1/models ") and fragment in err[0]


def test_the_model_card_round_trips_through_the_server_shape() -> None:
    card = ModelCard("tiny", 512, 256)
    assert parse_model_card(model_list(card)) == card
    with pytest.raises(ValueError, match="'max_seq_len' must be an integer >= 2, got True"):
        parse_model_card({"data": [{"id": "m", "vocab_size": 4, "max_seq_len": True}]})


def _health(*answers: dict[str, Any]) -> Any:
    """A /health route that gives ``answers`` in turn (the last one for good), with the request count."""
    seen: list[int] = []

    def answer() -> tuple[int, bytes]:
        seen.append(1)
        return 200, json.dumps(answers[min(len(seen), len(answers)) - 1]).encode()

    answer.seen = seen  # type: ignore[attr-defined]
    return answer


def _capture(captured: int, total: int = 3, error: str | None = None) -> dict[str, Any]:
    progress = {"captured": captured, "total": total, "ready": captured == total, "error": error}
    return {"status": "ok", "graphs": progress}


def _completion() -> tuple[int, bytes]:
    """A streamed completion of two tokens, as one body (the route's Content-Type is not read)."""
    events = [
        {"choices": [{"index": 0, "text": t, "token_ids": [i], "finish_reason": f}]}
        for i, t, f in ((1, "a", None), (2, "b", "length"))
    ]
    return 200, b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_the_load_waits_until_the_servers_graphs_are_captured(capsys, tmp_path) -> None:
    # A server captures its graphs between steps by default: a load sent before would time eager steps.
    out = tmp_path / "run.json"
    health = _health(_capture(0), _capture(0), _capture(1), _capture(2), _capture(3))
    routes = {"/v1/models": (200, GOOD_CARD), "/health": health, "/v1/completions": _completion}
    with tiny_http(routes) as url:
        code, err = _bench(capsys, url, "--num-requests", "2", "--output-len", "2:2", "--json", str(out))
    assert [line for line in err if "waiting" in line] == [
        f"devgraph bench serve: waiting for the server's graphs: {n}/3 captured" for n in (0, 1, 2)
    ]
    record = json.loads(out.read_text())
    assert len(health.seen) == 5 and record["waited_for_graphs_s"] >= 0.3  # four 0.1 s polls
    assert code == 0 and record["summary"]["completed"] == 2, record["summary"]


@pytest.mark.parametrize(
    ("health", "flags", "fragment"),
    [
        (_capture(1, error="CaptureError: out of memory"), (), "graph capture failed ('CaptureError: out of"),
        (_capture(1), ("--timeout", "0.5"), "not all captured within --timeout 0.5 s (1/3)"),
    ],
)
def test_a_capture_that_fails_or_never_ends_is_one_line_and_exit_code_2(
    capsys, health, flags, fragment
) -> None:
    routes = {"/v1/models": (200, GOOD_CARD), "/health": (200, json.dumps(health).encode())}
    with tiny_http(routes) as url:
        code, err = _bench(capsys, url, *flags)
    errors = [line for line in err if "waiting" not in line]
    assert code == 2 and len(errors) == 1 and fragment in errors[0], err
    assert "--no-wait-for-graphs" in errors[0]


def test_no_wait_for_graphs_sends_the_load_at_once(capsys, tmp_path) -> None:
    out = tmp_path / "run.json"
    health = _health(_capture(0))
    routes = {"/v1/models": (200, GOOD_CARD), "/health": health, "/v1/completions": _completion}
    with tiny_http(routes) as url:
        code, err = _bench(
            capsys,
            url,
            "--num-requests",
            "2",
            "--output-len",
            "2:2",
            "--no-wait-for-graphs",
            "--json",
            str(out),
        )
    record = json.loads(out.read_text())
    assert code == 0 and health.seen == [] and record["waited_for_graphs_s"] is None
    assert not [line for line in err if "waiting" in line]
