"""devgraph on an NVIDIA GPU vs eager, hand-written CUDA graphs and torch.compile(mode="reduce-overhead").

One process, one model, the same inputs for every variant::

    python benchmarks/bench_cuda.py --out benchmarks/results/h100.json      # on the GPU
    python benchmarks/bench_cuda.py --smoke                                 # CPU check of the script itself

Model: the reference decoder shaped like Qwen3-0.6B (28 layers, hidden 1024, 16 heads, 8 KV heads, head dim
128, intermediate 3072, vocab 151936), bf16, random weights, a KV cache of 72 rows x 2048 positions
(decode batches use rows 0-63, prefill requests rows 64-71).

Variants per phase (decode: batch 1/8/32/64; prefill: one request of 32/128/512/2048 tokens and four
requests totalling 512):

* ``eager``: the forward itself;
* ``hand``: hand-written ``torch.cuda.CUDAGraph`` capture (static buffers, copy inputs, replay) with the
  same sizes, warm-ups, shared pool, stream and largest-first order as devgraph;
* ``full``, ``breakable``, ``tc_piecewise[eager]``, ``tc_piecewise[inductor]``: devgraph ``GraphRunner``;
* ``compile_ro`` (decode): ``torch.compile(model.decode_step, mode="reduce-overhead")`` with
  ``torch.compiler.cudagraph_mark_step_begin()`` per step, the KV cache being the model's buffers that
  the attention op mutates in place.

Decode runs with ``context=None`` for every variant, so the attention op reads the whole cache row
(``max_seq_len`` positions) everywhere: a graph captured by ``full`` or ``hand`` cannot trim it per step,
and the comparison stays like for like. Latency is the median over many steps, each timed with
``synchronize`` + ``perf_counter`` (so it includes every variant's Python cost), with variants interleaved
in rounds so clock drift hits them alike. Graph memory is the growth of ``torch.cuda.memory_reserved``
across capture, with the allocator's cache emptied before and after.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform as host_platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import devgraph
from devgraph.reference import (
    ReferenceConfig,
    ReferenceModel,
    decode_runner,
    make_prefill_batch,
    padding_fill,
    prefill_runner,
)
from devgraph.runner import GraphRunner
from devgraph.strategies.plan import BreakCall, SegmentedPlan

log = logging.getLogger("bench_cuda")

GPU_DECODE_BATCHES = (1, 8, 32, 64)
GPU_DECODE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
GPU_PREFILL_CASES = ((32,), (128,), (512,), (2048,), (64, 96, 160, 192))
GPU_PREFILL_SIZES = (32, 128, 512, 2048)

SMOKE_DECODE_BATCHES = (1, 4, 8)
SMOKE_DECODE_SIZES = (1, 2, 4, 8)
SMOKE_PREFILL_CASES = ((16,), (32,), (8, 8, 16, 32))
SMOKE_PREFILL_SIZES = (16, 32, 64)

INPUT_NAMES = ("input_ids", "positions", "req_slots")
#: Decode batches use cache rows [0, 64); prefill requests get rows of their own above them, so prefill
#: (which rewrites positions 0..L-1 of its rows) never changes what a decode step reads.
DECODE_SLOTS = 64
PREFILL_SLOTS = 8
WARMUP_ITERS = 2  # the runner's default; the hand-written capture uses the same


# -- inputs --------------------------------------------------------------------------------------------
def decode_batches(
    model: ReferenceModel, sizes: Sequence[int], slots: int
) -> dict[str, dict[str, torch.Tensor]]:
    """One decode batch per size on rows ``[0, slots)``; no two batches write the same (row, position)."""
    config = model.config
    generator = torch.Generator().manual_seed(0)
    taken: set[tuple[int, int]] = set()
    out = {}
    for n in sizes:
        rows = torch.randperm(slots, generator=generator)[:n]
        positions = torch.randint(1, config.max_seq_len, (n,), generator=generator)
        for i in range(n):
            while (int(rows[i]), int(positions[i])) in taken:  # move a clash to the next free position
                positions[i] = 1 + int(positions[i]) % (config.max_seq_len - 1)
            taken.add((int(rows[i]), int(positions[i])))
        batch = {
            "input_ids": torch.randint(0, config.vocab_size, (n,), generator=generator),
            "positions": positions,
            "req_slots": rows,
        }
        out[str(n)] = {k: v.to(model.device) for k, v in batch.items()}
    return out


def prefill_batches(
    model: ReferenceModel, cases: Sequence[Sequence[int]], first_slot: int
) -> dict[str, dict[str, torch.Tensor]]:
    """One packed prefill batch per case, request ``r`` on row ``first_slot + r``."""
    out = {}
    for i, lens in enumerate(cases):
        batch = make_prefill_batch(model, list(lens), seed=i)
        rows = torch.arange(first_slot, first_slot + len(lens), device=model.device)
        counts = torch.tensor(list(lens), device=model.device)
        batch["req_slots"] = rows.repeat_interleave(counts)
        out["+".join(map(str, lens))] = batch
    return out


# -- device helpers ------------------------------------------------------------------------------------
class Device:
    """The few device calls the benchmark makes, real on CUDA and trivial on the CPU (``--smoke``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved()) if self.cuda else 0

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated()) if self.cuda else 0

    def settle(self) -> None:
        """Finish queued work and return the allocator's unused cache, so reserved bytes mean live bytes."""
        self.sync()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def name(self) -> str:
        if self.cuda:
            return torch.cuda.get_device_name()
        return f"cpu ({host_platform.processor() or host_platform.machine()})"


# -- hand-written graphs -------------------------------------------------------------------------------
class HandGraphs:
    """CUDA graphs written by hand, as an engine would without devgraph.

    Static input buffers of the largest size, each size captured largest first into one shared pool on one
    side stream after ``WARMUP_ITERS`` warm-ups on that stream; ``run`` copies the inputs in, fills padding
    rows, replays and slices. On the CPU (``--smoke``) the simulated graphs stand in for CUDA graphs.
    """

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        sizes: Sequence[int],
        fills: Mapping[str, int],
        device: torch.device,
        stream: Any,
    ) -> None:
        self.forward = forward
        self.sizes = sorted(sizes)
        self.fills = dict(fills)
        self.device = device
        self.stream = stream
        top = self.sizes[-1]
        self.static = {
            name: torch.full((top,), fills[name], dtype=torch.int64, device=device) for name in fills
        }
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_only_seconds = 0.0

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
        for size in reversed(self.sizes):
            views = {name: buf[:size] for name, buf in self.static.items()}
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(WARMUP_ITERS):
                    self.forward(**views)
            torch.cuda.current_stream().wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            t0 = time.perf_counter()
            with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                out = self.forward(**views)
            torch.cuda.synchronize()
            self.capture_only_seconds += time.perf_counter() - t0
            self.graphs[size], self.outputs[size] = graph, out

    def _capture_sim(self) -> None:
        from devgraph.sim.platform import CpuSimPlatform

        sim = CpuSimPlatform()
        pool = sim.graph_pool_handle()
        for size in reversed(self.sizes):
            views = {name: buf[:size] for name, buf in self.static.items()}
            for _ in range(WARMUP_ITERS):
                self.forward(**views)
            graph = sim.new_graph()
            t0 = time.perf_counter()
            sim.capture_begin(graph, pool)
            out = self.forward(**views)
            sim.capture_end(graph)
            self.capture_only_seconds += time.perf_counter() - t0
            self.graphs[size], self.outputs[size] = graph, out

    def bucket(self, n: int) -> int | None:
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def run(self, n: int, **inputs: torch.Tensor) -> torch.Tensor:
        size = self.bucket(n)
        if size is None:
            return self.forward(**inputs)
        for name, value in inputs.items():
            buf = self.static[name]
            buf[:n].copy_(value)
            if n < size:
                buf[n:size].fill_(self.fills[name])
        self.graphs[size].replay()
        out = self.outputs[size]
        return out if n == size else out[:n]

    def eager_padded(self, n: int) -> torch.Tensor:
        """Eager on the static buffers of ``n``'s bucket (the same padded batch the graph saw)."""
        size = self.bucket(n) or n
        return self.forward(**{name: buf[:size] for name, buf in self.static.items()})[:n]

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


# -- measurement ---------------------------------------------------------------------------------------
@dataclass
class Variant:
    """One way of running a phase: a step function per case, plus what building it cost."""

    name: str
    step: Callable[[str], Any]  # case key -> runs one step
    capture_seconds: float = 0.0
    capture_only_seconds: float = 0.0
    graph_bytes: int = 0
    report_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None


def time_variants(
    variants: Sequence[Variant], cases: Sequence[str], dev: Device, iters: int, rounds: int
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Median ms per (variant, case), step to synchronize and step to return (the host's share).

    Variants are interleaved in ``rounds`` so clock drift hits them alike.
    """
    names = [v.name for v in variants]
    wall: dict[str, dict[str, list[float]]] = {n: {c: [] for c in cases} for n in names}
    host: dict[str, dict[str, list[float]]] = {n: {c: [] for c in cases} for n in names}
    per_round = max(1, iters // rounds)
    for case in cases:
        for v in variants:  # warm-up: first calls, allocator growth, lazy inits
            try:
                for _ in range(3):
                    v.step(case)
                dev.sync()
            except Exception as exc:
                raise RuntimeError(f"{v.name} failed at case {case}: {exc}") from exc
        for _ in range(rounds):
            for v in variants:
                for _ in range(per_round):
                    dev.sync()
                    t0 = time.perf_counter()
                    v.step(case)
                    t1 = time.perf_counter()
                    dev.sync()
                    t2 = time.perf_counter()
                    wall[v.name][case].append((t2 - t0) * 1e3)
                    host[v.name][case].append((t1 - t0) * 1e3)

    def medians(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
        return {n: {c: statistics.median(x) for c, x in per_case.items()} for n, per_case in samples.items()}

    return medians(wall), medians(host)


def segment_breakdown(
    runner: GraphRunner, size: int, dev: Device, iters: int = 20
) -> dict[str, float] | None:
    """For a segmented plan: median ms of replaying only its graph segments, and of running only its break
    ops, each synchronized at the end (where the time of a break-op mode goes)."""
    plan = runner.backend._entries.get(size)
    if not isinstance(plan, SegmentedPlan):
        return None
    graphs = [s for s in plan.steps if not isinstance(s, BreakCall)]
    breaks = [s for s in plan.steps if isinstance(s, BreakCall)]

    def timed(calls: Sequence[Callable[[], Any]]) -> float:
        times = []
        for _ in range(iters):
            dev.sync()
            t0 = time.perf_counter()
            for call in calls:
                call()
            dev.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return round(statistics.median(times), 4)

    timed([g.replay for g in graphs] + [b.run for b in breaks])  # warm
    call = breaks[0]._call if breaks else None
    target = getattr(call, "func", call)  # a functools.partial over what replay really calls
    return {
        "segments": len(graphs),
        "breaks": len(breaks),
        "segments_only_ms": timed([g.replay for g in graphs]),
        # BreakCall.run = the op's function on its captured arguments + one copy into the captured output
        "breaks_only_ms": timed([b.run for b in breaks]),
        "break_functions_only_ms": timed([b._call for b in breaks]),
        "break_replay_calls": getattr(target, "__qualname__", repr(target)),
    }


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max().item()) if a.numel() else 0.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    ref = b.double()
    return float((a.double() - ref).norm().item() / max(ref.norm().item(), 1e-30))


def measure_build(dev: Device, build: Callable[[], Variant]) -> Variant:
    """Build (capture) a variant; wall seconds and reserved-memory growth with the cache emptied around it."""
    dev.settle()
    before = dev.reserved()
    t0 = time.perf_counter()
    variant = build()
    dev.sync()
    variant.capture_seconds = time.perf_counter() - t0
    dev.settle()
    variant.graph_bytes = dev.reserved() - before
    return variant


# -- the benchmark -------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.perf_counter()
        smoke = args.smoke
        device = torch.device("cpu" if smoke else "cuda")
        self.dev = Device(device)
        if smoke:
            config = ReferenceConfig.preset("tiny", max_requests=DECODE_SLOTS + PREFILL_SLOTS)
        else:
            config = ReferenceConfig.preset(
                "qwen3-0.6b", max_requests=DECODE_SLOTS + PREFILL_SLOTS, max_seq_len=args.max_seq_len
            )
        self.config = config
        self.decode_batches = SMOKE_DECODE_BATCHES if smoke else GPU_DECODE_BATCHES
        self.decode_sizes = SMOKE_DECODE_SIZES if smoke else GPU_DECODE_SIZES
        self.prefill_cases = SMOKE_PREFILL_CASES if smoke else GPU_PREFILL_CASES
        self.prefill_sizes = SMOKE_PREFILL_SIZES if smoke else GPU_PREFILL_SIZES
        t0 = time.perf_counter()
        self.model = ReferenceModel(config, device=device, seed=0)
        self.model.randomize_cache(seed=0)
        self.dev.sync()
        self.model_seconds = time.perf_counter() - t0
        self.fills = padding_fill(self.model)
        self.hand_stream = torch.cuda.Stream() if self.dev.cuda else None
        self.results: dict[str, Any] = {
            "meta": self._meta(),
            "decode": {"variants": {}, "latency_ms": {}, "diff": {}, "skipped": {}},
            "prefill": {"variants": {}, "latency_ms": {}, "diff": {}, "skipped": {}},
            "errors": [],
        }

    # -- bookkeeping -----------------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        c = self.config
        return {
            "device": self.dev.name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": _version("triton"),
            "python": sys.version.split()[0],
            "devgraph": devgraph.__version__,
            "command": " ".join(shlex.quote(a) for a in sys.argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": {
                "preset": "tiny" if self.args.smoke else "qwen3-0.6b",
                "num_layers": c.num_layers,
                "hidden_size": c.hidden_size,
                "num_heads": c.num_heads,
                "num_kv_heads": c.num_kv_heads,
                "head_dim": c.head_dim,
                "intermediate_size": c.intermediate_size,
                "vocab_size": c.vocab_size,
                "max_requests": c.max_requests,
                "max_seq_len": c.max_seq_len,
                "dtype": str(c.dtype),
            },
            "decode_capture_sizes": list(self.decode_sizes),
            "prefill_capture_sizes": list(self.prefill_sizes),
            "warmup_iters": WARMUP_ITERS,
            "decode_context": None,
            "timing": "median of per-step synchronize + perf_counter wall times, variants interleaved",
            "graph_bytes": "growth of torch.cuda.memory_reserved across capture, cache emptied around it",
        }

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = round(self.elapsed(), 1)
        path = Path(self.args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.results, indent=2, default=str))

    def error(self, where: str, exc: BaseException) -> None:
        text = f"{where}: {type(exc).__name__}: {exc}"
        log.error("%s\n%s", text, traceback.format_exc())
        self.results["errors"].append(text[:2000])

    def time_left(self, need: float) -> bool:
        return self.elapsed() + need < self.args.time_budget

    # -- runner variants -------------------------------------------------------------------------------
    def _runner_variant(
        self,
        name: str,
        build: Callable[..., GraphRunner],
        batches: Mapping[str, dict[str, torch.Tensor]],
        mode: str,
        sizes: Sequence[int],
        compiler: str | None = None,
    ) -> Variant:
        runner = build(self.model, mode=mode, sizes=list(sizes), compiler=compiler, progress=False)
        report = runner.capture()

        def step(case: str) -> Any:
            batch = batches[case]
            return runner.run(batch["input_ids"].shape[0], None, **batch)

        variant = Variant(name, step, close=runner.close)
        variant.capture_only_seconds = sum(s.seconds for s in report.sizes)
        variant.report_bytes = report.bytes
        variant.extra["runner"] = runner
        variant.extra["report"] = [
            {"size": s.size, "seconds": s.seconds, "bytes": s.bytes} for s in report.sizes
        ]
        backend = runner.backend
        if hasattr(backend, "compiles"):
            variant.extra["compiles"] = backend.compiles
            variant.extra["recompiles"] = backend.recompiles
        return variant

    def _hand_variant(
        self,
        forward: Callable[..., torch.Tensor],
        sizes: Sequence[int],
        batches: Mapping[str, dict[str, torch.Tensor]],
    ) -> Variant:
        hand = HandGraphs(forward, sizes, self.fills, self.dev.device, self.hand_stream)
        hand.capture()

        def step(case: str) -> Any:
            batch = batches[case]
            return hand.run(batch["input_ids"].shape[0], **batch)

        variant = Variant("hand", step, close=hand.close)
        variant.capture_only_seconds = hand.capture_only_seconds
        variant.extra["hand"] = hand
        return variant

    def _prime_streams(self, forward: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor]) -> None:
        """Run once on each capture stream, so per-stream lazy state (the cuBLAS workspace) exists before
        any capture is measured and is charged to neither side."""
        if not self.dev.cuda:
            return
        platform = devgraph.resolve_platform(self.dev.device)
        for stream in (self.hand_stream, platform.new_stream()):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                forward(**batch)
            torch.cuda.current_stream().wait_stream(stream)
        self.dev.sync()

    def build_phase(self, phase: str, optional: str | None) -> list[Variant]:
        """Build the core variants of ``phase`` (``optional=None``), or one slow-to-compile one
        (``"inductor"``: tc_piecewise with inductor; ``"compile_ro"``: torch.compile reduce-overhead)."""
        model = self.model
        if phase == "decode":
            forward, build, sizes = model.decode_step, decode_runner, self.decode_sizes
            batches = self.decode_inputs
        else:
            forward, build, sizes = model.prefill_step, prefill_runner, self.prefill_sizes
            batches = self.prefill_inputs
        out = self.results[phase]
        plans: list[tuple[str, Callable[[], Variant], float]] = []
        if optional is None:
            plans.append(("hand", lambda: self._hand_variant(forward, sizes, batches), 0))
            for mode in ("full", "breakable"):
                plans.append((mode, lambda m=mode: self._runner_variant(m, build, batches, m, sizes), 0))
            plans.append(
                (
                    "tc_piecewise[eager]",
                    lambda: self._runner_variant(
                        "tc_piecewise[eager]", build, batches, "tc_piecewise", sizes, "eager"
                    ),
                    0,
                )
            )
        elif optional == "inductor" and self.args.inductor:
            name = "tc_piecewise[inductor]"
            plans.append(
                (
                    name,
                    lambda: self._runner_variant(name, build, batches, "tc_piecewise", sizes, "inductor"),
                    self.args.inductor_estimate,
                )
            )
        elif optional == "compile_ro" and phase == "decode":
            plans.append(("compile_ro", self._compile_ro_variant, self.args.inductor_estimate))
        elif optional == "anchors":
            plans.append(("hand", lambda: self._hand_variant(forward, sizes, batches), 0))
            plans.append(("full", lambda: self._runner_variant("full", build, batches, "full", sizes), 0))
        variants = []
        for name, make, estimate in plans:
            if estimate and not self.time_left(estimate + self.args.reserve):
                out["skipped"][name] = (
                    f"not run: {self.elapsed():.0f}s elapsed of a {self.args.time_budget}s budget"
                )
                log.warning("%s %s skipped (time budget)", phase, name)
                continue
            log.info("%s: building %s (t=%.0fs)", phase, name, self.elapsed())
            try:
                variant = measure_build(self.dev, make)
            except Exception as exc:
                self.error(f"{phase} {name} build", exc)
                continue
            out["variants"][name] = {
                "capture_seconds": round(variant.capture_seconds, 4),
                "capture_only_seconds": round(variant.capture_only_seconds, 4),
                "graph_bytes": variant.graph_bytes,
                "report_bytes": variant.report_bytes,
                **{k: v for k, v in variant.extra.items() if k not in ("runner", "hand", "compiled")},
            }
            log.info(
                "%s %s: capture %.2fs, graph memory %.1f MiB",
                phase,
                name,
                variant.capture_seconds,
                variant.graph_bytes / 2**20,
            )
            variants.append(variant)
            self.check(phase, variant, forward)
            self.save()
        return variants

    # -- torch.compile(mode="reduce-overhead") ---------------------------------------------------------
    def _compile_ro_variant(self) -> Variant:
        from torch._dynamo.utils import counters

        skips: list[str] = []

        class Catch(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                message = record.getMessage()
                if "skipping cudagraphs" in message:
                    skips.append(message[:500])

        handler = Catch()
        cg_log = torch._logging.getArtifactLogger("torch._inductor.cudagraph_utils", "cudagraphs")
        torch._logging.set_logs(cudagraphs=True)
        cg_log.addHandler(handler)
        skips_before = counters["inductor"]["cudagraph_skips"]
        mode = "reduce-overhead" if self.dev.cuda else None
        backend = "inductor" if self.dev.cuda else "eager"  # --smoke: the code path only
        compiled = torch.compile(self.model.decode_step, mode=mode, backend=backend)
        first_call: dict[str, float] = {}
        try:
            for case, batch in self.decode_inputs.items():
                t0 = time.perf_counter()
                for _ in range(3):  # cudagraph trees: warm-up run, then record, then replay
                    torch.compiler.cudagraph_mark_step_begin()
                    compiled(**batch)
                self.dev.sync()
                first_call[case] = round(time.perf_counter() - t0, 3)
        finally:
            cg_log.removeHandler(handler)
            torch._logging.set_logs()

        def step(case: str) -> Any:
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(**self.decode_inputs[case])

        variant = Variant("compile_ro", step)
        variant.extra["compile_and_record_seconds_per_batch"] = first_call
        variant.extra["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips_before
        variant.extra["skipping_cudagraphs_messages"] = skips
        return variant

    # -- correctness -----------------------------------------------------------------------------------
    def check(self, phase: str, variant: Variant, forward: Callable[..., torch.Tensor]) -> None:
        """Graph output vs eager: on the same padded batch (expect 0) and vs the phase's eager reference."""
        batches = self.decode_inputs if phase == "decode" else self.prefill_inputs
        refs = self.decode_refs if phase == "decode" else self.prefill_refs
        diffs: dict[str, Any] = {}
        try:
            for case, batch in batches.items():
                n = batch["input_ids"].shape[0]
                out = variant.step(case).clone()
                self.dev.sync()
                entry = {
                    "max_abs_vs_eager": max_abs(out, refs[case]),
                    "rel_err_vs_eager": rel_err(out, refs[case]),
                }
                runner = variant.extra.get("runner")
                hand = variant.extra.get("hand")
                if runner is not None:
                    result = runner.verify(n, None, **batch)
                    entry.update(
                        replayed=result.replayed,
                        size=result.size,
                        max_abs_vs_eager_same_padded_batch=result.max_abs_diff,
                    )
                elif hand is not None:
                    padded = hand.eager_padded(n).clone()
                    entry.update(
                        replayed=hand.bucket(n) is not None,
                        size=hand.bucket(n),
                        max_abs_vs_eager_same_padded_batch=max_abs(out, padded),
                    )
                diffs[case] = entry
        except Exception as exc:
            self.error(f"{phase} {variant.name} check", exc)
        self.results[phase]["diff"][variant.name] = diffs

    # -- phases ----------------------------------------------------------------------------------------
    def prepare_inputs(self) -> None:
        model = self.model
        self.decode_inputs = decode_batches(model, self.decode_batches, DECODE_SLOTS)
        self.prefill_inputs = prefill_batches(model, self.prefill_cases, DECODE_SLOTS)
        # Decode cases never write the same (row, position) and prefill uses rows decode never reads, so after
        # enough passes over the decode cases the cache is at a fixed point: every later step of any variant,
        # in any order, rewrites the same values, and these eager outputs are the reference for all of them.
        # A write at (row, p) depends on the writes at (row, p' < p), so settling takes as many passes as
        # a row has writes from different batches (at most one per batch).
        for _ in range(len(self.decode_inputs) + 1):
            for batch in self.decode_inputs.values():
                model.decode_step(**batch)
        self.decode_refs = {k: model.decode_step(**b).clone() for k, b in self.decode_inputs.items()}
        self.prefill_refs = {k: model.prefill_step(**b).clone() for k, b in self.prefill_inputs.items()}
        self.dev.sync()
        self._prime_streams(model.decode_step, next(iter(self.decode_inputs.values())))

    def eager_variant(self, phase: str) -> Variant:
        forward = self.model.decode_step if phase == "decode" else self.model.prefill_step
        batches = self.decode_inputs if phase == "decode" else self.prefill_inputs
        return Variant("eager", lambda case: forward(**batches[case]))

    def time_phase(self, phase: str, variants: list[Variant], key: str) -> None:
        cases = list(self.decode_inputs if phase == "decode" else self.prefill_inputs)
        iters = self.args.decode_iters if phase == "decode" else self.args.prefill_iters
        log.info("%s: timing %s over %s (t=%.0fs)", phase, [v.name for v in variants], cases, self.elapsed())
        try:
            medians, host = time_variants(variants, cases, self.dev, iters, self.args.rounds)
        except Exception as exc:
            self.error(f"{phase} timing", exc)
            return
        table = self.results[phase].setdefault(key, {})
        host_table = self.results[phase].setdefault(f"{key}_host_return", {})
        for name, per_case in medians.items():
            table[name] = {c: round(ms, 4) for c, ms in per_case.items()}
            host_table[name] = {c: round(ms, 4) for c, ms in host[name].items()}
        batches = self.decode_inputs if phase == "decode" else self.prefill_inputs
        for v in variants:
            runner = v.extra.get("runner")
            if runner is None:
                continue
            try:
                breakdown = {
                    case: segment_breakdown(runner, runner.bucket(b["input_ids"].shape[0]), self.dev)
                    for case, b in batches.items()
                }
            except Exception as exc:
                self.error(f"{phase} {v.name} breakdown", exc)
                continue
            if any(breakdown.values()):
                self.results[phase].setdefault("segment_breakdown", {})[v.name] = breakdown
        self.save()

    def run(self) -> None:
        log.info("model built in %.1fs on %s", self.model_seconds, self.dev.name())
        self.prepare_inputs()
        if self.args.compile_ro_only:
            self.run_compile_ro_only()
            return
        built: dict[str, list[Variant]] = {}
        for phase in ("decode", "prefill"):
            built[phase] = [self.eager_variant(phase)] + self.build_phase(phase, optional=None)
            self.time_phase(phase, built[phase], "latency_ms")
        # Slow-to-compile variants last, each skipped if it would not fit the time budget; then each phase
        # is timed again with eager, hand and full, so the ratios come from one loop.
        extra: dict[str, list[Variant]] = {"decode": [], "prefill": []}
        for phase in ("prefill", "decode"):
            extra[phase] += self.build_phase(phase, optional="inductor")
        for phase, variants in extra.items():
            if variants:
                anchors = [v for v in built[phase] if v.name in ("eager", "hand", "full")]
                self.time_phase(phase, anchors + variants, "latency_ms_optional")
            built[phase] += variants
        for variants in built.values():
            for v in variants:
                try:
                    v.close()
                except Exception as exc:
                    self.error(f"close {v.name}", exc)
        if self.args.compile:
            self.run_compile_ro_child()
        self.results["targets"] = targets(self.results)
        self.save()
        print_summary(self.results)

    # -- torch.compile(mode="reduce-overhead") in its own process ---------------------------------------
    # CUDA graph trees call torch._C._cuda_clearCublasWorkspaces() around every warm-up and recording, which
    # frees the cuBLAS workspace that graphs captured earlier in the process (hand-written or devgraph) keep
    # using: their next replays write into freed memory (an illegal memory access on the H100 in our first
    # run). So compile_ro gets a process of its own, where it records before the anchors are captured.
    def run_compile_ro_child(self) -> None:
        import subprocess

        left = self.args.time_budget - self.elapsed()
        if left < self.args.inductor_estimate + self.args.reserve:
            self.results["decode"]["skipped"]["compile_ro"] = f"not run: {left:.0f}s of the time budget left"
            return
        out = Path(self.args.out).with_suffix(".compile_ro.json")
        command = [
            sys.executable,
            __file__,
            "--compile-ro-only",
            "--out",
            str(out),
            "--time-budget",
            str(int(left - 10)),
            "--decode-iters",
            str(self.args.decode_iters),
            "--rounds",
            str(self.args.rounds),
            "--max-seq-len",
            str(self.args.max_seq_len),
        ]
        if self.args.smoke:
            command.append("--smoke")
        log.info("decode: compile_ro in a child process (t=%.0fs): %s", self.elapsed(), " ".join(command))
        try:
            subprocess.run(command, check=True, timeout=max(30.0, left))
            child = json.loads(out.read_text())
        except Exception as exc:
            self.error("compile_ro child process", exc)
            return
        dec, cdec = self.results["decode"], child["decode"]
        if "compile_ro" in cdec["variants"]:
            dec["variants"]["compile_ro"] = cdec["variants"]["compile_ro"]
        if "compile_ro" in cdec["diff"]:
            dec["diff"]["compile_ro"] = cdec["diff"]["compile_ro"]
        for key in ("latency_ms_compile_ro", "latency_ms_compile_ro_host_return"):
            if key in cdec:
                dec[key] = cdec[key]
        dec["compile_ro_process"] = {
            "note": "own process: compile_ro first, then hand and full captured, then all timed together",
            "anchors": {k: v for k, v in cdec["variants"].items() if k != "compile_ro"},
            "skipped": cdec["skipped"],
            "elapsed_s": child["meta"].get("elapsed_s"),
        }
        self.results["errors"] += [f"compile_ro process: {e}" for e in child["errors"]]

    def run_compile_ro_only(self) -> None:
        """The child: compile_ro records all its graphs, then hand and full capture, then all are timed."""
        variants = [self.eager_variant("decode")]
        variants += self.build_phase("decode", optional="compile_ro")
        variants += self.build_phase("decode", optional="anchors")
        self.time_phase("decode", variants, "latency_ms_compile_ro")
        self.save()


# -- targets and summary -------------------------------------------------------------------------------
def _loop_of(section: dict[str, Any], name: str) -> dict[str, dict[str, float]]:
    """The timing loop ``name`` was measured in (its anchors, eager/hand/full, were timed in it too)."""
    for key in ("latency_ms", "latency_ms_optional", "latency_ms_compile_ro"):
        if name in section.get(key, {}):
            return section[key]
    return {}


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each with the measured ratios (same timing loop) and whether it is met."""
    out: dict[str, Any] = {}
    dec, pre = results["decode"], results["prefill"]
    for name in ("full", "breakable", "tc_piecewise[eager]", "tc_piecewise[inductor]", "compile_ro"):
        loop = _loop_of(dec, name)
        lat, hand = loop.get(name), loop.get("hand")
        if lat and hand:
            ratios = {c: round(lat[c] / hand[c], 3) for c in lat if c in hand}
            out[f"decode_latency_vs_hand[{name}]"] = {
                "ratios": ratios,
                "limit": "<= 1.05",
                "met": all(r <= 1.05 for r in ratios.values()),
            }
    hv, fv = dec["variants"].get("hand"), dec["variants"].get("full")
    if hv and fv:
        t = fv["capture_seconds"] / max(hv["capture_seconds"], 1e-9)
        m = fv["graph_bytes"] / max(hv["graph_bytes"], 1)
        out["decode_capture_seconds_full_vs_hand"] = {
            "ratio": round(t, 3),
            "limit": "<= 1.2",
            "met": t <= 1.2,
        }
        out["decode_graph_bytes_full_vs_hand"] = {"ratio": round(m, 3), "limit": "<= 1.1", "met": m <= 1.1}
    for name in ("breakable", "tc_piecewise[eager]", "tc_piecewise[inductor]"):
        loop = _loop_of(pre, name)
        lat, eager, full = loop.get(name), loop.get("eager", {}), loop.get("hand", {})
        if not lat:
            continue
        small = [c for c in lat if sum(int(x) for x in c.split("+")) <= 512]
        speedup = {c: round(eager[c] / lat[c], 3) for c in small if c in eager}
        vs_full = {c: round(lat[c] / full[c], 3) for c in small if c in full}
        out[f"prefill_speedup_vs_eager[{name}]"] = {
            "ratios": speedup,
            "limit": ">= 2",
            "met": all(r >= 2 for r in speedup.values()),
        }
        out[f"prefill_latency_vs_full_graph[{name}]"] = {
            "ratios": vs_full,
            "limit": "<= 1.5",
            "met": all(r <= 1.5 for r in vs_full.values()),
        }
    exact = {}
    for phase in ("decode", "prefill"):
        for name, per_case in results[phase]["diff"].items():
            exact[f"{phase}/{name}"] = {
                "same_padded_batch": max(
                    (e.get("max_abs_vs_eager_same_padded_batch", float("nan")) for e in per_case.values()),
                    default=None,
                ),
                "vs_eager_reference": max((e["max_abs_vs_eager"] for e in per_case.values()), default=None),
                "rel_err_vs_eager_reference": max(
                    (e["rel_err_vs_eager"] for e in per_case.values()), default=None
                ),
            }
    out["max_abs_diff"] = exact
    return out


def print_summary(results: dict[str, Any]) -> None:
    for phase in ("decode", "prefill"):
        section = results[phase]
        merged: dict[str, dict[str, float]] = {}
        for key in ("latency_ms", "latency_ms_optional", "latency_ms_compile_ro"):
            for name, per_case in section.get(key, {}).items():
                if key == "latency_ms_compile_ro" and name != "compile_ro":
                    name = f"{name}(ro-process)"
                merged.setdefault(name if key == "latency_ms" else f"{name}*", per_case)
        if not merged:
            continue
        cases = list(next(iter(merged.values())))
        print(f"\n{phase} median ms ({', '.join(cases)})   capture s   graph MiB   max|diff| padded")
        for name, per_case in merged.items():
            v = section["variants"].get(name.rstrip("*"), {})
            diffs = section["diff"].get(name.rstrip("*"), {})
            worst = max(
                (e.get("max_abs_vs_eager_same_padded_batch", e["max_abs_vs_eager"]) for e in diffs.values()),
                default=float("nan"),
            )
            times = " ".join(f"{per_case.get(c, float('nan')):8.3f}" for c in cases)
            print(
                f"  {name:24s} {times}   {v.get('capture_seconds', 0):7.2f}   "
                f"{v.get('graph_bytes', 0) / 2**20:8.1f}   {worst:.3g}"
            )
    print("\ntargets:")
    for key, value in results.get("targets", {}).items():
        print(f"  {key}: {value}")
    if results["errors"]:
        print("\nerrors:")
        for e in results["errors"]:
            print("  " + e.splitlines()[0])


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (simulated graphs)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cuda.json)")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--decode-iters", type=int, default=100)
    parser.add_argument("--prefill-iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--no-inductor",
        dest="inductor",
        action="store_false",
        help="skip tc_piecewise with the inductor compiler",
    )
    parser.add_argument("--compile-ro-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help='skip torch.compile(mode="reduce-overhead")',
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=480.0,
        help="seconds; slow-to-compile variants are skipped when they would not fit",
    )
    parser.add_argument(
        "--inductor-estimate",
        type=float,
        default=90.0,
        help="seconds one inductor variant is expected to take to compile and capture",
    )
    parser.add_argument("--reserve", type=float, default=40.0, help="seconds kept for timing after a build")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = (
            str(Path(tempfile.gettempdir()) / "devgraph-bench-smoke.json")
            if args.smoke
            else "benchmarks/results/cuda.json"
        )
    if args.smoke:
        args.decode_iters, args.prefill_iters, args.rounds = (
            min(args.decode_iters, 6),
            min(args.prefill_iters, 4),
            2,
        )
    elif not torch.cuda.is_available():
        parser.error("no CUDA GPU here; use --smoke to check the script on the CPU")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    bench = Bench(args)
    bench.run()
    print(f"\nwrote {args.out} in {bench.elapsed():.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
