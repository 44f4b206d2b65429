"""Continuous batching: which requests run in the next step, and how many tokens of each.

Every step the scheduler, in this order:

1. gives each running request that is decoding (one token left to compute) its token, taking a new
   KV block when its sequence crosses a block boundary; when no block is free it preempts the newest
   running request (frees its blocks and puts it back at the head of the queue: its prompt and output so
   far are recomputed when it is readmitted), possibly the request itself;
2. continues running requests that are still filling their prompt, oldest first, with chunks cut to the
   step's token budget and to the blocks that are free (no preemption for a prefill chunk);
3. admits waiting requests first come, first served, while fewer than ``max_running`` run, budget is
   left and the first chunk's blocks are free; the head of the queue blocks the rest (no overtaking).
   A request with ``n`` copies is admitted only where all ``n`` fit the running batch, beside the copies
   that running requests will start (their seats are taken at admission): it computes the prompt once,
   and :meth:`Scheduler.fork` then hands its copies its KV blocks (shared, not copied).

A block that several requests hold (a prompt's blocks after a fork) is read-only: a request about to
write into one gets a private copy first (copy-on-write): the schedule lists the ``(source, copy)`` block
pairs, which the engine copies on the device before the step's forward.

In ``mixed`` mode decode tokens count against the token budget (they share one forward with the
chunks); otherwise decodes run in a step of their own and the budget applies to chunks only.

Under the overlapped scheduler (see :mod:`~devgraph.serve.engine.engine`) a step is scheduled while the
previous one still runs: a decoding request's next input token is then *pending* (sampled on the device,
not read yet), which the step takes from the device's token slots. Three rules keep that exact: a request
whose issued steps already sample every token ``max_tokens`` allows gets no further step (it finishes
when they are read); a request that has pending tokens is not admitted from the queue (a preempted one
recomputes from token ids the host must know: it waits one step); and the last-resort preemption of a
mid-prompt request happens only when every running request is mid-prompt (one whose step is still to be
read frees its blocks once read).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from devgraph.serve.engine.allocator import BlockAllocator, BlockTables
from devgraph.serve.engine.request import Request, Status

__all__ = ["Chunk", "Schedule", "Scheduler"]


@dataclass(frozen=True)
class Chunk:
    """Tokens ``start .. start + length - 1`` of ``request``; ``samples``: the step's logits for its last
    token give the request's next token (the chunk reaches the end of the known tokens)."""

    request: Request
    start: int
    length: int
    samples: bool


@dataclass
class Schedule:
    """One step's work: decode requests (one token each) and prefill chunks; requests preempted on the way."""

    decodes: list[Request] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    #: ``(source, copy)`` KV blocks to copy before the forward (copy-on-write of shared blocks).
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.chunks


class Scheduler:
    """FCFS admission, chunked prefill under a token budget, preemption by recomputation."""

    def __init__(
        self,
        allocator: BlockAllocator,
        tables: BlockTables,
        *,
        block_size: int,
        max_running: int,
        token_budget: int,
        mixed: bool,
    ) -> None:
        self.allocator = allocator
        self.tables = tables
        self.block_size = block_size
        self.max_running = max_running
        self.token_budget = token_budget
        self.mixed = mixed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.preemptions = 0

    # -- queue ---------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out (finished or aborted) and free its blocks and table row."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is Status.WAITING and request in self.waiting:  # (a copy not forked is not)
            self.waiting.remove(request)
        request.status = Status.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _seats(self) -> int:
        """Table rows the running requests hold or will hold: a request still filling its prompt holds one
        for each copy of it that :meth:`fork` starts once the prompt is computed."""
        return sum(1 + len(request.copies) for request in self.running)

    # -- blocks --------------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _grow(self, request: Request, tokens: int, schedule: Schedule) -> bool:
        """Give ``request`` blocks for its first ``tokens`` positions, private ones from its first
        uncomputed position on (copy-on-write of shared blocks); False when not enough are free."""
        first = request.num_computed // self.block_size
        shared = [
            i for i in range(first, min(len(request.blocks), self.blocks_for(tokens)))
            if self.allocator.holders(request.blocks[i]) > 1
        ]  # fmt: skip
        extra = max(0, self.blocks_for(tokens) - len(request.blocks))
        if extra + len(shared) > self.allocator.num_free:
            return False
        assert request.row is not None
        for i in shared:
            (private,) = self.allocator.allocate(1)
            schedule.copies.append((request.blocks[i], private))
            self.allocator.free([request.blocks[i]])
            request.blocks[i] = private
            self.tables.write(request.row, i, [private])
        if extra:
            new = self.allocator.allocate(extra)
            self.tables.write(request.row, len(request.blocks), new)
            request.blocks.extend(new)
        return True

    def fork(self, request: Request) -> list[Request]:
        """Start ``request``'s waiting copies (its prompt computed): each takes a table row and shares its
        KV blocks, at the same computed position. Returns the copies, now running."""
        copies, request.copies = request.copies, []
        for copy in copies:
            copy.row = self.tables.acquire()
            self.allocator.share(request.blocks)
            copy.blocks = list(request.blocks)
            self.tables.write(copy.row, 0, copy.blocks)
            copy.num_computed = request.num_computed
            copy.scheduled_time = request.scheduled_time
            copy.status = Status.RUNNING
            self.running.append(copy)
        return copies

    def _release(self, request: Request) -> None:
        self.allocator.free(request.blocks)
        request.blocks = []
        if request.row is not None:
            self.tables.release(request.row)
            request.row = None

    def _preempt(self, victim: Request, schedule: Schedule) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.num_computed = 0
        victim.preemptions += 1
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        schedule.preempted.append(victim)
        self.preemptions += 1

    # -- the step ------------------------------------------------------------------------------------
    def schedule(self) -> Schedule:
        schedule = Schedule()
        budget = self.token_budget
        for request in [r for r in self.running if r.remaining == 1 and not r.sampled_enough]:
            if request.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            while not self._grow(request, request.num_tokens, schedule):
                victim = self.running[-1]
                self._preempt(victim, schedule)
                if victim is request:
                    break
            if request.status is Status.RUNNING:
                schedule.decodes.append(request)
                budget -= 1 if self.mixed else 0
        for request in self.running:
            if request.remaining > 1 and budget > 0:
                budget -= self._add_chunk(request, budget, schedule)
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if request.pending:  # preempted while its last token was on the device: admit it once read
                break
            if self._seats() + 1 + len(request.copies) > self.max_running:
                break
            if self.allocator.num_free < 1:
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            request.row = self.tables.acquire()
            self.running.append(request)
            taken = self._add_chunk(request, budget, schedule)
            if not taken:  # not even one block's worth: undo and wait for blocks
                self.running.remove(request)
                self._release(request)
                request.status = Status.WAITING
                self.waiting.appendleft(request)
                break
            budget -= taken
        if schedule.empty and self.running and all(r.remaining > 1 for r in self.running):
            # Every running request is mid-prompt and no block is free: recompute the newest later. (A
            # request whose last step is still to be read frees its blocks once read: no preemption.)
            self._preempt(self.running[-1], schedule)
            return self._merge(schedule, self.schedule())
        return schedule

    def _add_chunk(self, request: Request, budget: int, schedule: Schedule) -> int:
        """Schedule the largest chunk of ``request``'s remaining tokens that fits ``budget`` and the free
        blocks; returns its length (0: nothing fits)."""
        start = request.num_computed
        length = min(request.remaining, budget)
        room = (len(request.blocks) + self.allocator.num_free) * self.block_size - start
        length = min(length, room)
        if length <= 0 or not self._grow(request, start + length, schedule):
            return 0
        schedule.chunks.append(Chunk(request, start, length, start + length == request.num_tokens))
        return length

    @staticmethod
    def _merge(first: Schedule, second: Schedule) -> Schedule:
        second.preempted[:0] = first.preempted
        second.copies[:0] = first.copies
        return second
