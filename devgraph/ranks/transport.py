"""How the data-parallel agreement's few int64 travel between the ranks: one all-reduce (MAX) per step.

Three ways, one interface (:meth:`Transport.max`):

* :class:`BoardTransport` — where every rank of the group runs on one host: a board in shared memory
  (:mod:`devgraph.ranks.shared_board`): each rank posts its values and reads the others'; a few
  microseconds, against 150-250 µs for a collective round trip on a GPU host. No device work, no stream.
* :class:`HostTransport` — on the group's gloo control group, a CPU tensor. Any backend, the CPU simulator
  included; a lost rank is a gloo timeout. About 150-250 µs a step on a GPU host (loopback TCP).
* :class:`DeviceTransport` — on a NCCL communicator of its own over the same ranks (never the model's, so
  it cannot interleave with the collectives inside the graphs), on a side stream of its own (so it never
  waits for the step the device is still running): the values go up from a pinned host buffer, the
  all-reduce runs on the device, they come back into a pinned buffer, and the host polls one event with a
  deadline, so a lost rank is an error after the rank timeout, never a hang.

:func:`transport_for` picks one: ``DEVGRAPH_DP_AGREEMENT=auto|shm|device|host`` (``auto``, the default:
the shared-memory board when every rank is on one host, else the device when the group is NCCL's and CUDA
is up, else the host). ``shm`` insists on the board (an error on every rank when the ranks span hosts).
Choosing the board is itself a collective (the ranks compare their hosts), so it happens at the group's
first agreement, on every rank together; the agreement (:class:`~devgraph.ranks.dp.GroupAgreement`)
says which way was taken (``transport``), and a runner's ``stats()`` too (``data_parallel.transport``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from devgraph.errors import ConfigError
from devgraph.ranks.group import PeerLost, control_group, group_alive, rank_timeout_s
from devgraph.ranks.shared_board import SharedBoard

__all__ = [
    "AGREEMENT_ENV",
    "BoardTransport",
    "DeviceTransport",
    "HostTransport",
    "Transport",
    "agreement_way",
    "forget_communicators",
    "transport_for",
    "transport_name",
]

logger = logging.getLogger(__name__)

#: Environment variable: where data-parallel agreement runs (``auto``, ``host`` or ``device``).
AGREEMENT_ENV = "DEVGRAPH_DP_AGREEMENT"
_CHOICES = ("auto", "shm", "host", "device")


class Transport:
    """One element-wise MAX all-reduce of ``len(values)`` int64 over a group; raises :class:`PeerLost`."""

    name = "abstract"

    def max(self, values: Sequence[int]) -> list[int]:
        raise NotImplementedError


class HostTransport(Transport):
    """The all-reduce on the group's gloo control group (a CPU tensor)."""

    name = "host"

    def __init__(self, group: Any) -> None:
        self.group = group
        self._control: Any = None
        self._options: Any = None

    def max(self, values: Sequence[int]) -> list[int]:
        message = torch.tensor(list(values), dtype=torch.int64)
        try:
            if self._control is None:
                self._control = control_group(self.group)  # every rank builds it at its first step
                self._options = torch.distributed.AllreduceOptions()
                self._options.reduceOp = torch.distributed.ReduceOp.MAX  # type: ignore[assignment]
            self._control.allreduce([message], self._options).wait()
        except Exception as exc:  # gloo: a timeout, or "connection closed by peer"
            raise PeerLost(str(exc)) from exc
        return message.tolist()


class BoardTransport(Transport):
    """The maximum read off a shared-memory board of the group's ranks (one host)."""

    name = "shm"

    def __init__(self, board: SharedBoard) -> None:
        self.board = board

    def max(self, values: Sequence[int]) -> list[int]:
        return self.board.max(values)


# -- the device way ------------------------------------------------------------------------------------
_lock = threading.Lock()
_communicators: dict[Any, Any] = {}  # process group -> the NCCL group agreement runs on
_built: dict[str, int] = {}


def _agreement_communicator(group: Any) -> Any:
    """A NCCL process group over ``group``'s ranks, for the agreement alone (built once, by every rank at
    its first step, on the default store under a prefix of its own, as the control group is)."""
    dist = torch.distributed
    with _lock:
        for known in [g for g in _communicators if not group_alive(g)]:
            del _communicators[known]
        found = _communicators.get(group)
        if found is None:
            name = str(group.group_name)
            serial = _built.get(name, 0)
            _built[name] = serial + 1
            store = dist.PrefixStore(
                f"devgraph_agree/{name}/{serial}/", dist.distributed_c10d._get_default_store()
            )
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=rank_timeout_s())
            found = dist.ProcessGroupNCCL(store, dist.get_rank(group), dist.get_world_size(group), options)
            _communicators[group] = found
        return found


class DeviceTransport(Transport):
    """The all-reduce on the device (see the module docstring); built on the current CUDA device."""

    name = "device"

    def __init__(self, group: Any, width: int) -> None:
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{AGREEMENT_ENV}=device needs a CUDA device and a NCCL process group; this process has no "
                f"CUDA device (use {AGREEMENT_ENV}=host)"
            )
        self.group = group
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.width = width
        self._host_in = torch.zeros(width, dtype=torch.int64, pin_memory=True)
        self._host_out = torch.zeros(width, dtype=torch.int64, pin_memory=True)
        # ctypes views of the pinned buffers: written and read in place, no tensor built per step.
        self._in = (ctypes.c_int64 * width).from_address(self._host_in.data_ptr())
        self._out = (ctypes.c_int64 * width).from_address(self._host_out.data_ptr())
        self._on_device = torch.zeros(width, dtype=torch.int64, device=self.device)
        self._stream = torch.cuda.Stream(self.device)
        self._done = torch.cuda.Event()
        self._communicator: Any = None
        self._options = torch.distributed.AllreduceOptions()
        self._options.reduceOp = torch.distributed.ReduceOp.MAX  # type: ignore[assignment]

    def max(self, values: Sequence[int]) -> list[int]:
        if len(values) != self.width:
            raise ValueError(f"the agreement message has {len(values)} values, the transport {self.width}")
        self._in[:] = list(values)
        try:
            if self._communicator is None:
                self._communicator = _agreement_communicator(self.group)
            with torch.cuda.stream(self._stream):
                self._on_device.copy_(self._host_in, non_blocking=True)
                work = self._communicator.allreduce([self._on_device], self._options)
                work.wait()  # the side stream waits for NCCL's stream (the host does not)
                self._host_out.copy_(self._on_device, non_blocking=True)
                self._done.record(self._stream)
            self._wait()
        except PeerLost:
            raise
        except Exception as exc:  # NCCL reports a failed or aborted communicator
            raise PeerLost(str(exc)) from exc
        return list(self._out)

    def _wait(self) -> None:
        """Poll the event until the values are back; past the rank timeout the communicator is aborted
        (NCCL's kernel would otherwise wait for the lost rank forever) and :class:`PeerLost` raised."""
        done = self._done
        if done.query():
            return
        deadline = time.monotonic() + rank_timeout_s()
        spins = 0
        while not done.query():
            spins += 1
            if spins % 256 == 0:
                if time.monotonic() > deadline:
                    self._abort()
                    raise PeerLost(
                        f"no answer from the other ranks' agreement within {rank_timeout_s():g} s on the "
                        "device; its NCCL communicator was aborted"
                    )
                time.sleep(0)  # let other threads of the engine run while a peer is late

    def _abort(self) -> None:
        communicator, self._communicator = self._communicator, None
        with _lock:
            _communicators.pop(self.group, None)
        abort = getattr(communicator, "abort", None)
        if abort is not None:
            with contextlib.suppress(Exception):  # nothing more to do: the caller raises for the loss
                abort()


def agreement_way() -> str:
    """``$DEVGRAPH_DP_AGREEMENT`` (``auto``, ``shm``, ``host`` or ``device``)."""
    text = os.environ.get(AGREEMENT_ENV, "").strip().lower() or "auto"
    if text not in _CHOICES:
        raise ConfigError(f"{AGREEMENT_ENV} must be one of {', '.join(_CHOICES)}; got {text[:40]!r}")
    return text


def _is_nccl(group: Any) -> bool:
    try:
        # "nccl", or a device map such as "cpu:gloo,cuda:nccl" for a group built with both
        return "nccl" in str(torch.distributed.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return False


def transport_name(group: Any) -> str:
    """Where ``group``'s agreement runs when the ranks span hosts (or ``shm`` is asked): ``shm``, ``host`` or
    ``device``. Under ``auto`` ranks of one host use the board instead, found at the first agreement
    (:attr:`GroupAgreement.transport <devgraph.ranks.dp.GroupAgreement.transport>` says)."""
    way = agreement_way()
    if way == "shm":
        return "shm"
    if way == "host" or (way == "auto" and not (_is_nccl(group) and torch.cuda.is_available())):
        return "host"
    return "device"


def transport_for(group: Any, width: int) -> Transport:
    """The transport for ``group``'s agreement (see the module docstring); every rank of ``group`` calls it
    at the same step (the board is built by all of them together)."""
    way = agreement_way()
    if way in ("auto", "shm") and group is not None:
        board, why_not = SharedBoard.build(group, width)
        if board is not None:
            return BoardTransport(board)
        if way == "shm":
            raise ConfigError(
                f"{AGREEMENT_ENV}=shm needs every rank of the data-parallel group on one host, each able to "
                f"map a file in /dev/shm; here {why_not}: use {AGREEMENT_ENV}=auto"
            )
        logger.info("data-parallel agreement: no shared-memory board (%s); a collective instead", why_not)
    if transport_name(group) == "host":
        return HostTransport(group)
    if torch.cuda.is_available() and not _is_nccl(group):
        raise ConfigError(
            f"{AGREEMENT_ENV}=device runs the agreement on NCCL; this data-parallel group's backend is "
            f"not NCCL (use {AGREEMENT_ENV}=host)"
        )
    return DeviceTransport(group, width)


def forget_communicators(groups: list[Any] | None) -> None:
    """Shut down the agreement communicators of ``groups`` (``None``: all), before their groups go."""
    with _lock:
        keys = list(_communicators) if groups is None else [g for g in groups if g in _communicators]
        found = [_communicators.pop(g) for g in keys]
    for communicator in found:
        for way in ("shutdown", "abort"):
            end = getattr(communicator, way, None)
            if end is not None:
                try:
                    end()
                    break
                except Exception:  # not implemented for this torch version: the next way
                    continue
