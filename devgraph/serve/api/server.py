"""Running ``devgraph serve``: start up (``startup.py``), warm up, listen, and shut down on SIGTERM.

Shutdown (SIGTERM or SIGINT): ``/health`` turns 503 and new completions get 503; requests in flight
may finish for ``--drain-timeout`` seconds, then the rest are aborted (streams end with
``finish_reason: "abort"``); handlers get :data:`SHUTDOWN_GRACE` more seconds to write their last
bytes (a client that stopped reading, or one still sending its body, is then cut off); the listener
closes, graphs are released, and the process exits 0.

With ``--tp N`` (:mod:`devgraph.serve.tp`) the workers are stopped after that; a lost rank ends every
request in flight with an error, takes the same way out and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

from devgraph import ConfigError
from devgraph.extras import install_hint
from devgraph.serve.api.metrics import ServeMetrics, prometheus_available
from devgraph.serve.api.recording import TrafficRecorder
from devgraph.serve.api.stats_log import ThroughputLog
from devgraph.serve.checkpoint.source import ModelSource
from devgraph.serve.engine.config import OutputDelivery
from devgraph.serve.engine.engine_thread import EngineLoop
from devgraph.serve.engine.timeline import StepTimeline
from devgraph.serve.startup import Startup, build_engine, open_source

__all__ = ["listen_url", "serve"]

logger = logging.getLogger(__name__)

#: Seconds handlers may still run once the drain is over (aiohttp's shutdown timeout).
SHUTDOWN_GRACE = 1.0


def listen_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (``http://[::1]:8000``)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit code."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    if getattr(args, "switch_interval_us", None):  # --switch-interval-us: off unless given
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    began = time.perf_counter()
    startup = Startup()
    world = _start_world(args)
    try:
        return _serve(args, began, startup, world)
    finally:
        if world is not None:
            world.stop()


def _start_world(args: argparse.Namespace) -> Any:
    if getattr(args, "tp", 1) <= 1:
        return None
    # Checked before any worker is spawned. Each of these acts on rank 0 alone (its cache, its graphs, its
    # capture between steps), while every rank must do it in lock-step.
    for flag, given in (
        ("--gpu-memory-utilization", getattr(args, "gpu_memory_utilization", None) is not None),
        ("--enable-sleep-mode", getattr(args, "enable_sleep_mode", False)),
        ("--capture-in-background", getattr(args, "capture_in_background", None) is True),
    ):
        if given:
            raise ConfigError(f"{flag} is not available with --tp yet; leave one of them out")
    from devgraph.serve.tp import start_world

    return start_world(args)


def _serve(args: argparse.Namespace, began: float, startup: Startup, world: Any) -> int:
    source = open_source(args, startup)
    source.tokenizer.start()  # the chat-template workers start while the weights load
    try:
        return _serve_model(args, began, startup, world, source)
    finally:
        source.tokenizer.close()


def _serve_model(
    args: argparse.Namespace, began: float, startup: Startup, world: Any, source: ModelSource
) -> int:
    if world is None:
        engine = build_engine(args, source, startup)
    else:
        from devgraph.serve.tp import TPEngine

        engine = build_engine(
            args,
            source,
            startup,
            group=world.group,
            engine_class=functools.partial(TPEngine, channel=world.channel, on_failure=world.step_failed),
        )
    start = time.perf_counter()
    engine.warm_up()
    startup.times["warm_up_s"] = time.perf_counter() - start
    logger.info("warm-up requests served in %.1f s", startup.times["warm_up_s"])
    timeline = StepTimeline.from_environment(engine)  # DEVGRAPH_STEP_TIMELINE: the serving benchmarks
    recorder = _recorder(args, engine)
    model_name = args.served_model_name or source.name
    loop = EngineLoop(engine, getattr(args, "output_delivery", OutputDelivery.AT_ONCE))
    if world is not None:  # a lost rank: answer every request with an error, then stop (exit code 1)
        world.on_lost = functools.partial(_lost, loop)
    loop.start()
    metrics = (
        ServeMetrics(
            loop.stats,
            [engine.decode_runner, engine.prefill_runner],
            model_name=model_name,
            max_seq_len=engine.model_config.max_seq_len,
        )
        if prometheus_available()
        else None
    )
    if metrics is None:
        logger.warning(
            "prometheus_client is not installed: GET /metrics answers 501; %s",
            install_hint("serve"),
        )
    startup.times["ready_s"] = time.perf_counter() - began
    try:
        state = _state(args, loop, source, model_name, metrics, startup)
        code = asyncio.run(_run(args, loop, state, recorder))
    finally:
        loop.shutdown(0.0)
        if timeline is not None and (world is None or world.failure is None):
            timeline.save()
        if recorder is not None:
            recorder.write()  # the last steps, after the drain
        engine.close()
    if world is not None and world.failure is not None:
        print(f"devgraph serve --tp: {world.failure}; exiting (code 1)", file=sys.stderr, flush=True)
        return 1
    return code


def _recorder(args: argparse.Namespace, engine: Any) -> TrafficRecorder | None:
    """``--record-steps``: both runners record from here on (after the warm-up)."""
    path = getattr(args, "record_steps", None)
    if not path:
        return None
    recorder = TrafficRecorder(
        Path(path), [engine.decode_runner, engine.prefill_runner], args.record_interval
    )
    recorder.start()
    return recorder


def _lost(loop: EngineLoop, message: str) -> None:
    loop.fail_all(f"a tensor-parallel rank was lost ({message}); the server is stopping")
    os.kill(os.getpid(), signal.SIGTERM)  # the same way out as a user's SIGTERM


def _state(
    args: argparse.Namespace,
    loop: EngineLoop,
    source: ModelSource,
    model_name: str,
    metrics: ServeMetrics | None,
    startup: Startup,
) -> Any:
    from devgraph.serve.api.app import ServerState

    return ServerState(
        loop,
        model_name,
        metrics,
        args.max_queued_requests,
        tokenizer=source.tokenizer,
        sampling_defaults=source.generation.sampling(),
        eos_token_ids=source.generation.eos_token_ids or source.tokenizer.eos_token_ids,
        root=None if source.directory is None else str(source.directory),
        startup=startup.report(),
        body_timeout=args.body_timeout,
        sleep_mode=getattr(args, "enable_sleep_mode", False),
        structured_outputs=getattr(args, "structured_outputs", "all"),
    )


async def _run(
    args: argparse.Namespace, engine: EngineLoop, state: Any, recorder: TrafficRecorder | None = None
) -> int:
    from aiohttp import web

    from devgraph.serve.api.app import build_app

    # The drain is the engine's (in-flight requests finish or abort); after it, handlers get a short grace
    # instead of aiohttp's 60 s, so a client that stalls mid-body or stops reading cannot hold the exit.
    options: dict[str, Any] = {"access_log": None, "shutdown_timeout": SHUTDOWN_GRACE}
    if _aiohttp_version() >= (3, 9):
        options["handler_cancellation"] = True  # a client that goes away cancels its handler
    if state.structured_outputs != "none":  # the tokenizer table for grammars, built in the background
        state.grammar_compiler().prepare()  # (a failure is the first constrained request's answer)
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
    interval = getattr(args, "log_stats_interval", 0.0)
    stats_log = asyncio.ensure_future(ThroughputLog(engine.stats, interval).run()) if interval > 0 else None
    recording = asyncio.ensure_future(recorder.run()) if recorder is not None else None
    print(
        f"devgraph serve: model {state.model_name!r} listening on {listen_url(args.host, port)}", flush=True
    )
    await stop.wait()
    for task in (stats_log, recording):
        if task is not None:
            task.cancel()
    print("devgraph serve: shutting down", file=sys.stderr, flush=True)
    state.draining = True
    await loop.run_in_executor(None, engine.shutdown, args.drain_timeout)
    await runner.cleanup()
    state.chat_threads.shutdown(wait=False, cancel_futures=True)
    return 0


def _aiohttp_version() -> tuple[int, ...]:
    import aiohttp

    parts = []
    for piece in aiohttp.__version__.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)
