"""Sleep mode: hand an idle engine's device memory back (a trainer, another model needs it) and take it
again on wake-up.

Level 1 frees the graphs of both runners and their pools (``GraphRunner.release()``), then the paged KV
cache (its contents are discarded: sleep only when no request is in flight); the weights stay. Wake-up
goes the other way: the KV cache first, at its old size, then the graphs (``GraphRunner.restore()``),
captured on the new cache's addresses, reusing the compiled forward.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from devgraph import ConfigError
from devgraph.serve.engine.allocator import BlockAllocator

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


def resize_kv_cache(engine: Any, num_blocks: int) -> None:  # an Engine (it imports this module)
    """:meth:`Engine.resize_kv_cache`: the KV cache at ``num_blocks`` blocks, before any graph or request."""
    if (
        engine.has_work
        or engine.decode_runner.keys
        or engine.prefill_runner.keys
        or engine.background is not None
    ):
        raise ConfigError(
            "resize the KV cache before capturing graphs and before adding requests: the graphs read "
            "the cache's addresses"
        )
    free_kv_cache(engine.model)
    engine.model.config = dataclasses.replace(engine.model.config, num_blocks=num_blocks)
    engine.model_config = engine.model.config
    shape = engine.model.config
    allocate_kv_cache(
        engine.model,
        KvCacheShape(
            (shape.total_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim),
            shape.dtype,
            engine.model.device,
            shape.num_layers,
        ),
    )
    engine.allocator = engine.scheduler.allocator = BlockAllocator(shape.total_blocks)


def put_to_sleep(engine: Any, level: int) -> dict[str, Any]:  # an Engine
    """:meth:`Engine.sleep`: the graphs released, then the KV cache freed; returns what was freed."""
    check_level(level)
    if engine.sleep_level is not None:
        return {"level": engine.sleep_level, "graph_bytes": 0, "kv_cache_bytes": 0}
    if engine.has_work:
        raise ConfigError(
            f"the engine has {engine.num_running + engine.num_waiting} request(s) in flight: sleep when "
            "it is idle (their KV cache would be freed under them)"
        )
    if engine.background is not None and not engine.background.done:
        raise ConfigError("the graphs are still being captured in the background; sleep once they are")
    graph_bytes = sum(r.release().graph_bytes for r in (engine.decode_runner, engine.prefill_runner))
    engine._kv_shape = free_kv_cache(engine.model)
    if engine.model.device.type == "cuda":
        torch.cuda.empty_cache()  # the KV cache's blocks back to the driver
    engine.sleep_level = level
    logger.info(
        "asleep (level %d): released %.1f MiB of graphs and %.1f MiB of KV cache",
        level,
        graph_bytes / 2**20,
        engine._kv_shape.nbytes / 2**20,
    )
    return {"level": level, "graph_bytes": graph_bytes, "kv_cache_bytes": engine._kv_shape.nbytes}


def wake_up(engine: Any) -> dict[str, Any]:  # an Engine
    """:meth:`Engine.wake_up`: the KV cache first, then the graphs; returns the seconds each took."""
    if engine.sleep_level is None or engine._kv_shape is None:
        return {"kv_cache_s": 0.0, "graphs_s": 0.0}
    kv_seconds = allocate_kv_cache(engine.model, engine._kv_shape)
    start = time.perf_counter()
    engine.decode_runner.restore()
    engine.prefill_runner.restore()
    graphs_seconds = time.perf_counter() - start
    engine.sleep_level, engine._kv_shape = None, None
    logger.info("awake: KV cache in %.2f s, graphs captured again in %.2f s", kv_seconds, graphs_seconds)
    return {"kv_cache_s": round(kv_seconds, 4), "graphs_s": round(graphs_seconds, 4)}
