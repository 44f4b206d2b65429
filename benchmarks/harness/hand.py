"""Hand-written graphs: what an engine writes without devgraph (``torch.cuda.CUDAGraph`` over static
buffers, padded per axis), over the same inputs and sizes as the runners they are compared with."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from devgraph.contract.inputs import EDGE, StaticInput
from devgraph.contract.keys import TOKENS
from harness.device import Batch

__all__ = ["HandGraphs"]


_CAPTURE_STREAM: list[Any] = []


def _capture_stream() -> Any:
    """One side stream for every hand-written capture of the process (cuBLAS keeps a workspace per stream
    for the life of the process; devgraph also captures on one stream per device)."""
    if not _CAPTURE_STREAM:
        _CAPTURE_STREAM.append(torch.cuda.Stream())
    return _CAPTURE_STREAM[0]


class HandGraphs:
    """Graphs written by hand, as an engine would without devgraph.

    Static buffers as long as the largest key of each axis; keys ``(tokens, requests)`` captured largest
    first into one pool on one side stream, each after ``warmup_iters`` eager runs on that stream, with the
    standard ``torch.cuda.graph`` context (``gc`` frozen around the whole capture, as devgraph does). ``run``
    copies a step's inputs in, pads each axis with the input's fill, replays and cuts the output to
    ``out_axis`` rows. On the CPU (``--smoke``) the simulated graphs stand in for CUDA graphs.
    """

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        specs: Mapping[str, StaticInput],
        keys: Sequence[tuple[int, int]],
        device: torch.device,
        *,
        warmup_iters: int = 2,
        out_axis: str = TOKENS,
    ) -> None:
        self.forward = forward
        self.specs = dict(specs)
        self.keys = sorted(set(keys))
        self.device = device
        self.warmup_iters = warmup_iters
        self.out_axis = out_axis
        top = {TOKENS: max(t for t, _ in self.keys), "requests": max(r for _, r in self.keys)}
        self.static = {
            name: torch.zeros((spec.rows(top[spec.axis]), *spec.shape), dtype=spec.dtype, device=device)
            for name, spec in self.specs.items()
        }
        self.graphs: dict[tuple[int, int], Any] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.capture_only_seconds = 0.0

    @staticmethod
    def _size(key: tuple[int, int], axis: str) -> int:
        return key[0] if axis == TOKENS else key[1]

    def views(self, key: tuple[int, int]) -> Batch:
        return {
            name: self.static[name][: spec.rows(self._size(key, spec.axis))]
            for name, spec in self.specs.items()
        }

    def capture(self) -> None:
        gc.collect()
        gc.freeze()
        try:
            if self.device.type == "cuda":
                self._capture_cuda()
            else:
                self._capture_sim()
        finally:
            gc.unfreeze()

    def _capture_cuda(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = _capture_stream()
        for key in reversed(self.keys):
            views = self.views(key)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.warmup_iters):
                    self.forward(**views)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            t0 = time.perf_counter()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.forward(**views)
            torch.cuda.synchronize()
            self.capture_only_seconds += time.perf_counter() - t0
            self.graphs[key], self.outputs[key] = graph, out

    def _capture_sim(self) -> None:
        from devgraph.platforms.sim.platform import CpuSimPlatform

        sim = CpuSimPlatform()
        pool = sim.graph_pool_handle()
        for key in reversed(self.keys):
            views = self.views(key)
            for _ in range(self.warmup_iters):
                self.forward(**views)
            graph = sim.new_graph()
            t0 = time.perf_counter()
            sim.capture_begin(graph, pool)
            out = self.forward(**views)
            sim.capture_end(graph)
            self.capture_only_seconds += time.perf_counter() - t0
            self.graphs[key], self.outputs[key] = graph, out

    def key_for(self, batch: Batch) -> tuple[int, int] | None:
        tokens, requests = int(batch["input_ids"].shape[0]), int(batch["seq_lens"].shape[0])
        for key in self.keys:
            if key[0] >= tokens and key[1] >= requests:
                return key
        return None

    def stage(self, batch: Batch, key: tuple[int, int]) -> None:
        for name, value in batch.items():
            spec, buf = self.specs[name], self.static[name]
            rows, padded = value.shape[0], spec.rows(self._size(key, spec.axis))
            buf[:rows].copy_(value)
            if rows < padded:
                if spec.fill == EDGE:
                    buf[rows:padded].copy_(buf[rows - 1 : rows].expand(padded - rows, *buf.shape[1:]))
                else:
                    buf[rows:padded].fill_(spec.fill)

    def _rows(self, batch: Batch) -> int:
        return int(batch["input_ids" if self.out_axis == TOKENS else "seq_lens"].shape[0])

    def run(self, batch: Batch) -> torch.Tensor:
        key = self.key_for(batch)
        if key is None:
            return self.forward(**batch)
        self.stage(batch, key)
        self.graphs[key].replay()
        return self.outputs[key][: self._rows(batch)]

    def eager_padded(self, batch: Batch) -> torch.Tensor:
        """Eager on the static buffers of the batch's key: the same padded step the graph replays."""
        key = self.key_for(batch)
        if key is None:
            return self.forward(**batch)
        self.stage(batch, key)
        return self.forward(**self.views(key))[: self._rows(batch)]

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
