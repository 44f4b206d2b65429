"""``devgraph serve --gpu-memory-utilization``: the KV cache is sized from the memory left once what is in use
and the graphs' memory, estimated before capture, are held back (CPU: the simulator's pool bytes; the free
memory query replaced by fixed numbers so the blocks are known)."""

from __future__ import annotations

import argparse

import pytest

from devgraph.errors import ConfigError
from devgraph.serve import startup as server_module
from devgraph.serve.cli import add_serve_parser
from devgraph.serve.engine import SamplingParams
from devgraph.serve.engine.sizing import kv_blocks_for_memory

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

MiB = 1 << 20
FLAGS = ["--preset", "tiny", "--device", "cpu", "--max-running-requests", "4", "--token-budget", "16"]


def parse(*flags: str) -> argparse.Namespace:
    parser = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    return parser.parse_args([*FLAGS, *flags])


def test_blocks_are_what_is_left_of_the_share() -> None:
    sizing = kv_blocks_for_memory(
        utilization=0.5,
        free_bytes=60 * MiB,
        total_bytes=100 * MiB,
        stand_in_bytes=4 * MiB,
        graph_bytes=6 * MiB,
        block_bytes=MiB,
        min_blocks=2,
    )
    # 50 MiB of the share, 36 MiB in use without the stand-in cache, 6 MiB of graphs: 8 blocks.
    assert sizing.num_blocks == 8 and sizing.kv_cache_bytes == 8 * MiB
    with pytest.raises(ConfigError, match="--gpu-memory-utilization 0.4 leaves 0.00 GiB"):
        kv_blocks_for_memory(
            utilization=0.4,
            free_bytes=60 * MiB,
            total_bytes=100 * MiB,
            stand_in_bytes=4 * MiB,
            graph_bytes=6 * MiB,
            block_bytes=MiB,
            min_blocks=2,
        )


def test_the_flag_parses_and_refuses_num_blocks_with_it() -> None:
    assert parse("--gpu-memory-utilization", "0.9").gpu_memory_utilization == 0.9
    with pytest.raises(SystemExit):
        parse("--gpu-memory-utilization", "1.5")
    with pytest.raises(ConfigError, match="give one"):
        server_module.build_engine(parse("--gpu-memory-utilization", "0.9", "--num-blocks", "64"))


def test_serve_sizes_the_kv_cache_after_the_graph_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    total = 64 * MiB
    monkeypatch.setattr(server_module, "memory_info", lambda device: (total, total))
    startup = server_module.Startup()
    flags = ("--gpu-memory-utilization", "0.25", "--no-capture-in-background")  # every graph measured below
    engine = server_module.build_engine(parse(*flags), startup=startup)
    try:
        sizing = startup.kv_sizing
        assert sizing is not None and sizing["graph_bytes_estimated"] > 0 and sizing["memory"] == "host"
        blocks = sizing["num_blocks"]
        config = engine.model_config
        block_bytes = server_module.kv_cache_bytes(config) // config.total_blocks
        stand_in = (1 + config.max_blocks_per_request) * block_bytes
        # Nothing in use but the stand-in cache (free == total): the share plus it, less the graphs...
        affordable = (total // 4 + stand_in - sizing["graph_bytes_estimated"]) // block_bytes
        assert sizing["num_blocks_affordable"] == affordable
        # ... of which the 4 running requests can fill at most one full context each (and block 0).
        assert blocks == min(affordable, 1 + 4 * config.max_blocks_per_request)
        assert config.total_blocks == blocks == engine.model.k_cache[0].shape[0]
        assert engine.allocator.capacity == blocks - 1
        measured = sum(r.graph_memory().total_bytes for r in (engine.decode_runner, engine.prefill_runner))
        assert abs(measured - sizing["graph_bytes_estimated"]) <= 0.10 * measured
        out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0]
        assert len(out) == 4 and engine.decode_runner.stats()["replays"] > 0
        assert "kv_sizing" in startup.report()
    finally:
        engine.close()


def test_on_the_cpu_the_cache_is_capped_at_what_the_running_requests_fill_and_the_log_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A machine with 64 GiB of RAM: 0.9 of it would be millions of blocks for a 0.4 MiB model.
    monkeypatch.setattr(server_module, "memory_info", lambda device: (64 << 30, 64 << 30))
    startup = server_module.Startup()
    with caplog.at_level("INFO", logger=server_module.__name__):
        engine = server_module.build_engine(parse("--gpu-memory-utilization", "0.9"), startup=startup)
    try:
        config = engine.model_config
        sizing = startup.kv_sizing
        assert sizing is not None and sizing["num_blocks_affordable"] > 1_000_000
        assert config.total_blocks == sizing["num_blocks"] == 1 + 4 * config.max_blocks_per_request
        assert server_module.kv_cache_bytes(config) < 2 * MiB
        text = caplog.text
        assert "of the host's RAM" in text and "only those are allocated" in text, text
    finally:
        engine.close()


@pytest.mark.cuda
def test_on_a_gpu_the_share_is_of_device_memory_and_capped_the_same_way() -> None:
    parser = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    flags = ["--preset", "tiny", "--device", "cuda", "--max-running-requests", "4", "--token-budget", "16"]
    startup = server_module.Startup()
    engine = server_module.build_engine(
        parser.parse_args([*flags, "--gpu-memory-utilization", "0.5"]), startup=startup
    )
    try:
        sizing = startup.kv_sizing
        config = engine.model_config
        assert sizing is not None and sizing["memory"] == "device"
        assert sizing["num_blocks"] == min(
            sizing["num_blocks_affordable"], 1 + 4 * config.max_blocks_per_request
        )
        assert engine.model.k_cache[0].shape[0] == sizing["num_blocks"]
        if engine.background is not None:  # the server's default: graphs captured between steps; all now
            engine.background.finish()
        out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0]
        assert len(out) == 4 and engine.decode_runner.stats()["replays"] > 0
    finally:
        engine.close()
