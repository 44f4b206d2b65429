"""Shared pieces of the device benchmarks (``bench_decode.py``, ``bench_restart.py``).

* :class:`Device`: synchronize, memory, and per-step timing with CUDA events (``perf_counter`` on the CPU,
  where ``--smoke`` runs the same code on the simulated graphs).
* :func:`time_cases`: median latency of interleaved variants over the same cases; :class:`Budget`.
* The memory-bandwidth floor: :func:`copy_bandwidth` (a large device-to-device copy, measured in the same
  run) and :func:`step_bytes` (weights read once + KV actually read + activations).
* :class:`KVPlan`: seeded batches of the reference model whose KV writes never land where another batch
  reads, so every step's output is a pure function of its inputs and one eager reference serves all.
* :class:`HandGraphs`: what an engine writes without devgraph (``torch.cuda.CUDAGraph`` over static
  buffers, padded per axis), over the same inputs and sizes.
* :class:`Report` (JSON with the environment and the command), :class:`Target`, :func:`plot_panels`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import platform as host_platform
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from devgraph.contract.inputs import EDGE, StaticInput
from devgraph.contract.keys import TOKENS
from devgraph.reference import ReferenceConfig, ReferenceModel, make_decode_batch, make_prefill_batch

log = logging.getLogger("bench")

Batch = dict[str, torch.Tensor]
MiB = 1 << 20


# -- the device --------------------------------------------------------------------------------------------
class Device:
    """The few device calls the benchmarks make: real on CUDA, trivial on the CPU (``--smoke``)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if self.cuda
            else None
        )

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved()) if self.cuda else 0

    def settle(self, full_gc: bool = False) -> None:
        """Finish queued work and return the allocator's unused cache, so reserved bytes mean live bytes.

        Only the young ``gc`` generations are collected unless ``full_gc`` (a full collection of a heap
        holding torch.compile's state takes a good part of a second, and nothing measured needs it).
        """
        self.sync()
        gc.collect() if full_gc else gc.collect(1)
        if self.cuda:
            torch.cuda.empty_cache()

    def name(self) -> str:
        if self.cuda:
            return torch.cuda.get_device_name()
        return f"cpu ({host_platform.processor() or host_platform.machine()})"

    def time_step(self, step: Callable[[], Any]) -> tuple[float, float]:
        """``(latency ms, host ms)`` of one step on an idle device.

        Latency: CUDA events recorded before and after the step's launches, so it runs from the moment the
        host starts the step to the end of its last kernel (the host's own cost shows where the device
        waits for it). Host: ``perf_counter`` until the step returns, nothing synchronized.
        """
        self.sync()
        if self._events is None:
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            return (t1 - t0) * 1e3, (t1 - t0) * 1e3
        start, end = self._events
        t0 = time.perf_counter()
        start.record()
        step()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)), (t1 - t0) * 1e3


def host_us(dev: Device, call: Callable[[], Any], iters: int) -> float:
    """Median host microseconds of ``call`` on an idle device (synchronized before each call, not inside)."""
    samples = []
    for _ in range(iters):
        dev.sync()
        t0 = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    dev.sync()
    return statistics.median(samples)


@dataclass
class Budget:
    """Seconds this run may take; optional sections ask before they start."""

    seconds: float
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, estimate: float) -> bool:
        return self.left() >= estimate


# -- timing of variants ------------------------------------------------------------------------------------
@dataclass
class Variant:
    """One way of running a phase: a step per case, what building it cost, how to release it."""

    name: str
    step: Callable[[str], Any]
    info: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    runner: Any = None


def time_cases(
    variants: Sequence[Variant],
    cases: Sequence[str],
    dev: Device,
    *,
    iters: int,
    rounds: int,
    on_error: Callable[[str, BaseException], None],
    warm_steps: int = 3,
) -> dict[str, dict[str, dict[str, float]]]:
    """``result[variant][case]``: median latency and host ms over ``iters`` steps.

    Per case every variant first runs ``warm_steps`` untimed steps, then the variants take turns for
    ``rounds`` rounds of ``iters / rounds`` steps, so clock and thermal drift hit them alike. A variant
    that fails on a case is reported through ``on_error`` and left out of that case.
    """
    out: dict[str, dict[str, dict[str, float]]] = {v.name: {} for v in variants}
    per_round = max(1, iters // rounds)
    for case in cases:
        alive = []
        for v in variants:
            try:
                for _ in range(warm_steps):
                    v.step(case)
                dev.sync()
                alive.append(v)
            except Exception as exc:
                on_error(f"{v.name} at {case}", exc)
        latency: dict[str, list[float]] = {v.name: [] for v in alive}
        host: dict[str, list[float]] = {v.name: [] for v in alive}
        for _ in range(rounds):
            for v in list(alive):
                call = _bind(v.step, case)
                try:
                    for _ in range(per_round):
                        ms, host_ms = dev.time_step(call)
                        latency[v.name].append(ms)
                        host[v.name].append(host_ms)
                except Exception as exc:
                    on_error(f"{v.name} at {case}", exc)
                    alive.remove(v)
        for v in alive:
            out[v.name][case] = {
                "ms": round(statistics.median(latency[v.name]), 4),
                "host_ms": round(statistics.median(host[v.name]), 4),
                "min_ms": round(min(latency[v.name]), 4),
                "steps": len(latency[v.name]),
            }
    return out


def _bind(step: Callable[[str], Any], case: str) -> Callable[[], Any]:
    return lambda: step(case)


def measure_build(dev: Device, build: Callable[[], Any]) -> tuple[Any, float, int]:
    """``(result, seconds, graph bytes)``: wall time of ``build`` (device synchronized at the end) and the
    growth of reserved device memory across it, the allocator's cache emptied before and after."""
    dev.settle()
    before = dev.reserved()
    t0 = time.perf_counter()
    result = build()
    dev.sync()
    seconds = time.perf_counter() - t0
    dev.settle()
    return result, seconds, dev.reserved() - before


# -- the bandwidth floor -------------------------------------------------------------------------------------
def copy_bandwidth(dev: Device, nbytes: int, iters: int = 10) -> dict[str, float]:
    """Bandwidth of a large device-to-device copy, counting bytes read and written (median of ``iters``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev.device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = [dev.time_step(lambda: dst.copy_(src))[0] for _ in range(iters)]
    ms = statistics.median(samples)
    src.resize_(0)  # give the memory back before the model is measured
    dst.resize_(0)
    dev.settle()
    return {"bytes_copied": nbytes, "ms": round(ms, 4), "GBps": round(2 * nbytes / (ms * 1e-3) / 1e9, 1)}


def step_bytes(model: ReferenceModel, batch: Batch, out_rows: int) -> dict[str, int]:
    """Bytes one step must move at least: every weight read once (the tied embedding once, as the LM head),
    the KV of every request's context read once, and activations (embedding rows in, new K/V and the
    logits out). Intermediate activations between kernels are left out: the floor is a lower bound."""
    c = model.config
    elem = torch.finfo(c.dtype).bits // 8
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = int(batch["input_ids"].shape[0])
    context = int(batch["seq_lens"].sum().item())
    kv_row = c.num_layers * 2 * c.num_kv_heads * c.head_dim * elem
    activations = tokens * c.hidden_size * elem + tokens * kv_row + out_rows * c.vocab_size * elem
    return {"weights": weights, "kv_read": context * kv_row, "activations": activations}


def floor_ms(nbytes: Mapping[str, int], bandwidth_gbps: float) -> float:
    return sum(nbytes.values()) / (bandwidth_gbps * 1e9) * 1e3


# -- inputs whose writes never meet another batch's reads ----------------------------------------------------
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


_CAPTURE_STREAM: list[Any] = []


def _capture_stream() -> Any:
    """One side stream for every hand-written capture of the process (cuBLAS keeps a workspace per stream
    for the life of the process; devgraph also captures on one stream per device)."""
    if not _CAPTURE_STREAM:
        _CAPTURE_STREAM.append(torch.cuda.Stream())
    return _CAPTURE_STREAM[0]


# -- hand-written graphs -------------------------------------------------------------------------------------
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


# -- results -------------------------------------------------------------------------------------------------
def diff(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """max |out - ref| and the relative L2 error."""
    a, b = out.detach().double(), ref.detach().double()
    if a.shape != b.shape:
        return {"max_abs": float("nan"), "rel_l2": float("nan")}
    return {
        "max_abs": float((a - b).abs().max().item()) if a.numel() else 0.0,
        "rel_l2": float((a - b).norm().item() / max(b.norm().item(), 1e-30)),
    }


def command_line() -> str:
    return " ".join(["python", *map(shlex.quote, sys.argv)])


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def environment(dev: Device) -> dict[str, Any]:
    import devgraph

    return {
        "device": dev.name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "python": host_platform.python_version(),
        "devgraph": devgraph.__version__,
        "command": command_line(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def output_path(name: str, default: str, given: str | None, smoke: bool) -> Path:
    """``given``, else ``$OUT/name``, else ``default`` (``--smoke`` writes to a temporary folder instead)."""
    if given:
        return Path(given)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / name
    if smoke:
        import tempfile

        return Path(tempfile.gettempdir()) / f"devgraph-smoke-{name}"
    return Path(default)


class Report:
    """The JSON being built: written after every section, so a crash keeps what was measured."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": meta, "errors": []}

    def error(self, what: str, exc: BaseException) -> None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.data["errors"].append(f"{what}: {type(exc).__name__}: {first}"[:2000])
        log.error("%s failed:\n%s", what, "".join(traceback.format_exception(exc))[-4000:])

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")


@dataclass
class Target:
    """One target: ``measured`` against ``limit`` (lower is better unless ``higher``)."""

    name: str
    measured: float | None
    limit: float
    unit: str = ""
    higher: bool = False
    detail: str = ""

    @property
    def met(self) -> bool | None:
        if self.measured is None or self.measured != self.measured:  # missing or NaN
            return None
        return self.measured >= self.limit if self.higher else self.measured <= self.limit

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "target": self.name,
            "measured": None if self.measured is None else round(self.measured, 4),
            "limit": f"{'>=' if self.higher else '<='} {self.limit}{self.unit}",
            "met": self.met,
        }
        if self.met is False and self.measured is not None and self.limit:
            out["missed_by_percent"] = round(abs(self.measured / self.limit - 1) * 100, 1)
        if self.detail:
            out["detail"] = self.detail
        return out


def targets_table(targets: Sequence[Target]) -> str:
    lines = ["targets:"]
    for t in targets:
        measured = "n/a" if t.measured is None else f"{t.measured:.4g}{t.unit}"
        state = {True: "met", False: "MISSED", None: "not measured"}[t.met]
        if t.met is False and t.measured is not None and t.limit:
            state += f" by {abs(t.measured / t.limit - 1) * 100:.1f}%"
        limit = f"{'>=' if t.higher else '<='} {t.limit:g}{t.unit}"
        lines.append(f"  {t.name:<58} {measured:>12}  {limit:<12} {state}")
    return "\n".join(lines)


# -- plots ---------------------------------------------------------------------------------------------------
@dataclass
class Panel:
    """One subplot: ``series[name][i]`` is the value at ``x[i]`` (``None``: not measured)."""

    title: str
    x: list[str]
    series: dict[str, list[float | None]]
    ylabel: str = "ms per step (median)"
    xlabel: str = ""
    bars: bool = False
    reference: dict[str, list[float | None]] = field(default_factory=dict)  # dashed lines (floors)


def plot_panels(path: Path, panels: Sequence[Panel], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(n for p in panels for n in p.series))
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    colors = {n: cmap(i % cmap.N) for i, n in enumerate(names)}
    cols = 2
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        positions = list(range(len(panel.x)))
        width = 0.8 / max(1, len(panel.series))
        for i, (name, raw) in enumerate(panel.series.items()):
            values = [float("nan") if v is None else v for v in raw]
            dashed = "sdpa" in name  # the break-op attention, drawn apart from the paged one
            if panel.bars:
                offsets = [p + (i - (len(panel.series) - 1) / 2) * width for p in positions]
                ax.bar(offsets, values, width, label=name, color=colors[name], hatch="//" if dashed else None)
            else:
                style = ":" if dashed else "-"
                ax.plot(positions, values, marker="o", linestyle=style, label=name, color=colors[name])
        for name, line in panel.reference.items():
            ax.plot(
                positions,
                [float("nan") if v is None else v for v in line],
                linestyle="--",
                color="black",
                label=name,
            )
        ax.set_xticks(positions, panel.x)
        ax.set_yscale("log")
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
