"""Ranks of a process group as devgraph sees them: rank, barrier, the gloo control group, its timeout.

The control group is a small gloo group devgraph builds once per process group, over the same ranks, for
its own messages (the capture handshake, the per-step key check): gloo raises on a timeout or a dead
peer, where a collective stuck on a device is only ended by NCCL's watchdog killing the process.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from devgraph.contract.platform import GraphPlatform
from devgraph.errors import ConfigError
from devgraph.messages import describe_error

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_RANK_TIMEOUT_S",
    "RANK_TIMEOUT_ENV",
    "PeerLost",
    "all_gather",
    "barrier",
    "control_group",
    "exchange",
    "forget_control_groups",
    "group_alive",
    "group_ranks",
    "is_multi_rank",
    "rank_name",
    "rank_of",
    "rank_timeout_s",
    "settle_device",
]


#: Environment variable: seconds a rank waits for the others at each handshake (capture, lock-step).
RANK_TIMEOUT_ENV = "DEVGRAPH_RANK_TIMEOUT_S"
DEFAULT_RANK_TIMEOUT_S = 60.0


def rank_timeout_s() -> float:
    """Seconds to wait for the other ranks: ``$DEVGRAPH_RANK_TIMEOUT_S`` or 60."""
    text = os.environ.get(RANK_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_RANK_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{RANK_TIMEOUT_ENV} must be a number of seconds > 0, got {text[:40]!r}")
    return value


def _distributed(group: Any) -> bool:
    return group is not None and torch.distributed.is_available() and torch.distributed.is_initialized()


def group_alive(group: Any) -> bool:
    """Whether ``group`` is a process group torch.distributed still knows (not destroyed)."""
    if not _distributed(group):
        return False
    try:  # a destroyed group still answers get_world_size(); its ranks are forgotten
        torch.distributed.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def is_multi_rank(group: Any) -> bool:
    """A live process group of two or more ranks (the only case with anything to agree on)."""
    return group_alive(group) and torch.distributed.get_world_size(group) > 1


def rank_of(group: Any) -> int:
    """This process's rank in ``group`` (0 without a live process group)."""
    return torch.distributed.get_rank(group) if group_alive(group) else 0


def group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group``, in group-rank order."""
    return list(torch.distributed.get_process_group_ranks(group))


def barrier(platform: GraphPlatform, group: Any) -> None:
    """Finish queued device work, then wait for every rank of ``group``."""
    platform.synchronize()
    if group_alive(group):
        torch.distributed.barrier(group=group)


# -- the control group ---------------------------------------------------------------------------------
_lock = threading.Lock()
_controls: dict[Any, Any] = {}  # process group -> its gloo control group
_built: dict[str, int] = {}  # process-group name -> control groups built for that name so far


def control_group(group: Any) -> Any:
    """The gloo group devgraph talks over for ``group`` (built on first use, by every member rank).

    A ``ProcessGroupGloo`` over ``group``'s ranks on the default store, under a key prefix of its own
    (``devgraph_control/<group name>/<n>``), with :func:`rank_timeout_s` as its timeout. Only the member
    ranks take part, so a tensor-parallel group inside a larger world needs nothing from the other ranks.
    It is not registered with torch.distributed: ``new_group(use_local_synchronization=True)`` names
    groups after their ranks, and groups built and destroyed over the same ranks then collide by name or
    read a destroyed group's stale addresses from the store. Every rank of ``group`` reaches the first
    handshake in the same order, so they build it together.
    """
    dist = torch.distributed
    with _lock:
        for known in [g for g in _controls if not group_alive(g)]:
            del _controls[known]  # its process group was destroyed
        control = _controls.get(group)
        if control is None:
            name = str(group.group_name)
            serial = _built.get(name, 0)
            _built[name] = serial + 1
            store = dist.PrefixStore(f"devgraph_control/{name}/{serial}/", _default_store())
            timeout = timedelta(seconds=rank_timeout_s())
            control = dist.ProcessGroupGloo(store, dist.get_rank(group), dist.get_world_size(group), timeout)
            _controls[group] = control
        return control


def _abort_process_group(group: Any) -> None:
    torch.distributed.distributed_c10d._abort_process_group(group)


def _default_store() -> Any:
    return torch.distributed.distributed_c10d._get_default_store()


def forget_control_groups(groups: list[Any] | None) -> list[Any]:
    """Drop the control groups of ``groups`` (``None``: all) from the cache; returns them."""
    with _lock:
        keys = list(_controls) if groups is None else [g for g in groups if g in _controls]
        return [_controls.pop(g) for g in keys]


class PeerLost(RuntimeError):
    """Another rank did not answer on the control group within the timeout, or died."""


def all_gather(group: Any, tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor`` (CPU) of every rank of ``group``, over its control group; :class:`PeerLost` on a timeout
    or a dead peer."""
    try:  # building the group waits for the other ranks too
        control = control_group(group)
        gathered = [torch.empty_like(tensor) for _ in range(control.size())]
        control.allgather([gathered], [tensor]).wait()
    except Exception as exc:  # gloo: a timeout, or "connection closed by peer"
        raise PeerLost(describe_error(exc, limit=160)) from exc
    return gathered


def exchange(group: Any, payload: Any) -> list[Any]:
    """Every rank's ``payload`` (picklable), in group-rank order: two all-gathers on the control group
    (lengths, then bytes). Raises :class:`PeerLost` when a rank does not answer within
    :func:`rank_timeout_s` or has died."""
    data = pickle.dumps(payload)
    lengths = [int(n) for n in all_gather(group, torch.tensor([len(data)], dtype=torch.int64))]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    blobs = all_gather(group, mine)
    return [pickle.loads(blob[:n].numpy().tobytes()) for blob, n in zip(blobs, lengths, strict=True)]


def rank_name(group: Any, group_rank: int) -> str:
    """``rank 1`` (with the global rank where it differs from the rank in ``group``)."""
    ranks = group_ranks(group)
    global_rank = ranks[group_rank] if group_rank < len(ranks) else group_rank
    return f"rank {group_rank}" + (f" (global rank {global_rank})" if global_rank != group_rank else "")


# -- device work a lost peer leaves behind -------------------------------------------------------------
def settle_device(
    platform: GraphPlatform,
    group: Any,
    grace_s: float = 5.0,
    release: Callable[[], None] | None = None,
) -> str:
    """After another rank failed or died: let this rank's queued device work finish, else abort ``group``.

    Work queued before the failure may hold a collective that no other rank will join; it would block
    every later synchronize (and freeing memory) forever. If the current stream is not idle within
    ``grace_s``, ``release`` frees this rank's graphs first (NCCL waits for the graphs that captured a
    communicator's collectives before it lets the communicator go, abort included), then the process
    group is aborted (NCCL ends its kernels). Returns a sentence for the error message ("" when nothing
    had to be done). CPU work is synchronous: nothing to do there.
    """
    if platform.device_type == "cpu":
        return ""
    stream = platform.current_stream()
    deadline = time.monotonic() + grace_s
    try:
        while not stream.query():
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        else:
            return ""
    except Exception:  # a device error is itself a reason to abort
        pass
    if release is not None:
        try:
            release()
        except Exception as exc:
            logger.warning("devgraph: releasing graphs before aborting the process group failed: %s", exc)
    aborts = [getattr(group, "abort", None), functools.partial(_abort_process_group, group)]
    failure: Exception = RuntimeError("no way to abort it")
    for abort in (a for a in aborts if a is not None):
        try:
            abort()
            break
        except Exception as exc:  # not implemented for this backend or torch version: the next way
            failure = exc
    else:
        return f" Aborting the process group failed ({describe_error(failure)}); exit the process."
    return (
        " This rank's device work waited on a collective the other ranks will never join, so the process "
        "group was aborted: destroy it and exit."
    )
