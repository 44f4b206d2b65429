"""Rank 0 starts the tensor-parallel world itself: N-1 worker processes, the process group, a monitor.

Why spawn rather than torchrun: one command for the user, like the single-device server; rank 0 owns its
workers, so it sees a worker's death at once (its exit code, within :data:`POLL_S`) instead of waiting
for a collective to time out, and stops them on SIGINT/SIGTERM. The monitor also asks the step channel
whether a worker has left a step unread for longer than the rank timeout (alive but stuck). A worker
finds rank 0 gone through the step channel (its parent exited, or no heartbeat within the rank timeout)
and exits.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from devgraph import ConfigError
from devgraph.serve.tp.channel import RankLost, StepChannel
from devgraph.serve.tp.rank import free_port, init_rank, rank_device

__all__ = ["EXIT_GRACE_S", "POLL_S", "TPWorld", "start_world"]

logger = logging.getLogger(__name__)

POLL_S = 0.1
#: After a rank is lost, seconds rank 0 has to answer its requests and exit before it is ended outright
#: (its engine thread may be stuck in a collective no rank will join).
EXIT_GRACE_S = 10.0


class TPWorld:
    """Rank 0's view: the worker processes, the step channel, the monitor, the failure (if any)."""

    def __init__(self, processes: list[Any], channel: StepChannel) -> None:
        self.processes = processes
        self.channel = channel
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._reported = threading.Lock()
        #: Called once with the reason when a rank is lost; the server replaces the start-up default.
        self.on_lost: Callable[[str], None] = self._lost_at_startup
        self._monitor = threading.Thread(target=self._watch, name="devgraph-tp-monitor", daemon=True)

    @property
    def group(self) -> Any:
        return torch.distributed.group.WORLD

    def report(self, message: str) -> None:
        """A rank is lost (first report wins): record it, start the hard-exit clock, tell ``on_lost``."""
        if self._stopping.is_set() or not self._reported.acquire(blocking=False):
            return
        self.failure = message
        self.channel.abort(f"the server is stopping: {message}")
        logger.error("devgraph serve --tp: %s; the server stops", message)
        timer = threading.Timer(EXIT_GRACE_S, self._hard_exit, (message,))
        timer.daemon = True
        timer.start()
        self.on_lost(message)

    def step_failed(self, message: str) -> None:
        """A forward failed on rank 0: most often a worker died mid-step (its connection closed before
        the monitor polled); name that rank when it did, else report ``message``."""
        deadline = time.monotonic() + 5 * POLL_S
        while time.monotonic() < deadline:
            dead = self._dead()
            if dead:
                self.report(dead)
                return
            time.sleep(POLL_S / 2)
        self.report(message)

    def _dead(self) -> str:
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return ""

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_S):
            lost = self._dead() or self.channel.stalled()
            if lost:
                self.report(lost)
                return

    def _lost_at_startup(self, message: str) -> None:
        self.stop()
        self._hard_exit(message)

    def _hard_exit(self, message: str) -> None:
        """End the process now; SIGKILL the workers first (one may be stuck in a device collective)."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        print(f"devgraph serve --tp: {message}; exiting (code 1)", file=sys.stderr, flush=True)
        os._exit(1)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the workers: the stop message (when they still listen), then join, then terminate."""
        first = not self._stopping.is_set()
        self._stopping.set()
        if first and self.failure is None and not self._dead():  # a dead worker: start-up failed on it too
            try:
                self.channel.send_stop()
            except RankLost as exc:
                logger.warning("stopping the tensor-parallel workers: %s", exc)
        for process in self.processes:
            process.join(timeout_s if self.failure is None else 0.5)
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
        if first:
            self.channel.close()
        if first and self.failure is None and torch.distributed.is_initialized():
            from devgraph.ranks import destroy_process_group

            destroy_process_group()  # closes the runners first, then the group


def start_world(args: argparse.Namespace) -> TPWorld:
    """Build the step channel, spawn ranks 1..``args.tp``-1 (:func:`~devgraph.serve.tp.worker.worker_main`),
    join the process group as rank 0; ``args.device`` becomes rank 0's device."""
    from devgraph.serve.tp.worker import worker_main

    size, port = int(args.tp), free_port()
    device = rank_device(args.device, 0)
    if device is not None and torch.device(device).type == "cuda" and size > torch.cuda.device_count():
        raise ConfigError(
            f"--tp {size} needs {size} GPUs, one per rank, but {torch.cuda.device_count()} are visible; "
            "lower --tp or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked; spawn works everywhere
    channel = StepChannel(size)
    processes = []
    for rank in range(1, size):
        worker_args = argparse.Namespace(**{**vars(args), "device": rank_device(args.device, rank)})
        worker_args.run = worker_args.command_parser = None  # not picklable, not needed
        process = context.Process(
            target=worker_main,
            args=(worker_args, rank, size, port, str(channel.path)),
            name=f"devgraph-tp-rank{rank}",
        )
        process.start()
        processes.append(process)
    world = TPWorld(processes, channel)
    world._monitor.start()
    args.device = device
    logger.info("tensor parallelism over %d ranks: waiting for ranks 1..%d (port %d)", size, size - 1, port)
    init_rank(args.device, 0, size, port)
    return world
