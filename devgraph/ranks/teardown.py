"""Teardown: graphs that hold a communicator's collectives are released before the communicator goes.

NCCL does not free a communicator while a CUDA graph that captured one of its collectives is alive: its
finalize waits for such graphs to be destroyed, so ``torch.distributed.destroy_process_group()`` with live
runners would wait forever. devgraph keeps the order for the engine:

* every runner built with a ``process_group`` is remembered (weakly) with its group;
* :func:`destroy_process_group` closes the group's runners, then destroys the group;
* the first such runner also routes ``torch.distributed.destroy_process_group`` through the same steps
  (:func:`install_destroy_guard`), so an engine that destroys the group first gets its runners closed
  first (a documented no-op on their later ``close()``), not a hang;
* :func:`release_backend` is what ``close()`` does with the graphs: free them, unless the group is gone
  already (destroyed by a path that bypassed the guard) on a device, where they are kept to the end of
  the process rather than freed against a communicator that no longer exists.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any

import torch

from devgraph.contract.platform import GraphPlatform
from devgraph.ranks.group import forget_control_groups, group_alive
from devgraph.ranks.transport import forget_communicators

__all__ = ["destroy_process_group", "install_destroy_guard", "release_backend", "track_runner"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_runners: dict[Any, weakref.WeakSet[Any]] = {}  # process group -> runners built with it
_original_destroy: Any = None  # torch's destroy_process_group, once the guard is installed
_kept: list[Any] = []  # backends whose graphs outlived their process group (see release_backend)


def track_runner(runner: Any, group: Any) -> None:
    """Remember a runner built with ``group`` for :func:`destroy_process_group`; installs the guard."""
    if group is None:
        return
    with _lock:
        _runners.setdefault(group, weakref.WeakSet()).add(runner)
    install_destroy_guard()


def _everything(group: Any) -> bool:
    dist = torch.distributed
    return group is None or (dist.is_initialized() and group is dist.group.WORLD)


def close_runners(group: Any = None) -> int:
    """Close the runners built with ``group`` (``None`` or the world group: all); returns how many."""
    with _lock:
        groups = list(_runners) if _everything(group) else [group]
        runners = [runner for g in groups for runner in list(_runners.pop(g, ()))]
    for runner in runners:
        runner.close()
    return len(runners)


def _destroy(group: Any, destroy: Any) -> None:
    close_runners(group)
    # The control group is forgotten, not destroyed: torch names a group built with local
    # synchronization after its ranks, so a new control group over the same ranks would take the
    # destroyed one's name and could read its stale addresses from the store. The world's destroy takes
    # every group with it, control groups included.
    forget_control_groups(None if _everything(group) else [group])
    forget_communicators(None if _everything(group) else [group])  # the device agreement's own NCCL groups
    destroy(group)


def destroy_process_group(group: Any = None) -> None:
    """Close every runner built with ``group`` (``None``: every runner), then destroy the group. The
    teardown engines should call after their last step."""
    _destroy(group, _original_destroy or torch.distributed.destroy_process_group)


def install_destroy_guard() -> None:
    """Route ``torch.distributed.destroy_process_group`` through :func:`destroy_process_group` (once).

    Only adds the runners' ``close()`` before torch's own function, which then runs as before. Code that
    bound torch's function to a name before the first runner was built calls it directly, bypassing this.
    """
    global _original_destroy
    dist = torch.distributed
    with _lock:
        if _original_destroy is not None or not dist.is_available():
            return
        original = dist.destroy_process_group

        @functools.wraps(original)
        def guarded(group: Any = None) -> None:
            _destroy(group, original)

        _original_destroy = original
        dist.destroy_process_group = guarded
        dist.distributed_c10d.destroy_process_group = guarded


def release_backend(backend: Any, group: Any, platform: GraphPlatform) -> None:
    """Release a closing runner's graphs (``backend.cleanup()``), unless that is unsafe.

    When ``group`` was given but has been destroyed already, on a device platform, freeing graphs that
    captured its collectives could reach into a freed communicator: the graphs are kept until the process
    exits instead, and a warning says so. On the CPU simulator graphs are plain Python objects, freed as
    usual.
    """
    if group is None or group_alive(group) or platform.device_type == "cpu":
        backend.cleanup()
        return
    logger.warning(
        "devgraph: runner.close() after its process group was destroyed: its %s graphs are kept until "
        "the process exits, since they may hold the communicator's collectives. Close runners (or call "
        "devgraph.ranks.destroy_process_group()) before destroying the process group",
        getattr(backend, "name", "?"),
    )
    _kept.append(backend)
