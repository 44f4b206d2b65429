"""Sleep mode: hand an idle engine's device memory back (a trainer, another model needs it) and take it
again on wake-up.

Level 1 frees the graphs of both runners and their pools (``GraphRunner.release()``), then the paged KV
cache (its contents are discarded: sleep only when no request is in flight); the weights stay. Wake-up
goes the other way: the KV cache first, at its old size, then the graphs (``GraphRunner.restore()``),
captured on the new cache's addresses, reusing the compiled forward.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.errors import ConfigError

__all__ = ["KvCacheShape", "SLEEP_LEVELS", "allocate_kv_cache", "free_kv_cache"]

logger = logging.getLogger(__name__)

#: Sleep levels offered, and what each frees.
SLEEP_LEVELS = {1: "the graphs (and their pools) and the KV cache; the weights stay"}


@dataclass(frozen=True)
class KvCacheShape:
    """What :func:`free_kv_cache` dropped, to allocate it again."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    layers: int

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return 2 * self.layers * count * self.dtype.itemsize


def check_level(level: Any) -> int:
    if isinstance(level, bool) or not isinstance(level, int) or level not in SLEEP_LEVELS:
        offered = ", ".join(f"{k} ({v})" for k, v in SLEEP_LEVELS.items())
        raise ConfigError(f"sleep level must be one of {offered}; got {level!r}")
    return level


def free_kv_cache(model: Any) -> KvCacheShape:
    """Replace every layer's K and V cache by an empty tensor; returns what to allocate on wake-up."""
    first = model.layers[0].k_cache
    shape = KvCacheShape(tuple(first.shape), first.dtype, first.device, len(model.layers))
    for layer in model.layers:
        layer.k_cache = torch.empty(0, dtype=shape.dtype, device=shape.device)
        layer.v_cache = torch.empty(0, dtype=shape.dtype, device=shape.device)
    return shape


def allocate_kv_cache(model: Any, shape: KvCacheShape) -> float:
    """Allocate every layer's K and V cache again (zeros, as at start-up); returns the seconds it took."""
    start = time.perf_counter()
    for layer in model.layers:
        layer.k_cache = torch.zeros(shape.shape, dtype=shape.dtype, device=shape.device)
        layer.v_cache = torch.zeros(shape.shape, dtype=shape.dtype, device=shape.device)
    return time.perf_counter() - start
