"""Starting ``devgraph serve``: build the model and engine, capture, listen, and shut down on SIGTERM.

Shutdown (SIGTERM or SIGINT): ``/health`` turns 503 and new completions get 503; requests in flight
may finish for ``--drain-timeout`` seconds, then the rest are aborted (streams end with
``finish_reason: "abort"``); handlers get :data:`SHUTDOWN_GRACE` more seconds to write their last
bytes (a client that stopped reading, or one still sending its body, is then cut off); the listener
closes, graphs are released, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import time
from typing import Any

import torch

from devgraph.errors import ConfigError
from devgraph.extras import install_hint
from devgraph.flag.config import DeviceGraphConfig
from devgraph.flag.factory import resolve_platform, usable_platform
from devgraph.reference.config import ReferenceConfig
from devgraph.reference.kernels.backends import auto_fallback_note
from devgraph.reference.model import ReferenceModel
from devgraph.serve.api.metrics import ServeMetrics, prometheus_available
from devgraph.serve.engine.config import EngineConfig
from devgraph.serve.engine.engine import Engine, check_warm_up_fits
from devgraph.serve.engine.loop import EngineLoop

__all__ = ["build_engine", "check_kv_memory", "device_defaults", "listen_url", "serve"]

logger = logging.getLogger(__name__)

#: Seconds handlers may still run once the drain is over (aiohttp's shutdown timeout).
SHUTDOWN_GRACE = 1.0
#: The KV cache may take at most this share of the device's free memory (weights and steps need the rest).
KV_MEMORY_SHARE = 0.9
GiB = float(1 << 30)
MiB = float(1 << 20)


def device_defaults(device: torch.device) -> dict[str, Any]:
    """Defaults that depend on the device: a small model and batch on the CPU, Qwen3-0.6B's shape on a GPU."""
    if device.type == "cpu":
        return {"preset": "tiny", "max_running_requests": 8, "token_budget": 64}
    return {"preset": "qwen3-0.6b", "max_running_requests": 32, "token_budget": 2048}


def _device(args: argparse.Namespace) -> torch.device:
    # The demo's check: `--device cuda` on a CPU-only torch is one line saying why, not an AssertionError.
    platform = usable_platform(args.device)
    return torch.device(args.device) if args.device else platform.default_device()


def _batch_limits(
    args: argparse.Namespace, defaults: dict[str, Any], device: torch.device
) -> tuple[int, int]:
    """``--max-running-requests`` and ``--token-budget`` (defaults filled in); :class:`ConfigError` naming
    the flags, and the values that work, when a step could not hold every running request."""
    running = args.max_running_requests or defaults["max_running_requests"]
    budget = args.token_budget or max(defaults["token_budget"], running)
    if budget < running:
        given = "" if args.max_running_requests else f", the default on {device.type}"
        raise ConfigError(
            f"--token-budget {budget} is below --max-running-requests {running}{given}: every running "
            f"request must fit one step; give --token-budget {running} or more, or --max-running-requests "
            f"{budget} or less"
        )
    return running, budget


def build_engine(args: argparse.Namespace) -> Engine:
    """The model and engine the flags describe, graphs captured. Logs each start-up stage (model and KV
    cache, each graph captured, the capture table) at INFO, so a log shows where start-up is."""
    device = _device(args)
    defaults = device_defaults(device)
    running, budget = _batch_limits(args, defaults, device)
    overrides: dict[str, Any] = {"max_requests": running}
    for name in ("dtype", "num_blocks", "max_seq_len", "attention"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    model_config = ReferenceConfig.preset(args.preset or defaults["preset"], **overrides)
    # Before allocating (or capturing) anything: the cache must fit the memory and the warm-up.
    check_kv_memory(model_config, _free_bytes(device), device)
    check_warm_up_fits(model_config)
    _warn_small_cache(model_config)
    engine_config = EngineConfig(
        max_running_requests=running,
        token_budget=budget,
        mixed_steps=not args.no_mixed_steps,
        deterministic=args.deterministic,
    )
    logger.info(
        "building the model: preset %r (%s, %d layers), random weights (seed %d), on %s; KV cache "
        "%.1f MiB (%d blocks of %d positions)",
        args.preset or defaults["preset"],
        str(model_config.dtype).removeprefix("torch."),
        model_config.num_layers,
        args.seed,
        device,
        kv_cache_bytes(model_config) / MiB,
        model_config.total_blocks,
        model_config.block_size,
    )
    note = auto_fallback_note(model_config.kernels, device)
    if note:
        logger.warning("%s", note)
    start = time.perf_counter()
    model = ReferenceModel(model_config, device=device, seed=args.seed)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info("model ready in %.1f s: weights %.1f MiB", time.perf_counter() - start, weights / MiB)
    mode = args.device_graph_mode
    graphs = mode if isinstance(mode, DeviceGraphConfig) else DeviceGraphConfig.parse(mode or "auto")
    logger.info("capturing graphs (--device-graph-mode %s)", graphs.source)
    return Engine(model, engine_config, device_graph_mode=graphs, progress=args.progress)


def kv_cache_bytes(config: ReferenceConfig) -> int:
    """Bytes of the paged K and V caches of every layer."""
    per_block = config.block_size * config.num_kv_heads * config.head_dim * config.dtype.itemsize
    return 2 * config.num_layers * config.total_blocks * per_block


def check_kv_memory(config: ReferenceConfig, free_bytes: int | None, device: Any = "the device") -> None:
    """:class:`ConfigError` (one line: the size and the flags that lower it) when the KV cache would take
    more than :data:`KV_MEMORY_SHARE` of ``free_bytes``; nothing when the free memory is unknown."""
    if free_bytes is None:
        return
    needed = kv_cache_bytes(config)
    if needed <= KV_MEMORY_SHARE * free_bytes:
        return
    raise ConfigError(
        f"the KV cache needs {needed / GiB:.1f} GiB ({config.total_blocks} blocks of {config.block_size} "
        f"positions, {config.num_layers} layers, K and V) but {device} has {free_bytes / GiB:.1f} GiB free: "
        "lower --max-seq-len, --num-blocks (default: enough for --max-running-requests requests of "
        "--max-seq-len tokens) or --max-running-requests"
    )


def _free_bytes(device: torch.device) -> int | None:
    try:
        if device.type == "cuda" and device.index is not None:  # that GPU, not the current one
            return int(torch.cuda.mem_get_info(device)[0])
        return int(resolve_platform(device).mem_get_info()[0])
    except Exception:  # unknown: the allocation itself will say
        return None


def _warn_small_cache(config: ReferenceConfig) -> None:
    usable = config.total_blocks - 1  # block 0 is scratch
    full = config.max_blocks_per_request
    if usable < full:
        logger.warning(
            "the KV cache holds %d tokens (%d usable blocks of %d), less than one request of the full "
            "context (%d tokens): longer requests get 400; --num-blocks %d or more holds one",
            usable * config.block_size,
            usable,
            config.block_size,
            config.max_seq_len,
            full + 1,
        )


def listen_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (``http://[::1]:8000``)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit code."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    engine = build_engine(args)
    start = time.perf_counter()
    engine.warm_up()
    logger.info("warm-up requests served in %.1f s", time.perf_counter() - start)
    preset = args.preset or device_defaults(engine.model.device)["preset"]
    model_name = args.served_model_name or preset
    loop = EngineLoop(engine)
    loop.start()
    metrics = (
        ServeMetrics(loop.stats, [engine.decode_runner, engine.prefill_runner])
        if prometheus_available()
        else None
    )
    if metrics is None:
        logger.warning(
            "prometheus_client is not installed: GET /metrics answers 501; %s",
            install_hint("serve"),
        )
    try:
        return asyncio.run(_run(args, loop, model_name, metrics))
    finally:
        loop.shutdown(0.0)
        engine.close()


async def _run(
    args: argparse.Namespace, engine: EngineLoop, model_name: str, metrics: ServeMetrics | None
) -> int:
    from aiohttp import web

    from devgraph.serve.api.app import ServerState, build_app

    state = ServerState(engine, model_name, metrics, args.max_queued_requests, body_timeout=args.body_timeout)
    # The drain is the engine's (in-flight requests finish or abort); after it, handlers get a short grace
    # instead of aiohttp's 60 s, so a client that stalls mid-body or stops reading cannot hold the exit.
    options: dict[str, Any] = {"access_log": None, "shutdown_timeout": SHUTDOWN_GRACE}
    if _aiohttp_version() >= (3, 9):
        options["handler_cancellation"] = True  # a client that goes away cancels its handler
    runner = web.AppRunner(build_app(state), **options)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        sock.close()
        await runner.cleanup()
        raise ConfigError(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror}; choose another --port "
            "(0 picks a free one) or --host"
        ) from None
    sock.listen(1024)
    site = web.SockSite(runner, sock)
    await site.start()
    port = sock.getsockname()[1]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"devgraph serve: model {model_name!r} listening on {listen_url(args.host, port)}", flush=True)
    await stop.wait()
    print("devgraph serve: shutting down", file=sys.stderr, flush=True)
    state.draining = True
    await loop.run_in_executor(None, engine.shutdown, args.drain_timeout)
    await runner.cleanup()
    return 0


def _aiohttp_version() -> tuple[int, ...]:
    import aiohttp

    parts = []
    for piece in aiohttp.__version__.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)
