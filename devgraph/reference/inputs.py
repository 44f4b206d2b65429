"""Example batches, forward contexts and static inputs for the reference model's steps.

Batches place every request in blocks of its own (drawn at random from blocks 1..N-1; block 0 is the
scratch block), so a test can tell exactly which cache slots a step may write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from devgraph import REQUESTS, ConfigError, StaticInput
from devgraph.contract.inputs import Fill
from devgraph.reference.model import ReferenceModel

__all__ = [
    "StepContext",
    "make_decode_batch",
    "make_prefill_batch",
    "make_verify_batch",
    "batch_context",
    "decode_context",
    "prefill_context",
    "padding_fill",
    "reference_inputs",
]


@dataclass
class StepContext:
    """Host-side lengths of one step, handed to ``GraphRunner.run(context=...)``.

    The ``sdpa`` attention break op sizes its work from them (``seq_lens``: kv length of each real
    request; ``cu_seqlens_q``: cumulative query lengths of a packed step). The ``paged`` attention reads
    the same values from device tensors and ignores the context.
    """

    seq_lens: list[int] | None = None
    cu_seqlens_q: list[int] | None = None


def _tables(model: ReferenceModel, seq_lens: list[int], generator: torch.Generator) -> torch.Tensor:
    """``[R, max_blocks]`` int32 block tables: each request gets distinct blocks, the rest of its row 0."""
    config = model.config
    width = config.max_blocks_per_request
    needed = [-(-n // config.block_size) for n in seq_lens]
    free = torch.randperm(config.total_blocks - 1, generator=generator) + 1  # never the scratch block 0
    if sum(needed) > free.numel():
        raise ConfigError(f"the batch needs {sum(needed)} KV blocks but the cache has {free.numel()}")
    tables = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    start = 0
    for r, count in enumerate(needed):
        tables[r, :count] = free[start : start + count].int()
        start += count
    return tables


def _slots(
    tables: torch.Tensor, request: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    blocks = tables[request, positions // block_size].long()
    return blocks * block_size + positions % block_size


def _check_lens(model: ReferenceModel, lens: Sequence[int], what: str) -> list[int]:
    config = model.config
    values = list(lens)
    bad = [
        n for n in values if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= config.max_seq_len
    ]
    if not values or bad:
        raise ConfigError(
            f"{what} must be ints in [1, max_seq_len={config.max_seq_len}], got {bad or values}"
        )
    return values


def make_decode_batch(
    model: ReferenceModel, batch_size: int, *, seq_lens: Sequence[int] | int | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A decode batch of ``batch_size`` requests, one new token each.

    ``seq_lens``: each request's kv length including the new token (an int for all, a list, or ``None``
    for uniform random lengths in ``[1, max_seq_len]``).
    """
    config = model.config
    if not isinstance(batch_size, int) or not 1 <= batch_size <= config.max_requests:
        raise ConfigError(
            f"decode batch_size must be in [1, max_requests={config.max_requests}], got {batch_size}"
        )
    generator = torch.Generator().manual_seed(seed)
    if seq_lens is None:
        lens = torch.randint(1, config.max_seq_len + 1, (batch_size,), generator=generator).tolist()
    elif isinstance(seq_lens, int):
        lens = [seq_lens] * batch_size
    else:
        lens = list(seq_lens)
    lens = _check_lens(model, lens, "decode seq_lens")
    if len(lens) != batch_size:
        raise ConfigError(f"decode seq_lens has {len(lens)} entries for a batch of {batch_size}")
    tables = _tables(model, lens, generator)
    positions = torch.tensor(lens, dtype=torch.int64) - 1
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (batch_size,), generator=generator),
        "positions": positions,
        "slot_mapping": _slots(tables, torch.arange(batch_size), positions, config.block_size),
        "block_tables": tables,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
    }
    return {name: t.to(model.device) for name, t in batch.items()}


def make_prefill_batch(
    model: ReferenceModel,
    query_lens: Sequence[int],
    *,
    prefix_lens: Sequence[int] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A packed prefill batch: request ``r`` brings ``query_lens[r]`` new tokens after a cached prefix of
    ``prefix_lens[r]`` (default 0: a fresh prompt; > 0: a later chunk of a chunked prefill)."""
    config = model.config
    queries = _check_lens(model, query_lens, "prefill query_lens")
    prefixes = list(prefix_lens) if prefix_lens is not None else [0] * len(queries)
    if len(prefixes) != len(queries) or any(p < 0 for p in prefixes):
        raise ConfigError(f"prefix_lens must give one length >= 0 per request, got {prefixes}")
    if len(queries) > config.max_requests:
        raise ConfigError(f"prefill has {len(queries)} requests; the model takes up to {config.max_requests}")
    lens = _check_lens(
        model, [p + q for p, q in zip(prefixes, queries, strict=True)], "prefix + query lengths"
    )
    generator = torch.Generator().manual_seed(seed)
    tables = _tables(model, lens, generator)
    request = torch.cat([torch.full((q,), r, dtype=torch.int64) for r, q in enumerate(queries)])
    positions = torch.cat(
        [torch.arange(p, p + q, dtype=torch.int64) for p, q in zip(prefixes, queries, strict=True)]
    )
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (sum(queries),), generator=generator),
        "positions": positions,
        "slot_mapping": _slots(tables, request, positions, config.block_size),
        "block_tables": tables,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "cu_seqlens_q": cu,
    }
    return {name: t.to(model.device) for name, t in batch.items()}


def make_verify_batch(
    model: ReferenceModel, batch_size: int, tokens_per_request: int, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A speculative-decoding verify batch: ``tokens_per_request`` (1 + k) tokens per request after a
    random cached prefix."""
    generator = torch.Generator().manual_seed(seed + 7919)
    room = model.config.max_seq_len - tokens_per_request
    if room < 0:
        raise ConfigError(
            f"tokens_per_request={tokens_per_request} exceeds max_seq_len={model.config.max_seq_len}"
        )
    prefixes = torch.randint(0, room + 1, (batch_size,), generator=generator).tolist()
    return make_prefill_batch(model, [tokens_per_request] * batch_size, prefix_lens=prefixes, seed=seed)


def batch_context(batch: dict[str, torch.Tensor]) -> StepContext:
    """The host lengths of a batch, as a scheduler knows them (read here from the tensors: a sync)."""
    cu = batch.get("cu_seqlens_q")
    return StepContext(
        seq_lens=[int(n) for n in batch["seq_lens"].tolist()],
        cu_seqlens_q=[int(n) for n in cu.tolist()] if cu is not None else None,
    )


decode_context = batch_context
prefill_context = batch_context


def padding_fill(model: ReferenceModel) -> dict[str, Fill]:
    """Fill per input for padding rows: tokens write only the scratch slot; padded requests have length 0."""
    return {
        "input_ids": 0,
        "positions": 0,
        "slot_mapping": model.padding_slot,
        "block_tables": 0,
        "seq_lens": 0,
        "cu_seqlens_q": "edge",
    }


def reference_inputs(model: ReferenceModel, phase: str = "decode") -> dict[str, StaticInput]:
    """The static inputs of a step: tokens-axis ids, positions and slots; requests-axis tables and
    lengths; for packed phases (prefill, verify) ``cu_seqlens_q`` with one extra row."""
    fill = padding_fill(model)
    inputs = {
        "input_ids": StaticInput(torch.int64, fill=fill["input_ids"]),
        "positions": StaticInput(torch.int64, fill=fill["positions"]),
        "slot_mapping": StaticInput(torch.int64, fill=fill["slot_mapping"]),
        "block_tables": StaticInput(
            torch.int32, (model.config.max_blocks_per_request,), fill=fill["block_tables"], axis=REQUESTS
        ),
        "seq_lens": StaticInput(torch.int32, fill=fill["seq_lens"], axis=REQUESTS),
    }
    if phase != "decode":
        inputs["cu_seqlens_q"] = StaticInput(torch.int32, fill="edge", axis=REQUESTS, extra_rows=1)
    return inputs
