"""The part of a step every rank runs on its device, from the step's message.

A step crosses to the device as one message (:mod:`~devgraph.serve.engine.wire`: one buffer, one
non-blocking copy from pinned memory): the forward's inputs, the step's host lengths and the few arrays
of the work around the forward, named in :data:`STEP_ARRAYS`. :meth:`DeviceStep.forward`:

1. brings its copy of the engine's block tables up to date (the step carries only what changed since
   the previous one) and takes the step's rows of it (``table_rows``): the forward's ``block_tables``;
2. copies the KV blocks the scheduler gave private copies of (``copy_from`` -> ``copy_to``,
   copy-on-write of blocks ``n > 1`` copies share);
3. takes the ids of pending tokens from the token slots (``id_slots``: a token the previous step sampled,
   which the host has not read yet; ``pending_slots`` when every token is pending, as in overlapped
   decode: one gather instead of four ops). Under tensor parallelism rank 0 holds the slots and
   broadcasts the step's ids to the other ranks: one small collective, queued on the device like the
   forward's own, so no rank's host waits for it;
4. runs the forward through the decode or the prefill runner.

The step's ids and its rows of the block tables are written straight into the runner's static input
rows (:meth:`~devgraph.runner.graph_runner.GraphRunner.static_rows`), so the runner copies neither.
Rank 0's engine then samples on the device and writes each sampled token into its request's slot
(``TokenSlots.tokens``), where the next step's ids come from: the host reads the tokens a step later.
Everything is issued on one stream, in step order: a KV block or a slot that the host hands to another
request after step N was issued is written by later work only, which the device runs after step N.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from devgraph import GraphRunner
from devgraph.reference.inputs import StepContext
from devgraph.reference.model import ReferenceModel

__all__ = ["STEP_ARRAYS", "DeviceStep", "StepResult", "TokenSlots"]

#: What a step's forward returns: the sampled rows' logits, and (prefill) every token's hidden state.
StepResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

#: Arrays a step's message carries besides the forward's inputs (and the sampler's arrays, rank 0 only):
#: copy-on-write blocks, where pending ids come from (``id_slots``, or ``pending_slots`` when every id
#: does), the logits rows sampled (a row of a request whose ``n`` copies fork repeats; absent when the
#: leading rows sample, one token each) and the slot each sampled token goes to, and the rows and targets
#: of prompt tokens scored for their log probabilities. The block tables come as changes to the device's
#: copy (``table_all``, or ``table_clear`` rows then ``table_at`` / ``table_values`` entries, see
#: :meth:`~devgraph.serve.engine.allocator.BlockTables.changes`) and the step's rows of it (``table_rows``).
STEP_ARRAYS = (
    "copy_from",
    "copy_to",
    "table_all",
    "table_clear",
    "table_at",
    "table_values",
    "table_rows",
    "id_slots",
    "pending_slots",
    "sample_rows",
    "sample_slots",
    "score_rows",
    "score_targets",
)


class TokenSlots:
    """The last token sampled for each running request, on the device, at the request's block-table row
    (a running request holds its row for as long as it runs, and no two running requests share one).
    The last slot is the padding row's, which no request holds: it is never written and stays 0."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.tokens = torch.zeros(count, dtype=torch.int64, device=device)

    def write(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self.tokens.index_copy_(0, slots, tokens)

    def ids(
        self, input_ids: torch.Tensor, id_slots: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``input_ids`` with each token whose ``id_slots`` entry is a slot (not -1) taken from it (into
        ``out`` when given)."""
        pending = self.tokens.index_select(0, id_slots.clamp(min=0))
        if out is None:
            return torch.where(id_slots >= 0, pending, input_ids)
        return torch.where(id_slots >= 0, pending, input_ids, out=out)

    def pending(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's id from its slot (a padding token's from the padding slot: 0, as in its input),
        into ``out`` when given."""
        if out is None:
            return self.tokens.index_select(0, slots)
        return torch.index_select(self.tokens, 0, slots, out=out)


class DeviceStep:
    """A step's device work up to the logits (see the module docstring), on every rank alike.

    ``group``: the tensor-parallel process group (``None`` on one device); ``slots``: how many token
    slots (the running requests' block-table rows)."""

    def __init__(
        self,
        model: ReferenceModel,
        decode_runner: GraphRunner,
        prefill_runner: GraphRunner,
        *,
        slots: int,
        table_width: int | None = None,
        group: Any = None,
    ) -> None:
        """``table_width``: the block tables' width (``slots`` rows, the last the all-zero padding row);
        ``None`` when every step carries its ``block_tables`` itself."""
        self.model = model
        self.decode_runner = decode_runner
        self.prefill_runner = prefill_runner
        self.slots = TokenSlots(slots, model.device)
        #: The device's copy of the engine's block tables (changed by each step's message, read by rows).
        self.tables = (
            torch.zeros((slots, table_width), dtype=torch.int32, device=model.device)
            if table_width is not None
            else None
        )
        self._flat_tables = self.tables.view(-1) if self.tables is not None else None
        self.group = group if group is not None and torch.distributed.get_world_size(group) > 1 else None
        self.source = 0 if self.group is None else torch.distributed.get_global_rank(self.group, 0)
        self.leader = self.group is None or torch.distributed.get_rank(self.group) == 0

    def runner(self, kind: str) -> GraphRunner:
        return self.decode_runner if kind == "decode" else self.prefill_runner

    def forward(self, kind: str, arrays: Mapping[str, torch.Tensor], context: StepContext) -> StepResult:
        """``arrays``: the message's tensors on the device (the forward's inputs and :data:`STEP_ARRAYS`)."""
        runner = self.runner(kind)
        rows = arrays.get("table_rows")
        if rows is not None:
            out = runner.static_rows("block_tables", rows.shape[0])
            arrays = {**arrays, "block_tables": self._tables(arrays, rows, out)}
        inputs: dict[str, Any] = {name: arrays[name] for name in runner.input_specs}
        copy_from = arrays.get("copy_from")
        if copy_from is not None:
            self.copy_blocks(copy_from, arrays["copy_to"])
        id_slots = arrays.get("id_slots")
        pending_slots = arrays.get("pending_slots")
        if id_slots is not None or pending_slots is not None:
            ids = inputs["input_ids"]
            out = runner.static_rows("input_ids", ids.shape[0])
            if id_slots is not None:
                ids = self._ids(ids, id_slots, out=out)
            if pending_slots is not None:
                ids = self._ids(ids, pending_slots, every=True, out=out)
            inputs["input_ids"] = ids
        return runner.run(context=context, **inputs)  # type: ignore[no-any-return]

    def _tables(
        self, arrays: Mapping[str, torch.Tensor], rows: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Apply the step's changes to the device's copy of the block tables, then its rows of it (into
        ``out``, the runner's static rows, when given: the runner then copies nothing)."""
        tables, flat = self.tables, self._flat_tables
        if tables is None or flat is None:
            raise RuntimeError("a step sent table rows to a DeviceStep built without table_width (bug)")
        whole = arrays.get("table_all")
        if whole is not None:
            tables.copy_(whole)
        cleared = arrays.get("table_clear")
        if cleared is not None:
            tables.index_fill_(0, cleared, 0)
        at = arrays.get("table_at")
        if at is not None:  # an index repeats only with its own value (padding): the order cannot matter
            flat.index_copy_(0, at, arrays["table_values"])
        if out is None or out.shape[1:] != tables.shape[1:]:
            return tables.index_select(0, rows)
        return torch.index_select(tables, 0, rows, out=out)

    def copy_blocks(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy-on-write: fill the private copies the scheduler gave requests of shared KV blocks."""
        with torch.no_grad():
            for cache in (*self.model.k_cache, *self.model.v_cache):
                cache.index_copy_(0, targets, cache.index_select(0, sources))

    def _ids(
        self,
        input_ids: torch.Tensor,
        slots: torch.Tensor,
        *,
        every: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's ids: from ``slots`` where pending (``every``: ``slots`` names one for every token);
        into ``out`` (the runner's static rows) when given, so the runner copies nothing."""
        if not self.leader:  # the broadcast below writes every id: no need to copy the message's in
            ids = input_ids.clone() if out is None else out
        elif every:
            ids = self.slots.pending(slots, out=out)
        else:
            ids = self.slots.ids(input_ids, slots, out=out)
        if self.group is not None:  # rank 0 holds the slots: every rank gets the step's ids from it
            torch.distributed.broadcast(ids, src=self.source, group=self.group)
        return ids
