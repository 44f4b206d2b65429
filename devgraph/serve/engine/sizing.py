"""Sizing the KV cache from free memory with the graphs accounted for (``--gpu-memory-utilization``).

The engine is built on a stand-in cache (one request of the full context), its runners estimate their graph
memory before capture (:meth:`~devgraph.runner.graph_runner.GraphRunner.estimate_graph_memory`), and the
cache gets what is left of ``utilization`` of the device's memory: what is in use now (weights, the
stand-in cache, the runtime) counts against it, the stand-in cache is handed back, the graphs' estimate is
held back.
"""

from __future__ import annotations

from dataclasses import dataclass

from devgraph import ConfigError

__all__ = ["KvSizing", "kv_blocks_for_memory"]


@dataclass(frozen=True)
class KvSizing:
    """How the cache was sized: the inputs and the blocks that came out (for the log and the stats)."""

    utilization: float
    free_bytes: int
    total_bytes: int
    stand_in_bytes: int
    graph_bytes: int
    block_bytes: int
    num_blocks: int

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def kv_blocks_for_memory(
    *,
    utilization: float,
    free_bytes: int,
    total_bytes: int,
    stand_in_bytes: int,
    graph_bytes: int,
    block_bytes: int,
    min_blocks: int,
) -> KvSizing:
    """The blocks (scratch block 0 included) that fit ``utilization`` of ``total_bytes``, less what is in use
    (``total - free``, the stand-in cache of ``stand_in_bytes`` given back) and ``graph_bytes``;
    :class:`ConfigError` naming the flag when fewer than ``min_blocks`` fit."""
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {utilization!r}")
    if block_bytes <= 0:
        raise ConfigError(f"a KV block must take bytes, got {block_bytes}")
    in_use = total_bytes - free_bytes - stand_in_bytes
    budget = int(utilization * total_bytes) - in_use - graph_bytes
    blocks = max(0, budget // block_bytes)
    if blocks < min_blocks:
        gib = float(1 << 30)
        raise ConfigError(
            f"--gpu-memory-utilization {utilization:g} leaves {max(0, budget) / gib:.2f} GiB for the KV "
            f"cache ({blocks} blocks; at least {min_blocks} are needed) after {in_use / gib:.2f} GiB in use "
            f"and {graph_bytes / gib:.2f} GiB of graphs (estimated): raise it, or lower --max-seq-len or "
            "--max-running-requests"
        )
    return KvSizing(
        utilization, free_bytes, total_bytes, stand_in_bytes, graph_bytes, block_bytes, int(blocks)
    )
