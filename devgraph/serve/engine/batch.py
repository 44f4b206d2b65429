"""Turning a scheduled step into the reference model's inputs (device tensors) and host lengths.

A decode step has one token per request (``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``,
``seq_lens``); a prefill step packs chunks (``cu_seqlens_q`` too). A decode token is also a valid chunk:
one token after its cached prefix, which is how mixed steps carry decodes through the prefill runner.

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


def decode_batch(
    requests: Sequence[Request],
    tables: BlockTables,
    block_size: int,
    device: torch.device,
    *,
    padding_slot: int = 0,
    pad_to: int | None = None,
) -> StepBatch:
    ids, positions, slots, lens = [], [], [], []
    rows: list[int] = []
    for request in requests:
        position = request.num_computed
        ids.append(request.token_at(position))
        positions.append(position)
        slots.append(_slots(request, position, 1, block_size)[0])
        lens.append(position + 1)
        rows.append(_row(request))
    pad = max(0, (pad_to or 0) - len(requests))
    inputs = {
        "input_ids": ids + [0] * pad,
        "positions": positions + [0] * pad,
        "slot_mapping": slots + [padding_slot] * pad,
    }
    tensors = {name: torch.tensor(v, dtype=torch.int64).to(device) for name, v in inputs.items()}
    tensors["block_tables"] = tables.gather(rows + [tables.padding_row] * pad).to(device)
    tensors["seq_lens"] = torch.tensor(lens + [0] * pad, dtype=torch.int32).to(device)
    count = len(requests)
    return StepBatch(
        tensors, StepContext(seq_lens=lens), list(requests), [True] * count, [1] * count, pad, positions
    )


def prefill_batch(
    entries: Sequence[tuple[Request, int, int, bool]],
    tables: BlockTables,
    block_size: int,
    device: torch.device,
    *,
    padding_slot: int = 0,
    pad_tokens: int | None = None,
    pad_requests: int | None = None,
) -> StepBatch:
    """``entries``: ``(request, start, length, samples)`` per request, decodes as 1-token chunks."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    lens, cu = [], [0]
    rows: list[int] = []
    for request, start, length, _ in entries:
        ids.extend(request.tokens_from(start, length))
        positions.extend(range(start, start + length))
        slots.extend(_slots(request, start, length, block_size))
        lens.append(start + length)
        rows.append(_row(request))
        cu.append(cu[-1] + length)
    token_pad = max(0, (pad_tokens or 0) - len(ids))
    request_pad = max(0, (pad_requests or 0) - len(entries))
    tensors = {
        "input_ids": torch.tensor(ids + [0] * token_pad, dtype=torch.int64).to(device),
        "positions": torch.tensor(positions + [0] * token_pad, dtype=torch.int64).to(device),
        "slot_mapping": torch.tensor(slots + [padding_slot] * token_pad, dtype=torch.int64).to(device),
        "block_tables": tables.gather(rows + [tables.padding_row] * request_pad).to(device),
        "seq_lens": torch.tensor(lens + [0] * request_pad, dtype=torch.int32).to(device),
        "cu_seqlens_q": torch.tensor(cu + [cu[-1]] * request_pad, dtype=torch.int32).to(device),
    }
    return StepBatch(
        tensors,
        StepContext(seq_lens=lens, cu_seqlens_q=cu),
        [e[0] for e in entries],
        [e[3] for e in entries],
        [e[2] for e in entries],
        token_pad,
        [e[1] for e in entries],
    )
