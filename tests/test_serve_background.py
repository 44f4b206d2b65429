"""``devgraph serve --capture-in-background`` on the CPU: the server answers while its graphs are captured
between steps, /health and /metrics show the progress, the log says when every key is captured, and
tokens equal the eager engine's (deterministic mode)."""

from __future__ import annotations

import argparse
import importlib.util
import time

import pytest
import torch
from servers import ServerProcess

from devgraph import CaptureError, ConfigError, DeviceGraphConfig
from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.cli import add_serve_parser
from devgraph.serve.engine import Engine, EngineConfig, SamplingParams
from devgraph.serve.startup import build_engine, capture_plan

pytest.importorskip("aiohttp", reason="devgraph serve needs aiohttp (pip install aiohttp)")

pytestmark = pytest.mark.timeout(180)

FLAGS = [
    "--preset", "tiny", "--device", "cpu", "--cpu-threads", "1", "--max-running-requests", "8",
    "--token-budget", "32", "--deterministic", "--device-graph-mode", "auto", "--capture-in-background",
]  # fmt: skip


def test_the_flag_parses() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve", "--capture-in-background"]).capture_in_background
    assert not parser.parse_args(["serve", "--no-capture-in-background"]).capture_in_background
    assert parser.parse_args(["serve"]).capture_in_background is None  # where safe (capture_plan)


def test_serving_while_the_graphs_are_captured() -> None:
    server = ServerProcess(*FLAGS, graphs_ready=False)
    try:
        status, health = server.request("GET", "/health")
        assert status == 200 and health["status"] == "ok"
        graphs = health["graphs"]
        assert graphs["total"] > 0 and 0 <= graphs["captured"] <= graphs["total"]
        prompt = [5, 6, 7, 8, 9]
        status, body = server.post({"prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert status == 200, body
        served = body["choices"][0]["token_ids"]
        deadline = time.monotonic() + 60
        while not health["graphs"]["ready"] and time.monotonic() < deadline:
            time.sleep(0.2)
            health = server.request("GET", "/health")[1]
        assert health["graphs"]["ready"], health
        assert health["graphs"]["captured"] == health["graphs"]["total"]
        status, after = server.post({"prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert status == 200 and after["choices"][0]["token_ids"] == served
        stats = server.stats()
        assert stats["graph_capture"]["ready"] and stats["runners"]["decode"]["replays"] > 0
        if importlib.util.find_spec("prometheus_client") is not None:
            status, text = server.request("GET", "/metrics")
            assert status == 200 and f"devgraph_graphs_captured {graphs['total']}.0" in text
    finally:
        assert server.stop() == 0
    log = "".join(server.stderr)
    assert "graphs captured in the background" in log, log[-2000:]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=8), seed=0)
        engine = Engine(
            model, EngineConfig(8, 32, deterministic=True), device_graph_mode="disabled", progress=False
        )
        assert engine.generate([prompt], SamplingParams(max_tokens=6))[0] == served
    finally:
        torch.set_num_threads(threads)


def _graphs(text: str) -> DeviceGraphConfig:
    return DeviceGraphConfig.parse(text)


@pytest.mark.parametrize(
    ("asked", "flag", "ranks", "background", "said"),
    [
        (None, "auto", 1, True, "the default"),
        (None, "full", 1, True, "the default"),
        (None, "decode=full,prefill=eager", 1, True, "the default"),
        (None, "auto", 2, False, "tensor parallelism"),
        (None, "disabled", 1, False, "no phase has graphs"),
        (None, "eager", 1, False, "no phase has graphs"),
        (None, '{"decode": {"backend": "full", "compiler": "inductor"}}', 1, False, "compiles"),
        (None, "decode=tc_piecewise", 1, False, "compiles"),
        (None, '{"decode": {"backend": "full", "fallback": "tc_piecewise"}}', 1, False, "compiles"),
        (True, '{"decode": {"backend": "full", "compiler": "inductor"}}', 1, True, "--capture-in-background"),
        (False, "auto", 1, False, "--no-capture-in-background"),
        # A fallback graph set cannot be captured key by key: the default used to pick the background, and
        # the server then refused to start ("the decode runner has a fallback graph set").
        (None, '{"decode": {"backend": "full", "fallback": "breakable"}}', 1, False, "fallback graph set"),
        # Lazy phases capture each key on first sight: nothing to capture in the background.
        (None, '{"decode": {"lazy": true}, "prefill": {"lazy": true}}', 1, False, "lazy"),
        (None, '{"decode": {"lazy": true}}', 1, True, "the default"),
    ],
)
def test_where_the_graphs_are_captured_by_default(
    asked: bool | None, flag: str, ranks: int, background: bool, said: str
) -> None:
    chosen, why = capture_plan(asked, _graphs(flag), ranks)
    assert chosen is background and said in why


def test_auto_is_judged_by_the_backend_it_resolves_to_on_the_platform() -> None:
    # ROCm's auto prefill is tc_piecewise, which compiles: captured before serving, as a named
    # tc_piecewise is; on the CPU auto is full and breakable, which do not.
    assert capture_plan(None, _graphs("auto"), 1, "rocm") == capture_plan(
        None, _graphs("prefill=tc_piecewise")
    )
    assert not capture_plan(None, _graphs("auto"), 1, "rocm")[0]
    assert capture_plan(None, _graphs("auto"), 1, "cpu")[0]


def test_capture_in_background_with_a_fallback_is_refused_in_the_flags_words() -> None:
    with pytest.raises(ConfigError, match="--capture-in-background .* fallback graph set .*decode"):
        capture_plan(True, _graphs('{"decode": {"backend": "full", "fallback": "breakable"}}'))


def _serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *flags])


def test_a_fallback_graph_set_is_served_on_the_default(one_torch_thread: None) -> None:
    mode = '{"decode": {"backend": "full", "fallback": "breakable"}}'
    args = _serve_args("--preset", "tiny", "--device", "cpu", "--device-graph-mode", mode)
    engine = build_engine(args)  # was: ConfigError "the decode runner has a fallback graph set"
    try:
        assert engine.background is None and engine.decode_runner.keys
        assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0]
    finally:
        engine.close()


def test_the_warm_up_is_not_counted_as_steps_served_while_capturing(one_torch_thread: None) -> None:
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4), seed=0)
    engine = Engine(model, EngineConfig(4, 16), device_graph_mode="auto", progress=False, capture=False)
    engine.capture_in_background()
    engine.warm_up()  # the server's, before it listens: every step eager, read at once ("capturing")
    try:
        assert engine.stats()["serial_steps"] == {}
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        assert engine.stats()["serial_steps"]["capturing"] > 0  # a request's steps still count
    finally:
        engine.close()


def test_a_failed_background_capture_is_a_metric_too(
    one_torch_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("prometheus_client")
    from devgraph.runner.life import GraphLife
    from devgraph.serve.api.metrics import ServeMetrics
    from devgraph.serve.engine import EngineLoop

    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4), seed=0)
    engine = Engine(model, EngineConfig(4, 16), device_graph_mode="auto", progress=False, capture=False)
    background = engine.capture_in_background()
    loop = EngineLoop(engine)  # not started: its stats() are the server's /metrics source
    metrics = ServeMetrics(loop.stats, [engine.decode_runner, engine.prefill_runner])
    try:
        assert "devgraph_graphs_capture_failed 0.0" in metrics.render()[0].decode()

        def fail(life: GraphLife) -> bool:  # a device that runs out of memory mid-way, say
            life.abandon()
            raise CaptureError(f"the {life.plan.phase} capture failed")

        monkeypatch.setattr(GraphLife, "capture_next", fail)
        with pytest.raises(CaptureError):
            background.step()
        text = metrics.render()[0].decode()
        assert "devgraph_graphs_capture_failed 1.0" in text and "devgraph_graphs_captured 0.0" in text
    finally:
        engine.close()


def test_stats_and_sleep_get_in_between_two_keys_of_the_background_capture(
    one_torch_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine thread took its state lock again at once after each key (a Lock is not fair), so
    # /v1/engine/stats, /metrics and POST /sleep waited for the whole capture (seconds on a GPU).
    from devgraph.runner.life import GraphLife
    from devgraph.serve.engine import EngineLoop

    capture_next = GraphLife.capture_next

    def slow_key(life: GraphLife) -> bool:  # a key that takes as long as a real model's
        time.sleep(0.1)
        return capture_next(life)

    monkeypatch.setattr(GraphLife, "capture_next", slow_key)
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=8), seed=0)
    engine = Engine(model, EngineConfig(8, 64), device_graph_mode="auto", progress=False, capture=False)
    background = engine.capture_in_background()
    assert background.total >= 6
    loop = EngineLoop(engine)
    loop.start()
    try:
        while background.captured == 0:
            time.sleep(0.01)
        seen = [loop.stats()["graph_capture"]["captured"] for _ in range(3)]
        # Each call answers after the key under way (at most one more), not after several or all of them.
        assert all(b - a <= 2 for a, b in zip([1, *seen], seen, strict=False)), seen
        assert not background.done, seen
    finally:
        loop.shutdown()
        engine.close()


def test_a_server_on_its_defaults_answers_before_its_graphs() -> None:
    # No capture flag: the tiny preset's plain graphs are captured between steps (capture_plan's default).
    flags = [f for f in FLAGS if f not in ("--capture-in-background", "--deterministic")]
    server = ServerProcess(*flags, graphs_ready=False)
    try:
        graphs = server.request("GET", "/health")[1]["graphs"]
        assert graphs["total"] > 0, graphs
        status, body = server.post({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 4, body
        assert server.wait_graphs(60)["ready"]
    finally:
        assert server.stop() == 0
    assert "captured between steps while the server answers" in "".join(server.stderr)


def test_no_capture_in_background_captures_before_listening() -> None:
    flags = [f for f in FLAGS if f != "--capture-in-background"] + ["--no-capture-in-background"]
    server = ServerProcess(*flags, graphs_ready=False)
    try:
        status, health = server.request("GET", "/health")
        assert status == 200 and "graphs" not in health, health  # every graph captured before listening
        assert server.stats()["runners"]["decode"]["graph_memory"]["by_key"]
    finally:
        assert server.stop() == 0
    log = "".join(server.stderr)
    for line in (
        "devgraph.serve.startup INFO capturing graphs (--device-graph-mode auto): --no-capture-in-background",
        "devgraph.runner.capture.job INFO captured decode graph 1/1 (tokens=8,requests=8, full)",
        "devgraph.runner.capture.job INFO captured prefill graph 1/1",
        "devgraph.serve.startup INFO graphs ready in",
    ):
        assert line in log, log[-3000:]
