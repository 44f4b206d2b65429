"""Turning a scheduled step into the reference model's inputs (host tensors) and host lengths.

A decode step has one token per request (``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``,
``seq_lens``); a prefill step packs chunks (``cu_seqlens_q`` too). A decode token is also a valid chunk:
one token after its cached prefix, which is how mixed steps carry decodes through the prefill runner.

Everything is built on the host: the engine packs a step into one message
(:mod:`~devgraph.serve.engine.wire`) that crosses to the device in one non-blocking copy. A token the
host has not read yet (a *pending* token, sampled by a step the device may still run) gets id 0 here and
its request's token slot in ``id_slots``; the device takes its id from the slot before the forward. In
overlapped decode every token is pending: the step then carries ``pending_slots`` instead (every id comes
from a slot), which the device reads with one gather instead of four ops.

``pad_tokens``/``pad_requests`` pad the step to a fixed shape here, before the runner sees it (the
engine's deterministic mode): padding tokens write only the scratch slot, padding requests have length 0
and point at the all-zero table row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from devgraph.reference.inputs import StepContext
from devgraph.serve.engine.allocator import BlockTables
from devgraph.serve.engine.request import Request

__all__ = ["StepBatch", "decode_batch", "prefill_batch"]


@dataclass
class StepBatch:
    """A step's runner inputs; row ``r`` of the logits belongs to ``requests[r]`` and is sampled when
    ``samples[r]``; its tokens are positions ``starts[r] ..`` (``lengths[r]`` of them), packed in request
    order. ``engine_padding``: tokens added here (not by the runner)."""

    inputs: dict[str, Any]  # tensors; Any so they unpack into GraphRunner.run(**inputs)
    context: StepContext
    requests: list[Request]
    samples: list[bool]
    lengths: list[int]
    engine_padding: int = 0
    starts: list[int] = field(default_factory=list)
    #: Per token (padding included): the token slot its id comes from on the device, -1 where the id is
    #: in ``input_ids``; ``None`` when every id is known, or every real one is pending (``pending_slots``).
    id_slots: torch.Tensor | None = None
    #: Per request row (padding included, as the padding row): its block-table row, int64; the row is also
    #: the request's token slot.
    rows: torch.Tensor | None = None
    #: A decode step whose every real token is pending: each token's slot (``rows``; a padding token reads
    #: the padding row's slot, which no request owns and which stays 0, the id ``input_ids`` gives it).
    #: ``None`` otherwise (``id_slots`` tells which ids come from slots).
    pending_slots: torch.Tensor | None = None


def _row(request: Request) -> int:
    if request.row is None:
        raise RuntimeError(f"request {request.request_id} is scheduled without a block-table row (bug)")
    return request.row


def _slots(request: Request, start: int, length: int, block_size: int) -> list[int]:
    """Cache slots of positions ``start .. start + length - 1``: whole runs per block, not per token."""
    slots: list[int] = []
    position, stop = start, start + length
    while position < stop:
        block, offset = divmod(position, block_size)
        run = min(block_size - offset, stop - position)
        base = request.blocks[block] * block_size + offset
        slots.extend(range(base, base + run))
        position += run
    return slots


def _ids(request: Request, start: int, length: int, ids: list[int], from_slots: list[int]) -> bool:
    """Append the ids of tokens ``start .. start + length - 1`` (0 for a pending one) and where each
    comes from (-1: the id; else the request's token slot); True if any is pending."""
    known = min(length, max(0, request.num_known - start))
    ids.extend(request.tokens_from(start, known))
    from_slots.extend([-1] * known)
    if known == length:
        return False
    ids.extend([0] * (length - known))
    from_slots.extend([_row(request)] * (length - known))
    return True


def _id_slots(from_slots: list[int], pending: bool, pad: int) -> torch.Tensor | None:
    return torch.tensor(from_slots + [-1] * pad, dtype=torch.int64) if pending else None


def decode_batch(
    requests: Sequence[Request],
    tables: BlockTables,
    block_size: int,
    *,
    padding_slot: int = 0,
    pad_to: int | None = None,
    gather_tables: bool = True,
) -> StepBatch:
    """One token per request. ``gather_tables=False``: no ``block_tables`` input (the device gathers the
    step's rows, ``rows``, from its own copy of the tables)."""
    ids: list[int] = []
    from_slots: list[int] = []
    positions, slots, lens = [], [], []
    rows: list[int] = []
    pending = some_known = False
    for request in requests:  # one token each: _ids and _slots for one position, inlined (the hot loop)
        position = request.num_computed
        row = _row(request)
        known = len(request.prompt) + len(request.output)
        if position < known:
            ids.append(request.token_at(position))
            from_slots.append(-1)
            some_known = True
        else:
            ids.append(0)
            from_slots.append(row)
            pending = True
        block, offset = divmod(position, block_size)
        positions.append(position)
        slots.append(request.blocks[block] * block_size + offset)
        lens.append(position + 1)
        rows.append(row)
    pad = max(0, (pad_to or 0) - len(requests))
    # The int64 columns in one tensor (one creation instead of four; each column is a contiguous view).
    input_ids, positions_t, slot_mapping, rows_t = torch.tensor(
        [
            ids + [0] * pad,
            positions + [0] * pad,
            slots + [padding_slot] * pad,
            rows + [tables.padding_row] * pad,
        ],
        dtype=torch.int64,
    ).unbind(0)
    tensors = {
        "input_ids": input_ids,
        "positions": positions_t,
        "slot_mapping": slot_mapping,
        "seq_lens": torch.tensor(lens + [0] * pad, dtype=torch.int32),
    }
    if gather_tables:
        tensors["block_tables"] = tables.gather(rows_t)
    count = len(requests)
    # Overlapped decode: every token pending, every id from its request's slot, which is its row.
    every_pending = pending and not some_known
    return StepBatch(
        tensors,
        StepContext(seq_lens=lens),
        list(requests),
        [True] * count,
        [1] * count,
        pad,
        positions,
        None if every_pending else _id_slots(from_slots, pending, pad),
        rows_t,
        rows_t if every_pending else None,
    )


def prefill_batch(
    entries: Sequence[tuple[Request, int, int, bool]],
    tables: BlockTables,
    block_size: int,
    *,
    padding_slot: int = 0,
    pad_tokens: int | None = None,
    pad_requests: int | None = None,
    gather_tables: bool = True,
) -> StepBatch:
    """``entries``: ``(request, start, length, samples)`` per request, decodes as 1-token chunks.
    ``gather_tables``: as for :func:`decode_batch`."""
    ids: list[int] = []
    from_slots: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    lens, cu = [], [0]
    rows: list[int] = []
    pending = False
    for request, start, length, _ in entries:
        pending |= _ids(request, start, length, ids, from_slots)
        positions.extend(range(start, start + length))
        slots.extend(_slots(request, start, length, block_size))
        lens.append(start + length)
        rows.append(_row(request))
        cu.append(cu[-1] + length)
    token_pad = max(0, (pad_tokens or 0) - len(ids))
    request_pad = max(0, (pad_requests or 0) - len(entries))
    rows_t = torch.tensor(rows + [tables.padding_row] * request_pad, dtype=torch.int64)
    tensors = {
        "input_ids": torch.tensor(ids + [0] * token_pad, dtype=torch.int64),
        "positions": torch.tensor(positions + [0] * token_pad, dtype=torch.int64),
        "slot_mapping": torch.tensor(slots + [padding_slot] * token_pad, dtype=torch.int64),
        "seq_lens": torch.tensor(lens + [0] * request_pad, dtype=torch.int32),
        "cu_seqlens_q": torch.tensor(cu + [cu[-1]] * request_pad, dtype=torch.int32),
    }
    if gather_tables:
        tensors["block_tables"] = tables.gather(rows_t)
    return StepBatch(
        tensors,
        StepContext(seq_lens=lens, cu_seqlens_q=cu),
        [e[0] for e in entries],
        [e[3] for e in entries],
        [e[2] for e in entries],
        token_pad,
        [e[1] for e in entries],
        _id_slots(from_slots, pending, token_pad),
        rows_t,
    )
