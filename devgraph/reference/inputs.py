"""Example batches, forward contexts and padding fills for the reference model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from devgraph.errors import ConfigError
from devgraph.reference.model import ReferenceModel

__all__ = [
    "StepContext",
    "make_decode_batch",
    "decode_context",
    "make_prefill_batch",
    "prefill_context",
    "padding_fill",
]


@dataclass
class StepContext:
    """Host-side state of one step, handed to ``GraphRunner.run(context=...)``.

    The attention break op reads ``max_seq_len`` in decode to attend over ``cache[:, :max_seq_len]``
    only; ``seq_lens`` is informational (per-request lengths, as a scheduler would know them).
    """

    max_seq_len: int | None = None
    seq_lens: list[int] | None = None


def make_decode_batch(model: ReferenceModel, batch_size: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A decode batch: ``input_ids``, ``positions`` and ``req_slots``, each ``[batch_size]`` int64.

    Slots are distinct live rows (never the padding slot); positions are uniform in
    ``[1, max_seq_len - 1]``, so every row has some history to attend to.
    """
    config = model.config
    if not 1 <= batch_size <= config.max_requests:
        raise ConfigError(
            f"decode batch_size must be in [1, max_requests={config.max_requests}], got {batch_size}"
        )
    generator = torch.Generator().manual_seed(seed)
    low = min(1, config.max_seq_len - 1)
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (batch_size,), generator=generator),
        "positions": torch.randint(low, config.max_seq_len, (batch_size,), generator=generator),
        "req_slots": torch.randperm(config.max_requests, generator=generator)[:batch_size],
    }
    return {name: t.to(model.device) for name, t in batch.items()}


def decode_context(batch: dict[str, torch.Tensor]) -> StepContext:
    """The forward context of a decode batch: ``max_seq_len`` = largest position + 1.

    Reads the positions on the host (a sync), which is what an engine's scheduler knows anyway.
    """
    seq_lens = (batch["positions"] + 1).tolist()
    return StepContext(max_seq_len=max(seq_lens), seq_lens=seq_lens)


def _check_seq_lens(model: ReferenceModel, seq_lens: Sequence[int]) -> list[int]:
    config = model.config
    lens = list(seq_lens)
    if not 1 <= len(lens) <= config.max_requests:
        raise ConfigError(f"prefill needs 1 to max_requests={config.max_requests} requests, got {len(lens)}")
    bad = [
        n for n in lens if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= config.max_seq_len
    ]
    if bad:
        raise ConfigError(
            f"prefill seq_lens must be ints in [1, max_seq_len={config.max_seq_len}], got {bad}"
        )
    return lens


def make_prefill_batch(
    model: ReferenceModel, seq_lens: Sequence[int], *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A packed prefill batch of ``len(seq_lens)`` new requests, ``[sum(seq_lens)]`` int64 each.

    Request ``r`` occupies a contiguous run of ``seq_lens[r]`` tokens with positions ``0..L-1`` and one
    distinct live slot.
    """
    lens = _check_seq_lens(model, seq_lens)
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    counts = torch.tensor(lens, dtype=torch.int64)
    slots = torch.randperm(config.max_requests, generator=generator)[: len(lens)]
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (sum(lens),), generator=generator),
        "positions": torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]),
        "req_slots": slots.repeat_interleave(counts),
    }
    return {name: t.to(model.device) for name, t in batch.items()}


def prefill_context(seq_lens: Sequence[int]) -> StepContext:
    """The forward context of a prefill batch (the attention op ignores ``max_seq_len`` in prefill)."""
    lens = list(seq_lens)
    return StepContext(max_seq_len=max(lens), seq_lens=lens)


def padding_fill(model: ReferenceModel) -> dict[str, int]:
    """Fill value per input for padded rows: they read and write only the padding slot, at position 0."""
    return {"input_ids": 0, "positions": 0, "req_slots": model.padding_slot}
