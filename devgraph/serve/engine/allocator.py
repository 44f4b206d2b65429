"""KV-cache bookkeeping on the host: a free list of blocks and the block-table rows of running requests.

Block 0 is the scratch block: padding tokens write their keys and values there, so no request ever owns
it. Blocks are reference-counted: the copies of an ``n > 1`` request share their prompt's blocks
(:meth:`BlockAllocator.share`), and a block goes back to the free list when its last holder frees it. A
shared block is read-only: a copy that must write into one takes a private copy first (copy-on-write, see
the scheduler).
"""

from __future__ import annotations

import array
import ctypes
from collections import deque
from collections.abc import Iterable, Sequence

import torch

from devgraph import ConfigError

__all__ = ["BlockAllocator", "BlockTables", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """Raised by :meth:`BlockAllocator.allocate` when fewer blocks are free than asked for."""


class BlockAllocator:
    """A FIFO free list of the blocks ``1 .. num_blocks - 1``, with a holder count per block in use.

    ``allocate(n)`` takes ``n`` blocks or none (never a partial grant); ``share(blocks)`` adds a holder to
    blocks in use; ``free(blocks)`` drops one holder of each and returns a block to the free list with its
    last holder. Freeing a block more often than it was handed out and shared raises: a leak or double
    free in the scheduler shows up at once instead of as corrupted attention.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ConfigError(f"a KV cache needs at least 2 blocks (block 0 is scratch), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._holders: dict[int, int] = {}

    @property
    def capacity(self) -> int:
        """Blocks requests can own (every block but the scratch block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > len(self._free):
            raise OutOfBlocks(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        self._holders.update(dict.fromkeys(blocks, 1))
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more holder for each of ``blocks`` (all in use)."""
        for block in blocks:
            if block not in self._holders:
                raise RuntimeError(f"KV block {block} shared but not in use (scheduler bug)")
            self._holders[block] += 1

    def holders(self, block: int) -> int:
        """How many requests hold ``block`` (0: free)."""
        return self._holders.get(block, 0)

    def free(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            count = self._holders.get(block)
            if count is None:
                raise RuntimeError(f"KV block {block} freed twice or never allocated (scheduler bug)")
            if count > 1:
                self._holders[block] = count - 1
                continue
            del self._holders[block]
            self._free.append(block)


class BlockTables:
    """The block tables of running requests, one row each, in a host ``int32`` tensor.

    A request gets a row when it starts running and gives it back when it stops; blocks are written
    into the row as they are allocated, so building a step's ``[R, max_blocks]`` table is one gather.
    Row ``max_rows`` stays all zeros: padding requests use it (they point at the scratch block).

    The engine keeps a copy of the table on the device
    (:class:`~devgraph.serve.engine.device_step.DeviceStep`) and sends it only what changed since the
    previous step (:meth:`changes`): the rows given back (zeroed) and the entries written since. A step
    then reads its rows of the device's copy, so its message carries one row index per request instead of
    a whole ``[R, max_blocks]`` table (128 KiB at 256 requests and 2048-token contexts, most of a step's
    bytes), on one device and to every tensor-parallel rank.
    """

    def __init__(self, max_rows: int, width: int) -> None:
        self.width = width
        self.table = torch.zeros((max_rows + 1, width), dtype=torch.int32)
        # The table's memory as Python ints (it never moves: the tensor is never resized or replaced).
        self._ints = _int32_view(self.table)
        self.padding_row = max_rows
        self._free_rows: deque[int] = deque(range(max_rows))
        # Since the last changes(): rows zeroed, then entries written (flat indices; their values are read
        # at changes() time, so the latest write wins); the device's copy starts all zeros, as this one.
        self._cleared: set[int] = set()
        self._written: set[int] = set()
        self._resync = False

    def acquire(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no block-table row free: more running requests than max_running_requests")
        return self._free_rows.popleft()

    def release(self, row: int) -> None:
        self.table[row].zero_()
        self._free_rows.append(row)
        start = row * self.width
        self._written.difference_update(range(start, start + self.width))  # the zeroing supersedes them
        self._cleared.add(row)

    def write(self, row: int, start: int, blocks: Sequence[int]) -> None:
        """Blocks ``start .. start + len(blocks) - 1`` of a request's table."""
        if blocks:
            # Straight into the table's memory: a decode step that crosses a block boundary writes one
            # block per request, where a tensor write costs four torch ops (a tensor, a select, a slice,
            # a copy) each.
            if not 0 <= start <= start + len(blocks) <= self.width:
                raise RuntimeError(
                    f"blocks {start}..{start + len(blocks) - 1} past a table row of {self.width} (bug)"
                )
            at = row * self.width + start
            self._ints[at : at + len(blocks)] = array.array("i", blocks)
            self._written.update(range(at, at + len(blocks)))

    def gather(self, rows: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The ``[len(rows), width]`` tables of these rows (a new tensor); ``rows`` a list or an int64
        tensor (the step's own, so no second one is made)."""
        index = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.int64)
        return self.table.index_select(0, index)

    def changes(self) -> dict[str, torch.Tensor | array.array]:
        """What the device's copy needs to equal this table, since the previous call: ``table_clear``
        (int64 rows to zero), then ``table_at`` / ``table_values`` (int64 flat indices, int32 values to
        write), as ``array.array`` (the step's message takes them without a torch op); or, after
        :meth:`resync`, ``table_all`` (the whole table, a tensor). Empty when nothing changed. Each list
        is as long as a power of two, its last entry repeated (the same row cleared or the same value
        written again: the result is the same): a step's message then has one of a few layouts, whose
        parsing and device views are cached, instead of one per count of changes."""
        if self._resync:
            self._resync = False
            self._cleared.clear()
            self._written.clear()
            return {"table_all": self.table.clone()}
        out: dict[str, torch.Tensor | array.array] = {}
        if self._cleared:
            out["table_clear"] = array.array("q", _bucketed(sorted(self._cleared)))
            self._cleared.clear()
        if self._written:
            at = _bucketed(sorted(self._written))
            self._written.clear()
            ints = self._ints
            out["table_at"] = array.array("q", at)
            out["table_values"] = array.array("i", [ints[i] for i in at])
        return out

    def resync(self) -> None:
        """The next :meth:`changes` sends the whole table: changes already taken may never have reached the
        device (a step that failed after its message was made)."""
        self._resync = True


def _bucketed(values: list[int]) -> list[int]:
    """``values`` padded to a power-of-two length with its last entry."""
    size = 1 << (len(values) - 1).bit_length()
    return values + values[-1:] * (size - len(values))


def _int32_view(table: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU int32 tensor's memory as C ints (no numpy needed)."""
    assert table.dtype == torch.int32 and table.is_contiguous() and table.device.type == "cpu"
    memory = (ctypes.c_int32 * table.numel()).from_address(table.data_ptr())
    return memoryview(memory).cast("B").cast("i")
