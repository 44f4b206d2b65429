"""One rank's device and its joining of the tensor-parallel process group (rank 0 and the workers)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch

from devgraph.ranks.group import rank_timeout_s

__all__ = ["MEET_S", "free_port", "init_rank", "rank_device"]


def rank_device(device: str | None, rank: int) -> str | None:
    """Rank ``rank``'s device: ``cuda:<rank>`` when the server runs on CUDA, else ``device`` unchanged."""
    if device is None:
        return f"cuda:{rank}" if torch.cuda.is_available() else None
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: Seconds the ranks may take to meet at start-up (importing torch, initialising a device), whatever the
#: rank timeout: a short DEVGRAPH_RANK_TIMEOUT_S is for lost ranks, not for a slow start on a busy host.
MEET_S = 120.0


def init_rank(device: str | None, rank: int, size: int, port: int) -> None:
    """Join the process group: NCCL on CUDA, gloo on the CPU. The ranks meet on rank 0's TCP store within
    :data:`MEET_S` (or the rank timeout, if longer); the group's collectives time out after the rank
    timeout."""
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(torch.device(device))  # type: ignore[arg-type]
    timeout = rank_timeout_s()
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, size, is_master=rank == 0, timeout=timedelta(seconds=max(MEET_S, timeout))
    )
    torch.distributed.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout),
    )
