"""Sleep mode: hand an idle engine's device memory back (a trainer, another model needs it) and take it
again on wake-up; and the KV cache's allocation, which sleep and ``--gpu-memory-utilization`` share.

Level 1 frees the graphs of both runners and their pools (``GraphRunner.release()``), then the paged KV
cache (its contents are discarded: sleep only when no request is in flight); the weights stay. Wake-up
goes the other way: the KV cache first, at its old size, then the graphs (``GraphRunner.restore()``),
captured on the new cache's addresses, reusing the compiled forward.

:class:`SleepMode` is the one owner of whether the engine sleeps and of what it freed; the engine asks it
and says when it is busy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from devgraph import ConfigError, GraphRunner
from devgraph.reference.model import ReferenceModel

__all__ = [
    "SLEEP_LEVELS",
    "KvCacheShape",
    "SleepMode",
    "allocate_kv_cache",
    "free_kv_cache",
    "kv_cache_shape",
]

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


def kv_cache_shape(model: ReferenceModel) -> KvCacheShape:
    """The KV cache ``model``'s config describes (every layer's K and V: ``total_blocks`` blocks)."""
    config = model.config
    return KvCacheShape(
        (config.total_blocks, config.block_size, config.num_kv_heads, config.head_dim),
        config.dtype,
        model.device,
        config.num_layers,
    )


def free_kv_cache(model: ReferenceModel) -> KvCacheShape:
    """Replace every layer's K and V cache by an empty tensor; returns what to allocate on wake-up."""
    first = model.k_cache[0]
    shape = KvCacheShape(tuple(first.shape), first.dtype, first.device, len(model.layers))
    for layer in model.layers:
        layer.k_cache = torch.empty(0, dtype=shape.dtype, device=shape.device)
        layer.v_cache = torch.empty(0, dtype=shape.dtype, device=shape.device)
    return shape


def allocate_kv_cache(model: ReferenceModel, shape: KvCacheShape) -> float:
    """Allocate every layer's K and V cache again (zeros, as at start-up); returns the seconds it took."""
    start = time.perf_counter()
    for layer in model.layers:
        layer.k_cache = torch.zeros(shape.shape, dtype=shape.dtype, device=shape.device)
        layer.v_cache = torch.zeros(shape.shape, dtype=shape.dtype, device=shape.device)
    return time.perf_counter() - start


def check_level(level: Any) -> int:
    if isinstance(level, bool) or not isinstance(level, int) or level not in SLEEP_LEVELS:
        offered = ", ".join(f"{k} ({v})" for k, v in SLEEP_LEVELS.items())
        raise ConfigError(f"sleep level must be one of {offered}; got {level!r}")
    return level


class SleepMode:
    """Whether an engine sleeps (``level``) and the KV cache it freed: the graphs of ``runners`` and the
    cache of ``model`` go on :meth:`sleep` and come back on :meth:`wake_up`."""

    def __init__(self, model: ReferenceModel, runners: Sequence[GraphRunner]) -> None:
        self.model = model
        self.runners = tuple(runners)
        #: The level asleep at; ``None``: awake.
        self.level: int | None = None
        self._freed: KvCacheShape | None = None

    @property
    def asleep(self) -> bool:
        return self.level is not None

    def sleep(self, level: int, busy: str | None, released_bytes: int = 0) -> dict[str, Any]:
        """The graphs released, then the KV cache freed; returns what was freed. ``busy``: why the engine
        cannot sleep now (requests in flight), or ``None``; ``released_bytes``: graph bytes released for
        this sleep already (those of a background capture it stopped), counted with the rest."""
        check_level(level)
        if self.level is not None:
            return {"level": self.level, "graph_bytes": 0, "kv_cache_bytes": 0}
        if busy is not None:
            raise ConfigError(busy)
        graph_bytes = released_bytes + sum(r.release().graph_bytes for r in self.runners)
        freed = self._freed = free_kv_cache(self.model)
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()  # the KV cache's blocks back to the driver
        self.level = level
        logger.info(
            "asleep (level %d): released %.1f MiB of graphs and %.1f MiB of KV cache",
            level,
            graph_bytes / 2**20,
            freed.nbytes / 2**20,
        )
        return {"level": level, "graph_bytes": graph_bytes, "kv_cache_bytes": freed.nbytes}

    def wake_up(self) -> dict[str, Any]:
        """The KV cache first, then the graphs; returns the seconds each took."""
        if self.level is None or self._freed is None:
            return {"kv_cache_s": 0.0, "graphs_s": 0.0}
        kv_seconds = allocate_kv_cache(self.model, self._freed)
        start = time.perf_counter()
        for runner in self.runners:
            runner.restore()
        graphs_seconds = time.perf_counter() - start
        self.level, self._freed = None, None
        logger.info("awake: KV cache in %.2f s, graphs captured again in %.2f s", kv_seconds, graphs_seconds)
        return {"kv_cache_s": round(kv_seconds, 4), "graphs_s": round(graphs_seconds, 4)}
