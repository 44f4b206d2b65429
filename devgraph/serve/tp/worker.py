"""A tensor-parallel rank other than 0: build the same engine (its shard), then run every step rank 0 sends.

The worker maps rank 0's step ring first thing, then builds the engine with the same flags, so its
runners capture the same graphs in lock-step with rank 0 (the runners' capture handshake). Then it loops:
a step message becomes the same device work on this rank's shard as on rank 0
(:class:`~devgraph.serve.engine.device_step.DeviceStep`: copy-on-write blocks, the step's pending ids
received from rank 0 on the device, the forward); it samples nothing (rank 0 does). The stop message,
or rank 0 gone (:class:`RankLost`), ends it. SIGINT is ignored: a terminal's Ctrl-C reaches every
process of the group, and rank 0 stops the workers.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import torch

from devgraph.serve.engine.engine import Engine
from devgraph.serve.engine.timeline import StepTimeline
from devgraph.serve.engine.wire import STOP
from devgraph.serve.tp.channel import RankLost, WorkerChannel

__all__ = ["serve_steps", "worker_main"]

logger = logging.getLogger(__name__)


def serve_steps(engine: Engine, channel: WorkerChannel, timeline: StepTimeline | None = None) -> int:
    """Run rank 0's steps until the stop (0) or until rank 0 is gone (1). ``timeline``: a span per step,
    from its message in hand to its device work issued (``DEVGRAPH_STEP_TIMELINE``)."""
    memory = engine.message_memory  # the engine's own: a worker's engine issues no steps of its own
    while True:
        try:
            message = channel.receive(memory.host_buffer)
        except RankLost as exc:
            logger.error("rank 0 is gone: %s; this worker exits", exc)
            return 1
        if message.kind == STOP:
            return 0
        mark = timeline.begin(message.kind, message.step) if timeline is not None else None
        try:
            inputs = memory.inputs(message)
            engine.device_step.forward(message.kind, inputs, message.context())
        except Exception:
            logger.exception("a %s step failed on this rank; this worker exits", message.kind)
            return 1
        if timeline is not None:
            ids = inputs.get("input_ids")
            rows = inputs.get("table_rows")
            timeline.end(
                mark,
                int(ids.shape[0]) if ids is not None else 0,
                int(rows.shape[0]) if rows is not None else 0,
            )


def worker_main(args: argparse.Namespace, rank: int, size: int, port: int, ring: str) -> None:
    """The entry point of rank ``rank`` (a spawned process); ``ring``: rank 0's step ring file."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Rank 0 logs every start-up stage; a worker's own lines would repeat them, so it logs problems only
    # (everything with --log-level debug), and draws no progress bars.
    level = "DEBUG" if args.log_level == "debug" else "WARNING"
    logging.basicConfig(level=level, format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s")
    args.progress = False
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    from devgraph.ranks import destroy_process_group
    from devgraph.serve.startup import build_engine, open_source
    from devgraph.serve.tp.rank import init_rank

    code = 1
    try:
        on_gpu = args.device is not None and torch.device(args.device).type == "cuda"
        channel = WorkerChannel(Path(ring), rank, pin=on_gpu)  # before the group: rank 0 waits for it
        init_rank(args.device, rank, size, port)
        engine = build_engine(args, open_source(args), group=torch.distributed.group.WORLD)
        timeline = StepTimeline.from_environment(engine, rank)  # DEVGRAPH_STEP_TIMELINE: the benchmarks
        try:
            code = serve_steps(engine, channel, timeline)
        finally:
            if timeline is not None and code == 0:
                timeline.save()  # logs a failure, never raises: the teardown below runs
            if code == 0:
                engine.close()
                destroy_process_group()
            channel.close()
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
    sys.exit(code)
