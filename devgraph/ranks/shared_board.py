"""A board in shared memory where the ranks of one host post a few int64 per step and read each other's.

The data-parallel agreement is an element-wise MAX of about eight int64 over the ranks, once per step. A
collective for it costs what a collective costs on the way there and back: 150-250 µs over gloo's
loopback TCP, about 180 µs as a NCCL all-reduce on the device with the copies around it and the wait for
them (two H200s, ``benchmarks/results/h200x2-dp-agree.json``). Where every rank runs on one host, the
ranks can simply write their values into memory they all map and read the others': a few microseconds.

Layout: one int64 array, per rank two *slots* (step parity), each ``[values..., step]``. At step ``k``
a rank writes its values into its slot ``k % 2``, then the step number ``k`` after them (a full barrier
between: a reader that sees ``k`` sees the values), then waits until every other rank's slot ``k % 2``
says ``k`` and reads their values. Two slots suffice: a rank writes its slot ``k % 2`` again at step
``k + 2``, which it reaches only after every rank posted step ``k + 1``, that is, after every rank finished
reading step ``k``.

A late rank is waited for up to the rank timeout (spinning at first, then yielding the processor), then
:class:`~devgraph.ranks.group.PeerLost` is raised, as the other transports do.

The file lives in ``/dev/shm`` (memory, never disk) and is unlinked once every rank mapped it: a crash
leaves nothing behind. Built by every rank of the group together (:meth:`SharedBoard.build`: a few
exchanges on the group's gloo control group), only where all of them are on one host.
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devgraph.errors import ConfigError
from devgraph.ranks.group import PeerLost, exchange, rank_of, rank_timeout_s

__all__ = [
    "BOARD_PREFIX",
    "SharedBoard",
    "host_identity",
    "memory_barrier",
    "remove_files_of_dead_processes",
    "shm_directory",
]

#: The board files' names: ``devgraph-agree-<pid of rank 0>-<random>``.
BOARD_PREFIX = "devgraph-agree-"

_WORD = 8  # bytes of one int64
#: Polls of the board before a waiting rank yields the processor (and Python's lock: an engine's other
#: threads run) between polls.
_SPINS = 256
_FENCE = threading.Lock()


def memory_barrier() -> None:
    """A full memory barrier (acquiring and releasing a lock is an atomic read-modify-write with fences):
    the values a rank wrote are visible before the step number that announces them."""
    _FENCE.acquire()
    _FENCE.release()


def host_identity() -> str:
    """What tells hosts apart: the host name and this boot's id (containers of one host name on other
    machines differ in the second)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def remove_files_of_dead_processes(directory: Path, prefix: str, older_than_s: float = 60.0) -> int:
    """Remove ``directory/<prefix><pid>-...`` files whose creating process is gone, older than
    ``older_than_s`` (a file of a live process of another PID namespace is young: it is unlinked within
    seconds of its readers attaching). Such files are what a process killed before its peers attached
    leaves in ``/dev/shm``: memory, never freed until removed. Returns how many were removed."""
    removed = 0
    now = time.time()
    for path in directory.glob(f"{prefix}*"):
        pid_text = path.name[len(prefix) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        try:
            if now - path.stat().st_mtime >= older_than_s:
                path.unlink()
                removed += 1
        except OSError:  # removed meanwhile, or not ours to remove
            continue
    return removed


def shm_directory() -> Path:
    """Where files shared between the processes of one host live (this board, the tensor-parallel step
    ring): ``/dev/shm`` where writable (memory, never disk), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SharedBoard:
    """One group's board (see the module docstring). Use :meth:`build`; :meth:`max` is one step."""

    def __init__(self, mapped: mmap.mmap, ranks: int, rank: int, width: int) -> None:
        self._map = mapped
        self._words = memoryview(mapped).cast("q")
        self.ranks, self.rank, self.width = ranks, rank, width
        self._stride = width + 1  # a slot: the values, then the step number
        self._step = 0

    @classmethod
    def build(cls, group: Any, width: int) -> tuple[SharedBoard | None, str]:
        """Every rank of ``group`` together: the board and ``""``, or ``None`` and why not on every rank
        (the ranks are not all on one host, or a rank could not map it; each rank then uses another
        transport: the decision is the same on every rank, as it is taken from what every rank reported).
        Raises :class:`ConfigError` on every rank when the ranks' ``width`` differ (no collective could
        agree: gloo aborts the process on a size mismatch), :class:`PeerLost` when a rank is lost."""
        rank = rank_of(group)
        found = exchange(group, (host_identity(), width))
        widths = [w for _, w in found]
        if len(set(widths)) != 1:
            # Any collective would fail (gloo aborts the process on a size mismatch): every rank says so.
            listed = "; ".join(f"rank {r}: {w} values" for r, w in enumerate(widths))
            raise ConfigError(
                f"the data-parallel ranks' agreement messages differ in width ({listed}): their runners "
                "were built with other axes; build every rank's runner with the same axes"
            )
        hosts = {host for host, _ in found}
        if len(hosts) != 1:
            return None, f"the ranks span {len(hosts)} hosts"
        ranks = len(found)
        size = ranks * 2 * (width + 1) * _WORD
        path, mapped, problem = None, None, ""
        try:
            if rank == 0:
                try:
                    remove_files_of_dead_processes(shm_directory(), BOARD_PREFIX)
                    path = shm_directory() / f"{BOARD_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
                    mapped = _map(path, size, create=True)
                except OSError as exc:
                    problem = f"rank 0 could not create the board: {exc}"
            names = exchange(group, (str(path) if path is not None and mapped is not None else None, problem))
            shared, problem = names[0]
            if rank != 0 and shared is not None:
                try:
                    mapped = _map(Path(shared), size, create=False)
                except OSError as exc:
                    problem = f"could not map {shared}: {exc}"
            answers = exchange(group, problem if mapped is None else "")
        except BaseException:  # a rank lost while building (PeerLost): no file, no mapping left behind
            if mapped is not None:
                mapped.close()
            raise
        finally:
            if rank == 0 and path is not None:
                path.unlink(missing_ok=True)  # every rank mapped it (or gave up): the name is not needed
        problems = [f"rank {r}: {text}" for r, text in enumerate(answers) if text]
        if problems:
            if mapped is not None:
                mapped.close()
            return None, "; ".join(problems)
        assert mapped is not None
        return cls(mapped, ranks, rank, width), ""

    def max(self, values: Sequence[int]) -> list[int]:
        """This step's element-wise maximum of every rank's ``values``."""
        width = self.width
        if len(values) != width:
            raise ValueError(f"the agreement message has {len(values)} values, the board {width}")
        self._step += 1
        step, parity, words, stride = self._step, self._step & 1, self._words, self._stride
        mine = (self.rank * 2 + parity) * stride
        words[mine : mine + width] = memoryview(array.array("q", values))
        memory_barrier()
        words[mine + width] = step
        result = list(values)
        deadline = 0.0  # one deadline for the whole step (not one per late peer): set at the first wait
        for peer in range(self.ranks):
            if peer == self.rank:
                continue
            slot = (peer * 2 + parity) * stride
            if words[slot + width] != step:
                deadline = deadline or time.monotonic() + rank_timeout_s()
                self._wait(slot + width, step, peer, deadline)
            memory_barrier()
            for i, value in enumerate(words[slot : slot + width]):
                if value > result[i]:
                    result[i] = value
        return result

    def _wait(self, at: int, step: int, peer: int, deadline: float) -> None:
        words = self._words
        spins = 0
        while words[at] != step:
            spins += 1
            if spins > _SPINS:
                if spins % 256 == 0 and time.monotonic() > deadline:
                    raise PeerLost(
                        f"rank {peer} did not post step {step} of the agreement on the shared-memory board "
                        f"within {rank_timeout_s():g} s"
                    )
                time.sleep(0)  # yield: the late rank may share this processor

    def close(self) -> None:
        self._words.release()
        self._map.close()


def _map(path: Path, size: int, *, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size != size:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, not {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
