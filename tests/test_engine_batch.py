"""A step's host inputs and the token slots (CPU): the block tables written without torch ops, the decode
batch's int64 columns made in one tensor, and ``pending_slots``, the one-gather path of a decode step whose
every token is pending, which gives the ids the general ``id_slots`` path gives."""

from __future__ import annotations

import pytest
import torch

from devgraph.serve.engine import BlockTables, Request, SamplingParams
from devgraph.serve.engine.batch import decode_batch, prefill_batch
from devgraph.serve.engine.device_step import TokenSlots

pytestmark = [pytest.mark.timeout(60)]


def test_block_table_writes_land_in_the_table_and_stay_in_their_row() -> None:
    tables = BlockTables(3, 5)
    expected = torch.zeros((4, 5), dtype=torch.int32)
    for row, start, blocks in [(0, 0, [7, 8]), (1, 2, [9, 10, 11]), (0, 2, [12]), (2, 4, [2**31 - 1])]:
        tables.write(row, start, blocks)
        expected[row, start : start + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        assert torch.equal(tables.table, expected)
    tables.write(2, 0, [])
    with pytest.raises(RuntimeError, match="past a table row"):
        tables.write(1, 4, [1, 2])  # would run into row 2
    assert torch.equal(tables.table, expected)
    assert torch.equal(tables.gather([1, 3, 0]), expected[[1, 3, 0]])
    assert torch.equal(tables.gather(torch.tensor([2, 2])), expected[[2, 2]])
    tables.release(1)
    expected[1] = 0
    assert torch.equal(tables.table, expected)


def _requests(tables: BlockTables, pending: list[int]) -> list[Request]:
    requests = []
    for i, waiting in enumerate(pending):
        request = Request(f"r{i}", list(range(1, 6 + i)), SamplingParams(), i)
        request.output = [400 + i] * (2 - waiting)
        request.pending, request.num_computed = waiting, len(request.prompt) + 1
        request.row = tables.acquire()
        request.blocks = [3 * i + 1, 3 * i + 2]
        tables.write(request.row, 0, request.blocks)
        requests.append(request)
    return requests


@pytest.mark.parametrize("pad_to", [None, 6])
def test_a_decode_step_whose_every_token_is_pending_names_every_slot(pad_to: int | None) -> None:
    tables = BlockTables(4, 4)
    tables.acquire()  # rows need not be the batch's row numbers
    requests = _requests(tables, [1, 1, 1])
    batch = decode_batch(requests, tables, 16, padding_slot=7, pad_to=pad_to)
    pad = (pad_to or 3) - 3
    rows = [r.row for r in requests]
    assert batch.id_slots is None and batch.pending_slots is not None
    assert batch.pending_slots.tolist() == rows + [tables.padding_row] * pad
    assert batch.rows is not None and batch.rows.tolist() == batch.pending_slots.tolist()
    assert batch.inputs["input_ids"].tolist() == [0] * (3 + pad)
    assert batch.inputs["slot_mapping"].tolist()[3:] == [7] * pad
    assert torch.equal(batch.inputs["block_tables"], tables.table[batch.rows])
    for name in ("input_ids", "positions", "slot_mapping"):
        assert batch.inputs[name].dtype == torch.int64 and batch.inputs[name].is_contiguous()
    # The device's one gather gives what the general path gives (the padding slot is never written: 0).
    slots = TokenSlots(5, torch.device("cpu"))
    slots.write(torch.tensor(rows), torch.tensor([11, 12, 13]))
    general = torch.tensor(rows + [-1] * pad)
    assert torch.equal(slots.pending(batch.pending_slots), slots.ids(batch.inputs["input_ids"], general))


def test_a_decode_step_with_a_known_token_keeps_the_general_path() -> None:
    tables = BlockTables(4, 4)
    batch = decode_batch(_requests(tables, [1, 0, 1]), tables, 16)
    assert batch.pending_slots is None and batch.id_slots is not None
    assert batch.id_slots.tolist() == [0, -1, 2]
    assert decode_batch(_requests(BlockTables(4, 4), [0, 0]), tables, 16).id_slots is None


def test_a_prefill_step_carries_its_rows_and_never_pending_slots() -> None:
    tables = BlockTables(4, 4)
    requests = _requests(tables, [1, 0])
    entries = [(requests[0], requests[0].num_computed, 1, True), (requests[1], 0, 4, False)]
    batch = prefill_batch(entries, tables, 16, pad_requests=3)
    assert batch.pending_slots is None and batch.id_slots is not None
    assert batch.rows is not None and batch.rows.tolist() == [0, 1, tables.padding_row]
    assert torch.equal(batch.inputs["block_tables"], tables.table[[0, 1, tables.padding_row]])
