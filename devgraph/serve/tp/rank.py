"""One rank's device and its joining of the tensor-parallel process group (rank 0 and the workers)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch

from devgraph.ranks.group import rank_timeout_s

__all__ = ["free_port", "init_rank", "rank_device"]


def rank_device(device: str | None, rank: int) -> str | None:
    """Rank ``rank``'s device: ``cuda:<rank>`` when the server runs on CUDA, else ``device`` unchanged."""
    if device is None:
        return f"cuda:{rank}" if torch.cuda.is_available() else None
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_rank(device: str | None, rank: int, size: int, port: int) -> None:
    """Join the process group: NCCL on CUDA, gloo on the CPU; waits up to the rank timeout for the rest."""
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(torch.device(device))  # type: ignore[arg-type]
    torch.distributed.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=rank_timeout_s()),
    )
