"""The tensor-parallel decode graphs an engine writes by hand without devgraph (``bench_tp.py``'s ``hand``
variant): static buffers, largest size first into one pool on one side stream, a barrier before each
capture so every rank's NCCL communicator is ready."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from devgraph.reference.tp import TPReferenceModel

INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens")
WARMUP_ITERS = 2


class HandGraphs:
    """Decode graphs written by hand, as an engine would without devgraph (exact sizes only)."""

    def __init__(self, model: TPReferenceModel, sizes: Sequence[int], dev: Any) -> None:
        self.model = model
        self.sizes = sorted(sizes)
        self.dev = dev
        top, width, device = self.sizes[-1], model.config.max_blocks_per_request, model.device
        self.static = {
            "input_ids": torch.zeros(top, dtype=torch.int64, device=device),
            "positions": torch.zeros(top, dtype=torch.int64, device=device),
            "slot_mapping": torch.zeros(top, dtype=torch.int64, device=device),
            "block_tables": torch.zeros(top, width, dtype=torch.int32, device=device),
            "seq_lens": torch.zeros(top, dtype=torch.int32, device=device),
        }
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        gc.collect()
        gc.freeze()
        try:
            with torch.no_grad():
                self._capture_cuda() if self.dev.cuda else self._capture_sim()
        finally:
            gc.unfreeze()

    def _capture_cuda(self) -> None:
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        for size in reversed(self.sizes):
            views = {name: buf[:size] for name, buf in self.static.items()}
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_ITERS):
                    self.model.decode_step(**views)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            dist.barrier()  # every rank done warming up (its NCCL communicator is ready) before capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[size] = self.model.decode_step(**views)
            self.graphs[size] = graph

    def _capture_sim(self) -> None:
        from devgraph.platforms.sim.platform import CpuSimPlatform

        sim = CpuSimPlatform()
        pool = sim.graph_pool_handle()
        for size in reversed(self.sizes):
            views = {name: buf[:size] for name, buf in self.static.items()}
            for _ in range(WARMUP_ITERS):
                self.model.decode_step(**views)
            graph = sim.new_graph()
            sim.capture_begin(graph, pool)
            self.outputs[size] = self.model.decode_step(**views)
            sim.capture_end(graph)
            self.graphs[size] = graph

    def run(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        n = batch["input_ids"].shape[0]
        for name in INPUTS:
            self.static[name][:n].copy_(batch[name])
        self.graphs[n].replay()
        return self.outputs[n]

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
