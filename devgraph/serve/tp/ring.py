"""A ring of message slots in shared memory: one writer (rank 0), a few readers (the other ranks), one host.

Why shared memory: a tensor-parallel step must reach every rank before any of them can launch it, so the
hand-over is on every step's critical path. A pickle broadcast over a gloo socket costs a few hundred
microseconds; a copy into memory every rank maps, and a flag the readers poll, costs a few.

The ring is one file in ``/dev/shm`` (the temporary directory where there is none) that every rank maps;
rank 0 removes its name once every reader has mapped it, so a crash leaves nothing behind. Layout::

    control (256 bytes): magic, slots, capacity, readers, the writer's pid, its heartbeat (monotonic
                         seconds), a closed flag; one "attached" byte per reader at offset 64, one
                         "parked" byte per reader at offset 128
    slot i (128 + capacity bytes): a "written" byte and one "read" byte per reader (offset 0); the
                         publish time (float64, offset 64); chunk length, more-follows, message length,
                         sequence number (offset 72); the chunk (offset 128)

Per slot, as in vLLM's shared-memory broadcast: the writer waits until the slot is free (never written,
or every reader has read it), clears "written", clears the read bytes, copies the chunk, sets "written";
a reader waits until "written" is set and its read byte is clear, copies the chunk out, sets its read
byte. Writer and readers walk the slots in the same order, so these flags are all the synchronisation
there is; a full memory barrier (a lock's acquire and release) separates the data from the flags, for
CPUs that reorder stores (Arm; x86 does not). The flags are single bytes and the times aligned 8-byte
fields written in one store, so no reader sees half of a value. A message longer than a slot goes in
consecutive slots.

Waiting: a reader polls with ``sched_yield`` while messages came within the last ``spin_s`` seconds
(:data:`SPIN_S`, ``$DEVGRAPH_TP_SPIN_S``): under load it sees a message a microsecond or two after its
publication, even after a long prefill step. Then it parks (Linux): it sets its "parked" byte and blocks
on a datagram socket of its own in the abstract namespace, which the writer rings after a publication
that finds the byte set; the kernel wakes it within microseconds, and an idle server burns no core.
Elsewhere it sleeps in steps doubling up to :data:`MAX_SLEEP_S`. On a host with more runnable threads
than cores, a spinning reader can lose the CPU for a whole time slice while a parked one is woken at
once: ``DEVGRAPH_TP_SPIN_S=0`` parks right away. (vLLM's readers spin for a second after each message;
its users on machines where CPU and GPU share a power budget asked for less.) Every :data:`CHECK_S` of
waiting the caller's ``check`` runs: it raises to give up (the other side is gone).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import select
import socket
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from devgraph.ranks.shared_board import memory_barrier, remove_files_of_dead_processes, shm_directory

__all__ = [
    "CHECK_S",
    "MAX_SLEEP_S",
    "SPIN_ENV",
    "SPIN_S",
    "RingReader",
    "RingWriter",
    "spin_seconds",
]

#: Seconds of busy-polling after the last message before a waiter starts to sleep (longer than any step).
SPIN_S = 0.5
SPIN_ENV = "DEVGRAPH_TP_SPIN_S"
#: The longest sleep between two polls once idle (the latency of the first message after a pause).
MAX_SLEEP_S = 0.002
MIN_SLEEP_S = 0.00005
#: Seconds between two calls of a waiter's ``check`` (is the other side still there?).
CHECK_S = 0.01

_MAGIC = b"DGTPRING"
_CONTROL_BYTES = 256
_ATTACHED_AT = 64
_PARKED_AT = 128
_SLOT_HEAD = 128
_TIME_AT = 64
_META_AT = 72
_META = struct.Struct("<IIQQ")  # chunk bytes, more chunks follow (0/1), message bytes, sequence number
#: The ring files' names: ``devgraph-tp-<pid of rank 0>-<random>``.
RING_PREFIX = "devgraph-tp-"
_MAX_READERS = 63  # one read byte each in the slot's first cache line, after the written byte


class _Control(ctypes.Structure):
    _fields_ = [
        ("magic", ctypes.c_char * 8),
        ("slots", ctypes.c_uint32),
        ("capacity", ctypes.c_uint32),
        ("readers", ctypes.c_uint32),
        ("writer_pid", ctypes.c_uint32),
        ("heartbeat", ctypes.c_double),
        ("closed", ctypes.c_uint8),
    ]


class _Mapped:
    """The mapped file and the views both ends use."""

    def __init__(self, path: Path, size: int | None) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if size is not None:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size or 0)
        finally:
            os.close(fd)
        self.path = path
        self.view = memoryview(self.map)
        self._anchor = ctypes.c_char.from_buffer(self.map)
        self.base = ctypes.addressof(self._anchor)
        self.control = _Control.from_buffer(self.map)
        if size is not None:
            self.control.magic = _MAGIC
        elif self.control.magic != _MAGIC:
            self.close()
            raise ValueError(f"{path} is not a devgraph step ring")
        self.slots = int(self.control.slots)
        self.capacity = int(self.control.capacity)
        self.readers = int(self.control.readers)
        self._times: list[ctypes.c_double] = []

    def configure(self, slots: int, capacity: int, readers: int) -> None:
        self.slots, self.capacity, self.readers = slots, capacity, readers
        self.control.slots, self.control.capacity, self.control.readers = slots, capacity, readers

    def slot(self, index: int) -> int:
        return _CONTROL_BYTES + index * (_SLOT_HEAD + self.capacity)

    def publish_time(self, index: int) -> ctypes.c_double:
        if not self._times:
            self._times = [
                ctypes.c_double.from_buffer(self.map, self.slot(i) + _TIME_AT) for i in range(self.slots)
            ]
        return self._times[index]

    def close(self) -> None:
        # The ctypes views export the map's buffer: drop them before closing it.
        self._times = []
        del self.control, self._anchor
        self.view.release()
        self.map.close()


def _free(view: memoryview, flags: int, read: slice, done: bytes) -> bool:
    """Is the slot at ``flags`` free: never written, or read by every reader?"""
    return view[flags] == 0 or bytes(view[read]) == done


def _posted(view: memoryview, flags: int, mine: int) -> bool:
    """Is the slot at ``flags`` written and not yet read by the reader whose byte is ``mine``?"""
    return view[flags] == 1 and view[mine] == 0


def spin_seconds() -> float:
    """``$DEVGRAPH_TP_SPIN_S`` (seconds, >= 0) or :data:`SPIN_S`."""
    try:
        return max(0.0, float(os.environ.get(SPIN_ENV, "") or SPIN_S))
    except ValueError:
        return SPIN_S


def _wait(
    ready: Callable[[], bool],
    spin_until: float,
    check: Callable[[], None],
    park: Callable[[Callable[[], bool]], None] | None = None,
) -> None:
    """Return once ``ready()``: spin until ``spin_until``, then ``park`` (block until woken, at most
    CHECK_S) or sleep in growing steps; ``check()`` every CHECK_S."""
    if ready():
        return
    now = time.monotonic()
    next_check, pause = now + CHECK_S, MIN_SLEEP_S
    while not ready():
        now = time.monotonic()
        if now >= next_check:
            check()
            next_check = now + CHECK_S
        if now < spin_until:
            os.sched_yield()
        elif park is not None:
            park(ready)
        else:
            time.sleep(pause)
            pause = min(2 * pause, MAX_SLEEP_S)


def _bell_address(path: Path, reader: int) -> str:
    """Reader ``reader``'s doorbell: an abstract Unix socket name (no file), unique to the ring."""
    return f"\0{path.name}-{reader}"


class _Doorbell:
    """What a reader blocks on once it stops spinning: a datagram socket in Linux's abstract namespace. The
    writer rings it after a publication when the reader's "parked" byte is set; the kernel wakes the reader
    at once (a sleeping poller would wake late, and a spinning one loses the CPU on a crowded host)."""

    def __init__(self, address: str) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.socket.bind(address)
        except OSError:
            self.socket.close()
            raise
        self.socket.setblocking(False)

    def wait(self, timeout: float) -> None:
        select.select([self.socket], [], [], timeout)
        try:
            while self.socket.recv(64):
                pass
        except OSError:  # drained
            pass

    def close(self) -> None:
        self.socket.close()


class RingWriter:
    """Rank 0's end: creates the ring file; :meth:`write` copies one message in (chunked when long)."""

    def __init__(self, readers: int, slots: int = 16, capacity: int = 256 << 10) -> None:
        if not 1 <= readers <= _MAX_READERS:
            raise ValueError(f"a step ring has 1..{_MAX_READERS} readers, got {readers}")
        capacity = -(-capacity // 64) * 64
        # A rank 0 killed before its workers attached left its file behind (4 MiB of memory each).
        remove_files_of_dead_processes(shm_directory(), RING_PREFIX)
        path = shm_directory() / f"{RING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._mapped = _Mapped(path, _CONTROL_BYTES + slots * (_SLOT_HEAD + capacity))
        self._mapped.configure(slots, capacity, readers)
        self._mapped.control.writer_pid = os.getpid()
        self.beat()
        self.path = path
        self.readers = readers
        self._next = 0
        self._last = 0.0
        self._lock = threading.Lock()
        self._unlinked = False
        self._done = bytes([1]) * readers
        self._awake = bytes(readers)
        self._bell: socket.socket | None = None
        self.spin_s = spin_seconds()
        # A ring never attached (its writer dropped, or the process exiting) takes its name with it.
        self._unlink_at_exit = weakref.finalize(self, Path.unlink, path, missing_ok=True)

    @property
    def sequence(self) -> int:
        """Chunks written so far."""
        return self._next

    def beat(self) -> None:
        """Record that rank 0 is alive (readers give up after a long silence)."""
        self._mapped.control.heartbeat = time.monotonic()

    def attached(self) -> bool:
        """Has every reader mapped the ring?"""
        view = self._mapped.view
        return bytes(view[_ATTACHED_AT : _ATTACHED_AT + self.readers]) == self._done

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay valid); a later crash then leaves nothing behind."""
        if not self._unlinked:
            self._unlinked = True
            self._unlink_at_exit.detach()
            self.path.unlink(missing_ok=True)

    def write(self, data: torch.Tensor, check: Callable[[], None]) -> None:
        """Copy ``data`` (a contiguous CPU uint8 tensor) in; ``check`` runs while the ring is full."""
        with self._lock:
            mapped, view = self._mapped, self._mapped.view
            total, source, done = int(data.numel()), int(data.data_ptr()), 0
            while True:
                count = min(mapped.capacity, total - done)
                index = self._next % mapped.slots
                flags = mapped.slot(index)
                read = slice(flags + 1, flags + 1 + self.readers)
                _wait(
                    functools.partial(_free, view, flags, read, self._done), self._last + self.spin_s, check
                )
                view[flags] = 0
                memory_barrier()
                view[read] = bytes(self.readers)
                ctypes.memmove(mapped.base + flags + _SLOT_HEAD, source + done, count)
                more = int(done + count < total)
                _META.pack_into(view, flags + _META_AT, count, more, total, self._next)
                mapped.publish_time(index).value = time.monotonic()
                memory_barrier()
                view[flags] = 1
                memory_barrier()  # the written byte before the parked bytes: no reader parks unseen
                if view[_PARKED_AT : _PARKED_AT + self.readers] != self._awake:
                    self._ring_parked()
                self._next += 1
                done += count
                if not more:
                    break
            self._last = time.monotonic()

    def _ring_parked(self) -> None:
        """Wake every reader that sleeps on its doorbell (a lost datagram only delays it by CHECK_S)."""
        if self._bell is None:
            self._bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._bell.setblocking(False)
        view = self._mapped.view
        for reader in range(self.readers):
            if view[_PARKED_AT + reader]:
                # No doorbell (not Linux) or a full queue: that reader wakes within CHECK_S anyway.
                with contextlib.suppress(OSError):
                    self._bell.sendto(b"\1", _bell_address(self.path, reader))

    def unread(self, older_than_s: float) -> dict[int, int]:
        """Readers that have not read a chunk published more than ``older_than_s`` ago: reader -> the
        chunk's sequence number. A slot being rewritten can look stale for an instant: callers confirm
        a finding on a second look (the same sequence number)."""
        mapped, view, now = self._mapped, self._mapped.view, time.monotonic()
        late: dict[int, int] = {}
        for index in range(mapped.slots):
            flags = mapped.slot(index)
            if view[flags] != 1 or now - mapped.publish_time(index).value < older_than_s:
                continue
            sequence = _META.unpack_from(view, flags + _META_AT)[3]
            for reader in range(self.readers):
                if view[flags + 1 + reader] == 0:
                    late[reader] = min(late.get(reader, sequence), sequence)
        return late

    def close(self) -> None:
        """Tell the readers the ring is closed, remove the file, unmap it (not while a write still waits
        for a reader: the mapping then lives until the process exits)."""
        if getattr(self._mapped, "control", None) is None:
            return
        self._mapped.control.closed = 1
        self.unlink()
        if self._bell is not None:
            self._bell.close()
        if self._lock.acquire(timeout=1.0):
            try:
                self._mapped.close()
            finally:
                self._lock.release()


class RingReader:
    """Reader ``reader``'s end (0-based: rank ``reader + 1``): maps the file rank 0 created."""

    def __init__(self, path: Path | str, reader: int) -> None:
        self._mapped = _Mapped(Path(path), None)
        if not 0 <= reader < self._mapped.readers:
            readers = self._mapped.readers
            self._mapped.close()
            raise ValueError(f"reader {reader} of a ring with {readers} readers")
        self.reader = reader
        self.writer_pid = int(self._mapped.control.writer_pid)
        self._next = 0
        self._last = 0.0
        self.spin_s = spin_seconds()
        try:
            self._bell: _Doorbell | None = _Doorbell(_bell_address(Path(path), reader))
        except OSError:  # no abstract sockets here: sleep in short steps once idle
            self._bell = None
        self._mapped.view[_ATTACHED_AT + reader] = 1

    @property
    def closed(self) -> bool:
        return bool(self._mapped.control.closed)

    def heartbeat_age(self) -> float:
        """Seconds since rank 0 last recorded that it is alive."""
        return time.monotonic() - float(self._mapped.control.heartbeat)

    def read(self, allocate: Callable[[int], torch.Tensor], check: Callable[[], None]) -> torch.Tensor:
        """The next message, copied into ``allocate(length)`` (a contiguous CPU uint8 tensor)."""
        mapped, view = self._mapped, self._mapped.view
        out: torch.Tensor | None = None
        done = 0
        while True:
            index = self._next % mapped.slots
            flags = mapped.slot(index)
            mine = flags + 1 + self.reader
            ready = functools.partial(_posted, view, flags, mine)
            _wait(ready, self._last + self.spin_s, check, self._park if self._bell is not None else None)
            memory_barrier()
            count, more, total, _ = _META.unpack_from(view, flags + _META_AT)
            if out is None:
                out = allocate(total)
            ctypes.memmove(int(out.data_ptr()) + done, mapped.base + flags + _SLOT_HEAD, count)
            memory_barrier()
            view[mine] = 1
            self._next += 1
            done += count
            if not more:
                self._last = time.monotonic()
                return out

    def _park(self, ready: Callable[[], bool]) -> None:
        """Sleep on the doorbell until the writer rings it (or CHECK_S passes)."""
        assert self._bell is not None
        view, parked = self._mapped.view, _PARKED_AT + self.reader
        view[parked] = 1
        # The parked byte before the last look: the writer sees it, or this look sees the data.
        memory_barrier()
        if not ready():
            self._bell.wait(CHECK_S)
        view[parked] = 0

    def close(self) -> None:
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        if getattr(self._mapped, "control", None) is not None:
            self._mapped.close()
