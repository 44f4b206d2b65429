"""Shared cases: seeded batches of the reference model whose KV writes never land where another batch
reads, so every step's output is a pure function of its inputs and one eager reference serves all."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from devgraph.reference import ReferenceConfig, ReferenceModel, make_decode_batch, make_prefill_batch
from harness.device import Batch

__all__ = ["KVPlan"]


@dataclass
class _Shape:
    """What the reference batch builders read from a model: its config and device."""

    config: ReferenceConfig
    device: torch.device


class KVPlan:
    """Where seeded batches read and write the paged KV cache.

    Blocks ``1..shared`` hold read-only context (the cache is filled with random values once); the blocks a
    batch writes (the block holding each new token) are moved to private blocks above ``shared``, one set per
    batch. So no step changes what another batch reads, every variant's step is a pure function of its
    inputs, and the eager outputs computed once are the reference for every variant, in any order.
    Batches must be made in the same order in every process to get the same block numbers.
    """

    def __init__(self, base: ReferenceConfig, private_blocks: int) -> None:
        self.shared = base.max_requests * base.max_blocks_per_request
        self.private_blocks = private_blocks
        self._next_private = 1 + self.shared

    def config(self, base: ReferenceConfig) -> ReferenceConfig:
        return dataclasses.replace(base, num_blocks=1 + self.shared + self.private_blocks)

    def decode(self, model: ReferenceModel, batch_size: int, seq_len: int, seed: int) -> Batch:
        return self._isolated(
            model, lambda shape: make_decode_batch(shape, batch_size, seq_lens=seq_len, seed=seed)
        )

    def prefill(
        self, model: ReferenceModel, query_lens: Sequence[int], prefix_lens: Sequence[int] | None, seed: int
    ) -> Batch:
        return self._isolated(
            model,
            lambda shape: make_prefill_batch(shape, list(query_lens), prefix_lens=prefix_lens, seed=seed),
        )

    def _isolated(self, model: ReferenceModel, build: Callable[[ReferenceModel], Batch]) -> Batch:
        shape = _Shape(dataclasses.replace(model.config, num_blocks=1 + self.shared), torch.device("cpu"))
        batch = build(cast(ReferenceModel, shape))
        block = model.config.block_size
        written = torch.unique(batch["slot_mapping"] // block)
        written = written[written != 0]
        if self._next_private + written.numel() > 1 + self.shared + self.private_blocks:
            raise RuntimeError(f"KVPlan: more than {self.private_blocks} private blocks needed; raise it")
        mapping = torch.arange(1 + self.shared, dtype=torch.int64)
        mapping[written] = torch.arange(self._next_private, self._next_private + written.numel())
        self._next_private += written.numel()
        slots = batch["slot_mapping"]
        batch["slot_mapping"] = mapping[slots // block] * block + slots % block
        batch["block_tables"] = mapping[batch["block_tables"].long()].to(torch.int32)
        return {name: t.to(model.device) for name, t in batch.items()}
