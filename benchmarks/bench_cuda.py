"""devgraph on an NVIDIA GPU against eager, hand-written CUDA graphs and torch.compile(mode="reduce-overhead").

One process, one model, the same inputs for every variant::

    python benchmarks/bench_cuda.py --out benchmarks/results/h100.json      # on the GPU
    python benchmarks/bench_cuda.py --smoke                                 # CPU check of the script itself

Model: the reference decoder shaped like Qwen3-0.6B (28 layers, hidden 1024, 16 heads, 8 KV heads, head dim
128, intermediate 3072, vocab 151936), bf16, random weights, a KV cache of 64 requests x 2048 positions.

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
    make_decode_batch,
    make_prefill_batch,
    padding_fill,
    prefill_runner,
)
from devgraph.runner import GraphRunner

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
WARMUP_ITERS = 2  # the runner's default; the hand-written capture uses the same


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
        self.static = {name: torch.full((top,), fills[name], dtype=torch.int64, device=device) for name in fills}
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
) -> dict[str, dict[str, float]]:
    """Median ms per (variant, case); variants interleaved in ``rounds`` so drift hits them alike."""
    samples: dict[str, dict[str, list[float]]] = {v.name: {c: [] for c in cases} for v in variants}
    per_round = max(1, iters // rounds)
    for case in cases:
        for v in variants:  # warm-up: first calls, allocator growth, lazy inits
            for _ in range(3):
                v.step(case)
        dev.sync()
        for _ in range(rounds):
            for v in variants:
                bucket = samples[v.name][case]
                for _ in range(per_round):
                    dev.sync()
                    t0 = time.perf_counter()
                    v.step(case)
                    dev.sync()
                    bucket.append((time.perf_counter() - t0) * 1e3)
    return {name: {c: statistics.median(s) for c, s in per_case.items()} for name, per_case in samples.items()}


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
            config = ReferenceConfig.preset("tiny")
        else:
            config = ReferenceConfig.preset(
                "qwen3-0.6b", max_requests=args.max_requests, max_seq_len=args.max_seq_len
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
            "timing": "median of per-step synchronize + perf_counter wall times, variants interleaved in rounds",
            "graph_bytes": "growth of torch.cuda.memory_reserved across capture, allocator cache emptied around",
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
        self, name: str, build: Callable[..., GraphRunner], batches: Mapping[str, dict[str, torch.Tensor]],
        mode: str, sizes: Sequence[int], compiler: str | None = None,
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
        variant.extra["report"] = [{"size": s.size, "seconds": s.seconds, "bytes": s.bytes} for s in report.sizes]
        backend = runner.backend
        if hasattr(backend, "compiles"):
            variant.extra["compiles"] = backend.compiles
            variant.extra["recompiles"] = backend.recompiles
        return variant

    def _hand_variant(self, forward: Callable[..., torch.Tensor], sizes: Sequence[int],
                      batches: Mapping[str, dict[str, torch.Tensor]]) -> Variant:
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

    def build_phase(self, phase: str, optional: bool) -> list[Variant]:
        """Build the variants of ``phase``: the core ones, or (``optional``) the slow-to-compile ones."""
        model = self.model
        if phase == "decode":
            forward, build, sizes = model.decode_step, decode_runner, self.decode_sizes
            batches = self.decode_inputs
        else:
            forward, build, sizes = model.prefill_step, prefill_runner, self.prefill_sizes
            batches = self.prefill_inputs
        out = self.results[phase]
        plans: list[tuple[str, Callable[[], Variant], float]] = []
        if not optional:
            plans.append(("hand", lambda: self._hand_variant(forward, sizes, batches), 0))
            for mode in ("full", "breakable"):
                plans.append((mode, lambda m=mode: self._runner_variant(m, build, batches, m, sizes), 0))
            plans.append(("tc_piecewise[eager]", lambda: self._runner_variant(
                "tc_piecewise[eager]", build, batches, "tc_piecewise", sizes, "eager"), 0))
        else:
            if self.args.inductor:
                plans.append(("tc_piecewise[inductor]", lambda: self._runner_variant(
                    "tc_piecewise[inductor]", build, batches, "tc_piecewise", sizes, "inductor"),
                    self.args.inductor_estimate))
            if phase == "decode" and self.args.compile:
                plans.append(("compile_ro", self._compile_ro_variant, self.args.inductor_estimate))
        variants = []
        for name, make, estimate in plans:
            if estimate and not self.time_left(estimate + self.args.reserve):
                out["skipped"][name] = f"not run: {self.elapsed():.0f}s elapsed of a {self.args.time_budget}s budget"
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
            log.info("%s %s: capture %.2fs, graph memory %.1f MiB", phase, name, variant.capture_seconds,
                     variant.graph_bytes / 2**20)
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
                entry = {"max_abs_vs_eager": max_abs(out, refs[case]), "rel_err_vs_eager": rel_err(out, refs[case])}
                runner = variant.extra.get("runner")
                hand = variant.extra.get("hand")
                if runner is not None:
                    result = runner.verify(n, None, **batch)
                    entry.update(replayed=result.replayed, size=result.size,
                                 max_abs_vs_eager_same_padded_batch=result.max_abs_diff)
                elif hand is not None:
                    padded = hand.eager_padded(n).clone()
                    entry.update(replayed=hand.bucket(n) is not None, size=hand.bucket(n),
                                 max_abs_vs_eager_same_padded_batch=max_abs(out, padded))
                diffs[case] = entry
        except Exception as exc:
            self.error(f"{phase} {variant.name} check", exc)
        self.results[phase]["diff"][variant.name] = diffs

    # -- phases ----------------------------------------------------------------------------------------
    def prepare_inputs(self) -> None:
        model = self.model
        self.decode_inputs = {str(n): make_decode_batch(model, n, seed=n) for n in self.decode_batches}
        self.prefill_inputs = {
            "+".join(map(str, lens)): make_prefill_batch(model, list(lens), seed=len(lens))
            for lens in self.prefill_cases
        }
        # Steps are idempotent: a step writes K/V that depend only on its own tokens and positions, so
        # every variant sees the same cache and these eager outputs are the reference for all of them.
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
            medians = time_variants(variants, cases, self.dev, iters, self.args.rounds)
        except Exception as exc:
            self.error(f"{phase} timing", exc)
            return
        table = self.results[phase].setdefault(key, {})
        for name, per_case in medians.items():
            table[name] = {c: round(ms, 4) for c, ms in per_case.items()}
        self.save()

    def run(self) -> None:
        log.info("model built in %.1fs on %s", self.model_seconds, self.dev.name())
        self.prepare_inputs()
        built: dict[str, list[Variant]] = {}
        for phase in ("decode", "prefill"):
            built[phase] = [self.eager_variant(phase)] + self.build_phase(phase, optional=False)
            self.time_phase(phase, built[phase], "latency_ms")
        # Slow-to-compile variants last, each phase timed again together with eager, hand and full, so
        # their ratios come from one loop.
        for phase in ("prefill", "decode"):
            extra = self.build_phase(phase, optional=True)
            if extra:
                anchors = [v for v in built[phase] if v.name in ("eager", "hand", "full")]
                self.time_phase(phase, anchors + extra, "latency_ms_optional")
            built[phase] += extra
        self.results["targets"] = targets(self.results)
        self.save()
        for variants in built.values():
            for v in variants:
                try:
                    v.close()
                except Exception as exc:
                    self.error(f"close {v.name}", exc)
        print_summary(self.results)


# -- targets and summary -------------------------------------------------------------------------------
def _latency(results: dict[str, Any], phase: str, name: str) -> dict[str, float] | None:
    section = results[phase]
    return section.get("latency_ms", {}).get(name) or section.get("latency_ms_optional", {}).get(name)


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each with the measured ratio and whether it is met."""
    out: dict[str, Any] = {}
    dec, pre = results["decode"], results["prefill"]
    hand = dec["latency_ms"].get("hand", {})
    for name in ("full", "breakable", "tc_piecewise[eager]", "tc_piecewise[inductor]"):
        lat = _latency(results, "decode", name)
        if lat and hand:
            ratios = {c: round(lat[c] / hand[c], 3) for c in lat if c in hand}
            out[f"decode_run_vs_hand[{name}]"] = {"ratios": ratios, "limit": 1.05,
                                                   "met": all(r <= 1.05 for r in ratios.values())}
    hv, fv = dec["variants"].get("hand"), dec["variants"].get("full")
    if hv and fv:
        t = fv["capture_seconds"] / max(hv["capture_seconds"], 1e-9)
        m = fv["graph_bytes"] / max(hv["graph_bytes"], 1)
        out["decode_capture_seconds_full_vs_hand"] = {"ratio": round(t, 3), "limit": 1.2, "met": t <= 1.2}
        out["decode_graph_bytes_full_vs_hand"] = {"ratio": round(m, 3), "limit": 1.1, "met": m <= 1.1}
    eager = pre["latency_ms"].get("eager", {})
    full = pre["latency_ms"].get("hand", {})
    small = [c for c in eager if sum(int(x) for x in c.split("+")) <= 512]
    for name in ("breakable", "tc_piecewise[eager]", "tc_piecewise[inductor]"):
        lat = _latency(results, "prefill", name)
        if not lat:
            continue
        speedup = {c: round(eager[c] / lat[c], 3) for c in small if c in lat}
        vs_full = {c: round(lat[c] / full[c], 3) for c in small if c in lat and c in full}
        out[f"prefill_speedup_vs_eager[{name}]"] = {"ratios": speedup, "limit": ">= 2",
                                                     "met": all(r >= 2 for r in speedup.values())}
        out[f"prefill_vs_full_graph[{name}]"] = {"ratios": vs_full, "limit": "<= 1.5",
                                                  "met": all(r <= 1.5 for r in vs_full.values())}
    exact = {}
    for phase in ("decode", "prefill"):
        for name, per_case in results[phase]["diff"].items():
            worst = max((e.get("max_abs_vs_eager_same_padded_batch", e["max_abs_vs_eager"])
                         for e in per_case.values()), default=None)
            exact[f"{phase}/{name}"] = worst
    out["max_abs_diff_vs_eager_same_padded_batch"] = exact
    return out


def print_summary(results: dict[str, Any]) -> None:
    for phase in ("decode", "prefill"):
        section = results[phase]
        merged: dict[str, dict[str, float]] = {}
        for key in ("latency_ms", "latency_ms_optional"):
            for name, per_case in section.get(key, {}).items():
                merged.setdefault(name if key == "latency_ms" else f"{name}*", per_case)
        if not merged:
            continue
        cases = list(next(iter(merged.values())))
        print(f"\n{phase} median ms ({', '.join(cases)})   capture s   graph MiB   max|diff| padded")
        for name, per_case in merged.items():
            v = section["variants"].get(name.rstrip("*"), {})
            diffs = section["diff"].get(name.rstrip("*"), {})
            worst = max((e.get("max_abs_vs_eager_same_padded_batch", e["max_abs_vs_eager"])
                         for e in diffs.values()), default=float("nan"))
            times = " ".join(f"{per_case.get(c, float('nan')):8.3f}" for c in cases)
            print(f"  {name:24s} {times}   {v.get('capture_seconds', 0):7.2f}   "
                  f"{v.get('graph_bytes', 0) / 2**20:8.1f}   {worst:.3g}")
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
    parser.add_argument("--max-requests", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--decode-iters", type=int, default=100)
    parser.add_argument("--prefill-iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-inductor", dest="inductor", action="store_false",
                        help="skip tc_piecewise with the inductor compiler")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help='skip torch.compile(mode="reduce-overhead")')
    parser.add_argument("--time-budget", type=float, default=480.0,
                        help="seconds; slow-to-compile variants are skipped when they would not fit")
    parser.add_argument("--inductor-estimate", type=float, default=90.0,
                        help="seconds one inductor variant is expected to take to compile and capture")
    parser.add_argument("--reserve", type=float, default=40.0, help="seconds kept for timing after a build")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = "benchmarks/results/smoke.json" if args.smoke else "benchmarks/results/cuda.json"
    if args.smoke:
        args.decode_iters, args.prefill_iters, args.rounds = min(args.decode_iters, 6), min(args.prefill_iters, 4), 2
    elif not torch.cuda.is_available():
        parser.error("no CUDA GPU here; use --smoke to check the script on the CPU")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    bench = Bench(args)
    bench.run()
    print(f"\nwrote {args.out} in {bench.elapsed():.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
