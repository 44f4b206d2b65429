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

from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.cli import add_serve_parser
from devgraph.serve.engine import Engine, EngineConfig, SamplingParams

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
    assert not parser.parse_args(["serve"]).capture_in_background


def test_serving_while_the_graphs_are_captured() -> None:
    server = ServerProcess(*FLAGS)
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
