"""devgraph on an NVIDIA GPU: decode, packed prefill and speculative verify on the paged reference model,
against eager, hand-written CUDA graphs, torch.compile(mode="reduce-overhead") and the bandwidth floor.

    python benchmarks/bench_decode.py          # GPU: $OUT/decode.json + .png (else benchmarks/results/)
    python benchmarks/bench_decode.py --smoke  # the whole script on the CPU, tiny preset, under a minute

Model: ``devgraph.reference`` preset ``qwen3-0.6b`` (28 layers, bf16, random weights), paged KV cache of
16-token blocks filled with random values; ``paged`` attention (Triton kernels over device metadata) and a
twin sharing its weights and cache with ``sdpa`` attention (a break op fed host lengths). Every batch reads
read-only context blocks and writes private blocks (:class:`bench_common.KVPlan`), so each step's output is a
pure function of its inputs and one eager output per case is the reference for every variant.

Sections (one process unless said; each variant's failure is recorded and the run goes on):

1. decode, batch 1/8/32/64 x context 512/2048 (captured sizes 1, 8, 32, 64): eager (paged, sdpa), hand-written
   ``torch.cuda.CUDAGraph``, devgraph ``full``, ``full`` + inductor, ``breakable`` and ``tc_piecewise`` with
   each attention; ``torch.compile(model.decode_step, mode="reduce-overhead")`` in a process of its own (CUDA
   graph trees free the cuBLAS workspaces graphs captured earlier use: ``benchmarks/README.md``), timed there
   with eager, hand and ``full`` again. Warm-up seconds (compile + capture of the four sizes) of both.
2. packed prefill 1x32, 1x128, 1x512, 4x128 (captured 32, 128, 512 tokens): eager, hand, ``full``,
   ``breakable`` and ``tc_piecewise`` (paged and sdpa); graph memory per mode.
3. verify (speculative decoding, k = 3, context 512) at batch 1/8/32: eager, hand, ``verify_runner``.
4. host time: ``run()`` at batch 1 (with its lock and with a no-op lock), and per break op (``breakable`` with
   N trivial breaks against the same forward as one ``full`` graph).
5. warm-ups: ``full`` / ``breakable`` / ``tc_piecewise`` / hand captured with 0, 1 and 2 warm-ups per size
   (capture time and correctness), and the same for the very first capture of a fresh process (own processes,
   4 layers).

Latency: CUDA events around each step (from the host starting it to its last kernel), median over steps, the
variants interleaved in rounds; ``host_ms`` is the time until the step returns. Each process compiles into
its own empty inductor and Triton cache (a cold start). The floor of a step: weights read once + KV read +
activations, at the bandwidth of a large device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_common import (
    Batch,
    Budget,
    Device,
    HandGraphs,
    KVPlan,
    Panel,
    Report,
    Target,
    Variant,
    copy_bandwidth,
    diff,
    environment,
    floor_ms,
    host_us,
    measure_build,
    output_path,
    plot_panels,
    step_bytes,
    targets_table,
    time_cases,
)

from devgraph import GraphRunner, StaticInput, forward_context, graph_break
from devgraph.contract.keys import TOKENS
from devgraph.reference import (
    ReferenceConfig,
    ReferenceModel,
    StepContext,
    batch_context,
    decode_runner,
    prefill_runner,
    reference_inputs,
    verify_runner,
)

log = logging.getLogger("bench_decode")


# -- what to run ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    preset: str
    decode_batches: tuple[int, ...]  # also the captured decode sizes
    contexts: tuple[int, ...]
    prefill_cases: tuple[tuple[int, ...], ...]
    prefill_sizes: tuple[int, ...]
    verify_batches: tuple[int, ...]
    verify_context: int
    draft_tokens: int
    iters: int
    rounds: int
    warm_steps: int
    host_iters: int
    breaks: int
    probe_layers: int
    layers: int | None  # None: the preset's
    max_requests: int | None  # None: the preset's (also the prefill request bucket)
    warmups: tuple[int, ...]
    private_blocks: int
    bandwidth_bytes: int
    compiler: str  # of the compiled full variant and of the reduce-overhead stand-in
    budget_s: float


GPU = Plan(
    preset="qwen3-0.6b",
    decode_batches=(1, 8, 32, 64),
    contexts=(512, 2048),
    prefill_cases=((32,), (128,), (512,), (128, 128, 128, 128)),
    prefill_sizes=(32, 128, 512),
    verify_batches=(1, 8, 32),
    verify_context=512,
    draft_tokens=3,
    iters=40,
    rounds=4,
    warm_steps=3,
    host_iters=400,
    breaks=28,
    probe_layers=4,
    layers=None,
    max_requests=None,
    warmups=(0, 1, 2),
    private_blocks=512,
    bandwidth_bytes=1 << 30,
    compiler="inductor",
    budget_s=300.0,
)
SMOKE = Plan(
    preset="tiny",
    decode_batches=(1, 4),
    contexts=(40, 200),
    prefill_cases=((8,), (16,), (4, 4, 4, 4)),
    prefill_sizes=(16,),
    verify_batches=(1, 2),
    verify_context=64,
    draft_tokens=3,
    iters=2,
    rounds=1,
    warm_steps=1,
    host_iters=20,
    breaks=4,
    probe_layers=1,
    layers=1,
    max_requests=8,  # the torch reference prefill attention loops over the request bucket
    warmups=(0, 2),
    private_blocks=128,
    bandwidth_bytes=32 << 20,
    compiler="eager",  # inductor's CPU code generation takes minutes on two cores
    budget_s=600.0,
)


def decode_case(batch: int, context: int) -> str:
    return f"b{batch}@{context}"


def prefill_case(lens: Sequence[int]) -> str:
    return f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens))


# -- the model, its sdpa twin and the inputs -----------------------------------------------------------------
def attention_twin(model: ReferenceModel, attention: str) -> ReferenceModel:
    """The same model (the very same weight and cache tensors) with another attention."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, shared)
    twin.config = dataclasses.replace(model.config, attention=attention)
    for layer in twin.layers:
        layer.attention = attention
    if twin.layers[0].k_cache is not model.layers[0].k_cache or twin.embed is not model.embed:
        raise RuntimeError("the attention twin must share the model's tensors")
    return twin


@dataclass
class Setup:
    plan: Plan
    dev: Device
    models: dict[str, ReferenceModel]  # attention -> model
    batches: dict[str, dict[str, Batch]]  # phase -> case -> batch
    contexts: dict[str, dict[str, StepContext]] = field(default_factory=dict)
    refs: dict[str, dict[str, dict[str, torch.Tensor]]] = field(default_factory=dict)  # phase/attn/case
    build_s: float = 0.0

    @property
    def paged(self) -> ReferenceModel:
        return self.models["paged"]

    def forward(self, phase: str, attention: str) -> Callable[..., torch.Tensor]:
        model = self.models[attention]
        return {"decode": model.decode_step, "prefill": model.prefill_step, "verify": model.verify_step}[
            phase
        ]

    def eager(self, phase: str, attention: str, case: str) -> torch.Tensor:
        context = self.contexts[phase][case] if attention == "sdpa" else None
        with forward_context(context):
            return self.forward(phase, attention)(**self.batches[phase][case])

    def compute_refs(self) -> None:
        for phase, cases in self.batches.items():
            for attention in self.models if phase != "verify" else ("paged",):
                self.refs.setdefault(phase, {})[attention] = {
                    case: self.eager(phase, attention, case).clone() for case in cases
                }
        self.dev.sync()


def build_setup(
    plan: Plan,
    device: torch.device,
    *,
    layers: int | None = None,
    phases: Sequence[str] = ("decode", "prefill", "verify"),
    refs: bool = True,
) -> Setup:
    """Model (+ sdpa twin), random cache, every batch made in a fixed order (the same blocks in every
    process), then only ``phases`` kept; eager references unless ``refs=False``."""
    t0 = time.perf_counter()
    overrides: dict[str, Any] = {"attention": "paged"}
    layers = layers if layers is not None else plan.layers
    if layers is not None:
        overrides["num_layers"] = layers
    if plan.max_requests is not None:
        overrides["max_requests"] = plan.max_requests
    base = ReferenceConfig.preset(plan.preset, **overrides)
    kv = KVPlan(base, plan.private_blocks)
    model = ReferenceModel(kv.config(base), device=device, seed=0)
    model.randomize_cache(seed=1)
    models = {"paged": model, "sdpa": attention_twin(model, "sdpa")}
    seed = iter(range(10_000))
    batches: dict[str, dict[str, Batch]] = {"decode": {}, "prefill": {}, "verify": {}}
    for context in plan.contexts:
        for b in plan.decode_batches:
            batches["decode"][decode_case(b, context)] = kv.decode(model, b, context, next(seed))
    for lens in plan.prefill_cases:
        batches["prefill"][prefill_case(lens)] = kv.prefill(model, lens, None, next(seed))
    tpr = plan.draft_tokens + 1
    for b in plan.verify_batches:
        prefixes = [plan.verify_context - tpr] * b
        batches["verify"][decode_case(b, plan.verify_context)] = kv.prefill(
            model, [tpr] * b, prefixes, next(seed)
        )
    batches = {phase: batches[phase] for phase in phases}
    setup = Setup(plan, Device(device), models, batches)
    setup.contexts = {
        phase: {c: batch_context(b) for c, b in cases.items()} for phase, cases in batches.items()
    }
    if refs:
        setup.compute_refs()
    setup.build_s = time.perf_counter() - t0
    return setup


# -- runners and variants ------------------------------------------------------------------------------------
def phase_sizes(plan: Plan, phase: str) -> list[int]:
    if phase == "decode":
        return list(plan.decode_batches)
    if phase == "prefill":
        return list(plan.prefill_sizes)
    return [b * (plan.draft_tokens + 1) for b in plan.verify_batches]


def make_runner(setup: Setup, phase: str, attention: str, mode: str, **kwargs: Any) -> GraphRunner:
    """A devgraph runner; ``mode`` is a strategy name or a ``--device-graph-mode`` JSON value."""
    model = setup.models[attention]
    choice = {"config": mode} if mode.startswith("{") else {"mode": mode}
    common = {"sizes": phase_sizes(setup.plan, phase), "progress": False, **choice, **kwargs}
    if phase == "decode":
        return decode_runner(model, **common)
    if phase == "prefill":
        return prefill_runner(model, **common)
    return verify_runner(model, setup.plan.draft_tokens + 1, **common)


def runner_info(runner: GraphRunner, seconds: float, nbytes: int) -> dict[str, Any]:
    inspect = runner.inspect()
    report = runner.report
    info = {
        "backend": runner.backend.name,
        "mode": inspect.get("mode"),
        "warmup_iters": runner.warmup_iters,
        "capture_s": round(seconds, 3),
        "capture_report_s": round(report.seconds, 3) if report else None,
        "capture_only_s": round(sum(k.seconds for k in report.keys), 4) if report else None,
        "graph_bytes": nbytes,
        "graph_MiB": round(nbytes / 2**20, 1),
        "pool_bytes_reported": report.bytes if report else None,
        "keys": [str(k.key) for k in report.keys] if report else [],
    }
    for name in ("compiler", "compiles", "recompiles", "pieces", "break_ops", "artifact_cache"):
        if name in inspect:
            info[name] = inspect[name]
    segments = {k: v.get("segments") for k, v in inspect.get("keys", {}).items()}
    if segments:
        info["segments_per_key"] = segments
    return info


def runner_variant(setup: Setup, phase: str, name: str, attention: str, mode: str, **kwargs: Any) -> Variant:
    holder: list[GraphRunner] = []

    def build() -> GraphRunner:
        runner = make_runner(setup, phase, attention, mode, **kwargs)
        holder.append(runner)
        runner.capture()
        return runner

    try:
        runner, seconds, nbytes = measure_build(setup.dev, build)
    except BaseException:
        for r in holder:
            r.close()
        raise
    batches, contexts = setup.batches[phase], setup.contexts[phase]
    sdpa = attention == "sdpa"

    def step(case: str) -> Any:
        return runner.run(context=contexts[case] if sdpa else None, **batches[case])

    info = {"attention": attention, **runner_info(runner, seconds, nbytes)}
    return Variant(name, step, info, runner.close, runner)


def hand_keys(setup: Setup, phase: str) -> list[tuple[int, int]]:
    plan, tpr = setup.plan, setup.plan.draft_tokens + 1
    if phase == "decode":
        return [(b, b) for b in plan.decode_batches]
    if phase == "verify":
        return [(b * tpr, b) for b in plan.verify_batches]
    return [(t, min(t, setup.paged.config.max_requests)) for t in plan.prefill_sizes]  # = prefill_runner's


def hand_variant(setup: Setup, phase: str, warmup_iters: int = 2) -> Variant:
    def build() -> HandGraphs:  # buffers and capture timed together, as for a runner
        graphs = HandGraphs(
            setup.forward(phase, "paged"),
            reference_inputs(setup.paged, phase),
            hand_keys(setup, phase),
            setup.dev.device,
            warmup_iters=warmup_iters,
            out_axis="requests" if phase == "prefill" else TOKENS,
        )
        graphs.capture()
        return graphs

    hand, seconds, nbytes = measure_build(setup.dev, build)
    batches = setup.batches[phase]
    info = {
        "attention": "paged",
        "warmup_iters": warmup_iters,
        "capture_s": round(seconds, 3),
        "capture_only_s": round(hand.capture_only_seconds, 4),
        "graph_bytes": nbytes,
        "graph_MiB": round(nbytes / 2**20, 1),
    }
    return Variant("hand", lambda case: hand.run(batches[case]), info, hand.close, hand)


def eager_variant(setup: Setup, phase: str, attention: str) -> Variant:
    name = "eager" if attention == "paged" else "eager_sdpa"
    return Variant(name, lambda case: setup.eager(phase, attention, case), {"attention": attention})


def check_variant(setup: Setup, phase: str, v: Variant) -> dict[str, Any]:
    """Per case: the variant's output against eager on the same padded step (``verify`` for runners) and
    against the eager reference of its attention (other kernels, e.g. inductor's, round differently)."""
    attention = v.info.get("attention", "paged")
    refs = setup.refs[phase][attention]
    out: dict[str, Any] = {}
    for case, batch in setup.batches[phase].items():
        entry: dict[str, Any] = {}
        if isinstance(v.runner, GraphRunner):
            context = setup.contexts[phase][case] if attention == "sdpa" else None
            result = v.runner.verify(context=context, **batch)
            entry.update(
                ok=result.ok,
                replayed=result.replayed,
                max_abs_same_padded=result.max_abs_diff,
                max_abs_unpadded=result.max_abs_diff_unpadded,
                scale=result.scale,
            )
            output = v.runner.run(context=context, copy=True, **batch)
        elif isinstance(v.runner, HandGraphs):
            output = v.runner.run(batch).clone()
            entry["max_abs_same_padded"] = diff(output, v.runner.eager_padded(batch))["max_abs"]
        else:
            output = v.step(case)
        entry["vs_eager_reference"] = diff(output, refs[case])
        out[case] = entry
    setup.dev.sync()
    return out


# -- the benchmark -------------------------------------------------------------------------------------------
class NoLock:
    """Stands in for the runner's lock to measure what the real one costs."""

    def __enter__(self) -> NoLock:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_ADD_ONE: Any = None


def add_one_break() -> Any:
    """A trivial break op (registered once per process)."""
    global _ADD_ONE
    if _ADD_ONE is None:

        def add_one(x):  # type: ignore[no-untyped-def]
            return x + 1

        add_one.__annotations__ = {"x": torch.Tensor, "return": torch.Tensor}  # torch reads the schema here
        _ADD_ONE = graph_break("devgraph_bench::add_one")(add_one)
    return _ADD_ONE


_ADD_ONE_INTO: Any = None


def add_one_into_break() -> Any:
    """The same op in the form that writes into an argument and returns nothing (registered once)."""
    global _ADD_ONE_INTO
    if _ADD_ONE_INTO is None:

        def add_one_into(x, out):  # type: ignore[no-untyped-def]
            torch.add(x, 1, out=out)

        add_one_into.__annotations__ = {"x": torch.Tensor, "out": torch.Tensor, "return": None}
        _ADD_ONE_INTO = graph_break("devgraph_bench::add_one_into", mutates_args=("out",))(add_one_into)
    return _ADD_ONE_INTO


def break_cost(dev: Device, n: int, iters: int) -> dict[str, Any]:
    """devgraph's host cost per break: a forward of ``n`` (kernel, trivial break op) pairs captured by
    ``full`` and by ``breakable``; ``iters`` calls per host-time sample. Two forms of the op: one that
    returns a new tensor (devgraph copies it where the next segment reads it) and one that writes into an
    argument the segment allocated (``mutates_args``; nothing to copy)."""
    op, op_into = add_one_break(), add_one_into_break()
    hidden = 1024 if dev.cuda else 64

    def forward(x: torch.Tensor) -> torch.Tensor:
        for _ in range(n):
            x = op(x * 1.0)  # one kernel in the segment, then the break
        return x * 1.0

    def forward_into(x: torch.Tensor) -> torch.Tensor:
        for _ in range(n):
            y = x * 1.0
            x = torch.empty_like(y)  # allocated by the segment (no kernel): the op writes here
            op_into(y, x)
        return x * 1.0

    inputs = {"x": StaticInput(torch.float32, (hidden,), fill=0.0)}
    forwards = {"": forward, "_into": forward_into}
    runners = {
        mode + form: GraphRunner(
            fn,
            phase="decode",
            inputs=inputs,
            sizes=[1],
            mode=mode,
            device=dev.device,
            progress=False,
            output_axes=[TOKENS],
        )
        for form, fn in forwards.items()
        for mode in ("full", "breakable")
    }
    for runner in runners.values():
        runner.capture()
    x = torch.randn(1, hidden, device=dev.device)
    expected = forward(x)
    out: dict[str, Any] = {"breaks": n, "exact": {}}
    host: dict[str, list[float]] = {m: [] for m in runners}
    for _ in range(5):
        for mode, runner in runners.items():
            host[mode].append(host_us(dev, functools.partial(runner.run, x=x), iters))
    for mode, runner in runners.items():
        out["exact"][mode] = bool(torch.equal(runner.run(x=x), expected))
        out[f"{mode}_run_us"] = round(statistics.median(host[mode]), 2)
        out[f"{mode}_latency_ms"] = round(
            statistics.median(dev.time_step(functools.partial(runner.run, x=x))[0] for _ in range(20)), 4
        )
    body, body_into = op.replay_fn(), op_into.replay_fn()
    y = torch.empty_like(x)
    out["op_body_us"] = round(host_us(dev, lambda: body(x), iters), 2)
    out["op_into_body_us"] = round(host_us(dev, lambda: body_into(x, y), iters), 2)
    out["copy_us"] = round(host_us(dev, lambda: y.copy_(x), iters), 2)
    if dev.cuda:  # what one more graph segment costs the host: a one-kernel graph's replay
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            z = x * 1.0
        out["one_kernel_graph_replay_us"] = round(host_us(dev, graph.replay, iters), 2)
        del z
    out["per_break_us"] = round((out["breakable_run_us"] - out["full_run_us"]) / n, 2)
    out["devgraph_per_break_us"] = round(out["per_break_us"] - out["op_body_us"], 2)
    out["per_break_into_us"] = round((out["breakable_into_run_us"] - out["full_into_run_us"]) / n, 2)
    out["devgraph_per_break_into_us"] = round(out["per_break_into_us"] - out["op_into_body_us"], 2)
    out["definition"] = (
        f"forward = {n} x (one elementwise kernel, then a trivial break op x + 1) + one kernel, on a "
        f"[1, {hidden}] float32 tensor; full captures it as one graph, breakable as {n + 1} segments and "
        f"{n} breaks. per_break_us = (breakable run() host us - full run() host us) / {n}: what each "
        "break adds to the host's step (one more segment launch, the op's function, copying its output "
        "where the next segment reads it). devgraph_per_break_us = per_break_us - op_body_us (the op's "
        "own function called directly). The _into figures: the same with the op writing into an "
        "argument the segment allocated and returning nothing (mutates_args), so there is no output to copy. "
        "Host times: median of rounds, synchronized before each call."
    )
    for runner in runners.values():
        runner.close()
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, plan: Plan, report: Report, budget: Budget) -> None:
        self.args, self.plan, self.report, self.budget = args, plan, report, budget
        self.data = report.data
        self.setup: Setup | None = None
        self.variants: dict[str, dict[str, Variant]] = {"decode": {}, "prefill": {}, "verify": {}}

    # small helpers
    @contextmanager
    def section(self, what: str) -> Iterator[None]:
        log.info("%s (t=%.0fs, cpu %.0fs)", what, self.budget.elapsed(), time.process_time())
        try:
            yield
        except Exception as exc:
            self.report.error(what, exc)
        finally:
            self.report.save()

    def add(self, phase: str, build: Callable[[], Variant], name: str, estimate_s: float) -> None:
        if not self.budget.allows(estimate_s):
            self.data[phase].setdefault("skipped", {})[name] = f"time budget: {self.budget.left():.0f}s left"
            return
        try:
            variant = build()
        except Exception as exc:
            self.report.error(f"{phase} {name} build", exc)
            return
        self.variants[phase][variant.name] = variant
        self.data[phase]["variants"][variant.name] = variant.info
        log.info(
            "  %s %s: %s", phase, variant.name, {k: variant.info.get(k) for k in ("capture_s", "graph_MiB")}
        )

    def add_eager(self, phase: str, attentions: Sequence[str]) -> None:
        assert self.setup is not None
        for attention in attentions:
            v = eager_variant(self.setup, phase, attention)
            self.variants[phase][v.name] = v
            self.data[phase]["variants"][v.name] = v.info

    def time_phase(self, phase: str) -> None:
        s = self.setup
        assert s is not None
        section = self.data[phase]
        for name, v in self.variants[phase].items():
            try:
                section["correctness"][name] = check_variant(s, phase, v)
            except Exception as exc:
                self.report.error(f"{phase} {name} correctness", exc)
        timed = time_cases(
            list(self.variants[phase].values()),
            list(s.batches[phase]),
            s.dev,
            iters=self.plan.iters,
            rounds=self.plan.rounds,
            warm_steps=self.plan.warm_steps,
            on_error=lambda what, exc: self.report.error(f"{phase} timing {what}", exc),
        )
        section["latency_ms"] = {n: {c: r["ms"] for c, r in per.items()} for n, per in timed.items()}
        section["host_ms"] = {n: {c: r["host_ms"] for c, r in per.items()} for n, per in timed.items()}
        floors = section.get("floor_ms", {})
        section["ratio_to_floor"] = {
            n: {c: round(ms / floors[c], 3) for c, ms in per.items() if floors.get(c)}
            for n, per in section["latency_ms"].items()
        }

    def close_phase(self, phase: str) -> None:
        for name, v in self.variants[phase].items():
            try:
                v.close()
            except Exception as exc:
                self.report.error(f"{phase} {name} close", exc)
        self.variants[phase].clear()
        if self.setup is not None:
            self.setup.dev.settle(full_gc=True)

    # sections
    def run(self) -> None:
        device = torch.device("cpu" if self.args.smoke else "cuda")
        for phase in ("decode", "prefill", "verify"):
            self.data[phase] = {"variants": {}, "correctness": {}}
        with self.section("setup"):
            torch.manual_seed(0)
            self.setup = build_setup(self.plan, device)
            self.describe_setup()
        if self.setup is None:
            return
        with self.section("decode"):
            self.decode()
        with self.section("host time"):
            self.host_time()
        self.close_phase("decode")
        with self.section("prefill"):
            self.prefill()
        self.close_phase("prefill")
        with self.section("verify"):
            self.verify()
        self.close_phase("verify")
        with self.section("warm-ups"):
            self.warmups()

    def describe_setup(self) -> None:
        s = self.setup
        assert s is not None
        c = s.paged.config
        bandwidth = copy_bandwidth(s.dev, self.plan.bandwidth_bytes)
        self.data["meta"].update(
            model={
                "preset": self.plan.preset,
                **{f.name: str(getattr(c, f.name)) for f in dataclasses.fields(c)},
                "total_blocks": c.total_blocks,
                "weight_bytes": sum(p.numel() * p.element_size() for p in s.paged.parameters()),
                "kv_cache_bytes": sum(
                    t.numel() * t.element_size() for t in (*s.paged.k_cache, *s.paged.v_cache)
                ),
            },
            setup_s=round(s.build_s, 1),
            bandwidth=bandwidth,
            plan=dataclasses.asdict(self.plan),
            timing="CUDA events around each step (host start to last kernel), median; variants interleaved",
            graph_bytes="growth of memory_reserved across capture, the allocator's cache emptied around it",
            kv_layout="read-only random context blocks + private blocks for each batch's writes (KVPlan)",
        )
        gbps = bandwidth["GBps"]
        for phase, cases in s.batches.items():
            floors, parts = {}, {}
            for case, batch in cases.items():
                rows = batch["seq_lens"].shape[0] if phase == "prefill" else batch["input_ids"].shape[0]
                parts[case] = step_bytes(s.paged, batch, int(rows))
                floors[case] = round(floor_ms(parts[case], gbps), 4)
            self.data[phase]["floor_ms"] = floors
            self.data[phase]["floor_bytes"] = parts
        # eager with the two attentions, same weights and cache: how far apart their kernels round
        self.data["attention_agreement"] = {
            phase: {c: diff(s.refs[phase]["sdpa"][c], s.refs[phase]["paged"][c]) for c in s.batches[phase]}
            for phase in ("decode", "prefill")
        }

    def add_strategies(self, phase: str) -> None:
        """Eager, the hand-written graph and every strategy on paged and sdpa attention, for ``phase``."""
        s = self.setup
        assert s is not None
        self.add_eager(phase, ("paged", "sdpa"))
        self.add(phase, lambda: hand_variant(s, phase), "hand", 5)
        self.add(phase, lambda: runner_variant(s, phase, "full", "paged", "full"), "full", 5)
        self.add(phase, lambda: runner_variant(s, phase, "breakable", "paged", "breakable"), "breakable", 5)
        self.add(
            phase,
            lambda: runner_variant(s, phase, "breakable_sdpa", "sdpa", "breakable"),
            "breakable_sdpa",
            8,
        )
        self.add(
            phase,
            lambda: runner_variant(s, phase, "tc_piecewise", "paged", "tc_piecewise"),
            "tc_piecewise",
            15,
        )
        self.add(
            phase,
            lambda: runner_variant(s, phase, "tc_piecewise_sdpa", "sdpa", "tc_piecewise"),
            "tc_piecewise_sdpa",
            15,
        )

    def decode(self) -> None:
        s = self.setup
        assert s is not None
        phase = "decode"
        compiled = json.dumps({"decode": {"backend": "full", "compiler": self.plan.compiler}})
        self.add_strategies(phase)
        self.add(
            phase, lambda: runner_variant(s, phase, "full_inductor", "paged", compiled), "full_inductor", 60
        )
        full_inductor = self.data[phase]["variants"].get("full_inductor")
        if full_inductor is not None:
            full_inductor["warmup_s"] = full_inductor["capture_s"]  # compile + warm-ups + capture, 4 sizes
        self.report.save()
        self.time_phase(phase)

    def prefill(self) -> None:
        self.add_strategies("prefill")
        self.report.save()
        self.time_phase("prefill")

    def verify(self) -> None:
        s = self.setup
        assert s is not None
        phase = "verify"
        if not self.budget.allows(20):
            self.data[phase]["skipped"] = f"time budget: {self.budget.left():.0f}s left"
            return
        self.add_eager(phase, ("paged",))
        self.add(phase, lambda: hand_variant(s, phase), "hand", 5)
        self.add(phase, lambda: runner_variant(s, phase, "full", "paged", "full"), "full", 5)
        self.time_phase(phase)

    # -- host time -------------------------------------------------------------------------------------------
    def host_time(self) -> None:
        s = self.setup
        assert s is not None
        dev, iters = s.dev, self.plan.host_iters
        out: dict[str, Any] = {}
        case = decode_case(1, self.plan.contexts[0])
        batch = s.batches["decode"][case]
        full = self.variants["decode"].get("full")
        hand = self.variants["decode"].get("hand")
        if full is not None and hasattr(full.runner, "_lock"):
            runner = full.runner
            real = runner._lock
            with_lock, without_lock = [], []
            for _ in range(5):  # rounds, interleaved
                runner._lock = real
                with_lock.append(host_us(dev, lambda: runner.run(**batch), iters))
                runner._lock = NoLock()
                without_lock.append(host_us(dev, lambda: runner.run(**batch), iters))
            runner._lock = real
            out["run_us"] = round(statistics.median(with_lock), 2)
            out["run_us_no_lock"] = round(statistics.median(without_lock), 2)
            out["lock_us"] = round(out["run_us"] - out["run_us_no_lock"], 2)
            out["run_us_rounds"] = [round(x, 2) for x in with_lock]
        inductor = self.variants["decode"].get("full_inductor")
        if inductor is not None:
            out["run_us_full_inductor"] = round(host_us(dev, lambda: inductor.runner.run(**batch), iters), 2)
        if hand is not None:
            out["hand_run_us"] = round(host_us(dev, lambda: hand.runner.run(batch), iters), 2)
            graph = hand.runner.graphs[hand.runner.key_for(batch)]
            out["graph_replay_us"] = round(host_us(dev, graph.replay, iters), 2)
        out["raw_rlock_ns"] = round(
            min(
                timeit.repeat(
                    "with lock: pass", number=200_000, repeat=5, globals={"lock": threading.RLock()}
                )
            )
            / 200_000
            * 1e9,
            1,
        )
        out["definition"] = (
            f"run_us: median host microseconds of GraphRunner.run(**batch) for decode batch 1 ({case}), full "
            "(paged), the device synchronized before each call and not inside it (what the engine's thread "
            "pays per step); run_us_no_lock: the same with the runner's lock swapped for a no-op (rounds "
            "interleaved); hand_run_us: the hand-written copy-in + replay; graph_replay_us: "
            "CUDAGraph.replay() alone"
        )
        self.data["host_time"] = out
        self.data["break_cost"] = break_cost(dev, self.plan.breaks, self.plan.host_iters)

    # -- warm-ups --------------------------------------------------------------------------------------------
    # -- warm-ups --------------------------------------------------------------------------------------------
    def warmups(self) -> None:
        s = self.setup
        assert s is not None
        phase, rows = "decode", self.data.setdefault("warmups", {}).setdefault("this_process", {})
        modes = {
            "hand": ("paged", None),
            "full": ("paged", "full"),
            "breakable_sdpa": ("sdpa", "breakable"),
            "tc_piecewise_sdpa": ("sdpa", "tc_piecewise"),
        }
        estimates = {"hand": 3, "full": 3, "breakable_sdpa": 5, "tc_piecewise_sdpa": 15}
        reused = self.data["decode"]["variants"].get("tc_piecewise_sdpa")
        for w in self.plan.warmups:
            for name, (attention, mode) in modes.items():
                key = f"{name}@{w}"
                if name == "tc_piecewise_sdpa" and w == 2 and reused is not None:
                    checks = self.data["decode"]["correctness"].get(name, {})
                    correct = bool(checks) and all(
                        e.get("ok") and e.get("max_abs_same_padded") == 0 for e in checks.values()
                    )
                    rows[key] = {**reused, "note": "the decode section's runner", "captured": True}
                    rows[key]["correct"] = correct
                    continue
                if not self.budget.allows(estimates[name]):
                    rows[key] = {"skipped": f"time budget: {self.budget.left():.0f}s left"}
                    continue
                try:
                    if mode is None:
                        v = hand_variant(s, phase, warmup_iters=w)
                    else:
                        v = runner_variant(s, phase, name, attention, mode, warmup_iters=w)
                except Exception as exc:
                    self.report.error(f"warm-ups {key}", exc)
                    rows[key] = {"captured": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    continue
                try:
                    checks = check_variant(s, phase, v)
                    exact = all(e.get("max_abs_same_padded") == 0 for e in checks.values())
                    ok = all(e.get("ok", True) for e in checks.values())
                    rows[key] = {**v.info, "captured": True, "correct": ok and exact, "checks": checks}
                finally:
                    v.close()
                    s.dev.settle()
                self.report.save()
        self.data["warmups"]["definition"] = (
            "decode sizes 1, 8, 32, 64 captured with warmup_iters eager runs per size before each capture; "
            "correct: every decode case equals eager on the same padded step (verify) exactly. This process "
            "had already run every kernel (warm); 'fresh_process' has the first capture of new processes."
        )


# -- child processes -----------------------------------------------------------------------------------------
def child_env(cache_root: Path, name: str) -> dict[str, str]:
    """Environment of a child: its own empty inductor and Triton caches (a cold start)."""
    env = dict(os.environ)
    root = cache_root / name
    env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    env["TRITON_CACHE_DIR"] = str(root / "triton")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("OUT", None)
    return env


def child_command(args: argparse.Namespace, kind: str, out: Path, warmup_iters: int = 0) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--out", str(out)]
    command += ["--warmup-iters", str(warmup_iters)]
    return command + (["--smoke"] if args.smoke else [])


def run_children(
    args: argparse.Namespace, plan: Plan, report: Report, budget: Budget, cache_root: Path
) -> None:
    data = report.data
    tmp = cache_root / "children"
    tmp.mkdir(parents=True, exist_ok=True)
    if not args.no_probes:
        fresh = data.setdefault("warmups", {}).setdefault("fresh_process", {})
        for w in (0, 1):  # one after the other: each is the first capture of its own process
            log.info("fresh-process probe, warmup_iters=%d (t=%.0fs)", w, budget.elapsed())
            out = tmp / f"probe{w}.json"
            try:
                subprocess.run(
                    child_command(args, "probe", out, w),
                    env=child_env(cache_root, f"p{w}"),
                    check=True,
                    timeout=max(60.0, min(180.0, budget.left() - 120)),
                )
                fresh[str(w)] = json.loads(out.read_text())
            except Exception as exc:
                report.error(f"fresh-process probe warmup_iters={w}", exc)
            report.save()
    if not args.no_ro:
        log.info("reduce-overhead process (t=%.0fs)", budget.elapsed())
        out = tmp / "ro.json"
        try:
            subprocess.run(
                child_command(args, "ro", out),
                env=child_env(cache_root, "ro"),
                check=True,
                timeout=max(60.0, budget.left() - 60),
            )
            data["reduce_overhead"] = json.loads(out.read_text())
        except Exception as exc:
            report.error("reduce-overhead process", exc)
        report.save()


def probe_child(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """The first capture of a fresh process with ``--warmup-iters`` warm-ups: ``full`` first (nothing has run
    before it: Triton kernels not compiled, cuBLAS not set up on the capture stream), then ``breakable`` and
    ``tc_piecewise`` with sdpa attention (no longer cold). Fewer layers: what is cold is per kernel."""
    device = torch.device("cpu" if args.smoke else "cuda")
    w = args.warmup_iters
    s = build_setup(plan, device, layers=plan.probe_layers, phases=("decode",), refs=False)
    result: dict[str, Any] = {"warmup_iters": w, "layers": plan.probe_layers, "order": [], "errors": []}
    variants: dict[str, Variant] = {}
    for name, attention, mode in (
        ("full", "paged", "full"),
        ("breakable_sdpa", "sdpa", "breakable"),
        ("tc_piecewise_sdpa", "sdpa", "tc_piecewise"),
    ):
        result["order"].append(name)
        try:
            variants[name] = runner_variant(s, "decode", name, attention, mode, warmup_iters=w)
            result[name] = {**variants[name].info, "captured": True}
        except Exception as exc:
            result[name] = {"captured": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    try:
        s.compute_refs()
        for name, v in variants.items():
            checks = check_variant(s, "decode", v)
            exact = all(e.get("max_abs_same_padded") == 0 for e in checks.values())
            result[name]["correct"] = exact and all(e.get("ok") for e in checks.values())
            result[name]["checks"] = checks
    except Exception as exc:
        result["errors"].append(f"checks: {type(exc).__name__}: {str(exc)[:400]}")
    for v in variants.values():
        v.close()
    return result


def ro_child(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """``torch.compile(model.decode_step, mode="reduce-overhead")`` recording its graphs before anything else
    captures in this process; then hand and ``full`` captured and all timed together."""
    device = torch.device("cpu" if args.smoke else "cuda")
    s = build_setup(plan, device, phases=("decode",))
    dev, model = s.dev, s.paged
    result: dict[str, Any] = {"meta": environment(dev), "errors": []}
    import torch._dynamo.utils as dynamo_utils

    if plan.compiler == "inductor":
        compiled = torch.compile(model.decode_step, mode="reduce-overhead")
        result["how"] = 'torch.compile(model.decode_step, mode="reduce-overhead")'
    else:
        compiled = torch.compile(model.decode_step, backend="eager")
        result["how"] = 'smoke stand-in: torch.compile(model.decode_step, backend="eager")'
    mark = torch.compiler.cudagraph_mark_step_begin
    batches = s.batches["decode"]

    def step(case: str) -> torch.Tensor:
        mark()
        return compiled(**batches[case])

    per_size: dict[str, float] = {}
    t0 = time.perf_counter()
    for b in plan.decode_batches:  # each size: warm-up run, recording, first replay (CUDA graph trees)
        t1 = time.perf_counter()
        for _ in range(3):
            step(decode_case(b, plan.contexts[0]))
        dev.sync()
        per_size[str(b)] = round(time.perf_counter() - t1, 3)
    result["warmup_s"] = round(time.perf_counter() - t0, 3)
    result["warmup_note"] = (
        "compile + for each size in order a warm-up run, the recording and the first replay; measured after "
        "the eager references ran in this process (the paged attention's Triton kernels already compiled), "
        "as full_inductor's warm-up in the main process is"
    )
    result["warmup_s_per_size"] = per_size
    result["counters"] = {k: dict(v) for k, v in dynamo_utils.counters.items() if k in ("stats", "inductor")}
    result["correctness"] = {
        case: {"vs_eager_reference": diff(step(case).clone(), s.refs["decode"]["paged"][case])}
        for case in batches
    }
    variants = [eager_variant(s, "decode", "paged"), Variant("reduce_overhead", step)]
    for build in (
        lambda: hand_variant(s, "decode"),
        lambda: runner_variant(s, "decode", "full", "paged", "full"),
    ):
        try:
            v = build()
            variants.append(v)
            result.setdefault("anchors", {})[v.name] = v.info
        except Exception as exc:
            result["errors"].append(f"anchor: {type(exc).__name__}: {str(exc)[:400]}")
    timed = time_cases(
        variants,
        list(batches),
        dev,
        iters=plan.iters,
        rounds=plan.rounds,
        warm_steps=plan.warm_steps,
        on_error=lambda what, exc: result["errors"].append(f"{what}: {exc}"[:400]),
    )
    result["latency_ms"] = {n: {c: r["ms"] for c, r in per.items()} for n, per in timed.items()}
    result["host_ms"] = {n: {c: r["host_ms"] for c, r in per.items()} for n, per in timed.items()}
    for v in variants:
        v.close()
    return result


# -- targets, plot, summary ----------------------------------------------------------------------------------
DEVGRAPH_DECODE = (
    "full",
    "full_inductor",
    "breakable",
    "breakable_sdpa",
    "tc_piecewise",
    "tc_piecewise_sdpa",
)


def compute_targets(data: dict[str, Any], plan: Plan) -> list[Target]:
    dec, pre = data.get("decode", {}), data.get("prefill", {})
    lat = dec.get("latency_ms", {})
    c0 = plan.contexts[0]
    first, last = plan.decode_batches[0], plan.decode_batches[-1]
    targets = []
    full = lat.get("full", {})
    floors = dec.get("floor_ms", {})
    # `full` with its default (eager) compiler and with `compiler: inductor`: both are the `full` backend
    # over the Triton paged attention; the latency target is for that backend.
    for name, label in (("full", "full"), ("full_inductor", "full+inductor")):
        for b, limit in ((first, 2.0), (last, 6.0)):
            case = decode_case(b, c0)
            floor, value = floors.get(case), lat.get(name, {}).get(case)
            detail = f"bandwidth floor {floor} ms ({value / floor:.2f}x floor)" if floor and value else ""
            targets.append(Target(f"decode {label} (paged) {case} ms", value, limit, " ms", detail=detail))
    ro = data.get("reduce_overhead", {}).get("latency_ms", {}).get("reduce_overhead", {})
    ro_full = data.get("reduce_overhead", {}).get("latency_ms", {}).get("full", {})
    for case in dec.get("floor_ms", {}):
        best = min(((lat[n][case], n) for n in DEVGRAPH_DECODE if case in lat.get(n, {})), default=None)
        if best is None or case not in ro:
            targets.append(Target(f"decode best devgraph / reduce-overhead {case}", None, 1.0, "x"))
            continue
        drift = f", full here/there {full.get(case, float('nan')) / ro_full.get(case, float('nan')):.3f}"
        targets.append(
            Target(
                f"decode best devgraph / reduce-overhead {case}",
                best[0] / ro[case],
                1.0,
                "x",
                detail=f"{best[1]} {best[0]} ms vs {ro[case]} ms (own process){drift}",
            )
        )
    ro_warm = data.get("reduce_overhead", {}).get("warmup_s")
    ind = dec.get("variants", {}).get("full_inductor", {}).get("warmup_s")
    targets.append(
        Target(
            "warm-up full+inductor / reduce-overhead (4 sizes)",
            ind / ro_warm if ind and ro_warm else None,
            0.2,
            "x",
            detail=f"{ind} s vs {ro_warm} s",
        )
    )
    plat = pre.get("latency_ms", {})
    packed = [prefill_case(c) for c in plan.prefill_cases if len(c) > 1]
    single = prefill_case((sum(plan.prefill_cases[-1]),))
    pfull = plat.get("full", {})
    for case in packed:
        if case in pfull and single in pfull:
            targets.append(Target(f"prefill full {case} / {single}", pfull[case] / pfull[single], 1.05, "x"))
    brk = plat.get("breakable", {})
    for case in plat.get("full", {}):
        ratio = brk[case] / pfull[case] if case in brk else None
        targets.append(Target(f"prefill breakable(paged) / full {case}", ratio, 1.15, "x"))
    pvars = pre.get("variants", {})
    full_bytes = pvars.get("full", {}).get("graph_bytes")
    for name in ("breakable", "breakable_sdpa", "tc_piecewise", "tc_piecewise_sdpa"):
        nbytes = pvars.get(name, {}).get("graph_bytes")
        ratio = nbytes / full_bytes if nbytes is not None and full_bytes else None
        targets.append(
            Target(
                f"prefill graph memory {name} / full",
                ratio,
                1.25,
                "x",
                detail=f"{nbytes} vs {full_bytes} bytes",
            )
        )
    host = data.get("host_time", {})
    run_us, hand_us = host.get("run_us"), host.get("hand_run_us")
    # devgraph's own share: what run() costs beyond the hand-written step on the same batch (which copies
    # the same inputs into its static buffers, pads and replays the same graph).
    targets.append(
        Target(
            "devgraph's own host time per run(), decode b1 (run() - hand step)",
            run_us - hand_us if run_us is not None and hand_us is not None else None,
            30.0,
            " us",
            detail=f"run() {run_us} us, hand step {hand_us} us, bare replay {host.get('graph_replay_us')} us",
        )
    )
    for key, form in (("devgraph_per_break_us", "new tensor"), ("devgraph_per_break_into_us", "into an arg")):
        targets.append(
            Target(
                f"devgraph host time per break (op returns {form})",
                data.get("break_cost", {}).get(key),
                5.0,
                " us",
            )
        )
    warm = data.get("warmups", {}).get("this_process", {})
    for w in plan.warmups:
        f, h = warm.get(f"full@{w}", {}).get("capture_s"), warm.get(f"hand@{w}", {}).get("capture_s")
        targets.append(
            Target(f"capture time full / hand, warmup_iters={w}", f / h if f and h else None, 1.0, "x")
        )
    dvars = dec.get("variants", {})
    if "full" in dvars and "hand" in dvars:
        targets.append(
            Target(
                "decode capture time full / hand (default warm-ups)",
                dvars["full"]["capture_s"] / dvars["hand"]["capture_s"],
                1.0,
                "x",
            )
        )
    worst = 0.0
    for phase in ("decode", "prefill", "verify"):
        for per in data.get(phase, {}).get("correctness", {}).values():
            for entry in per.values():
                value = entry.get("max_abs_same_padded")
                if value is not None:
                    worst = max(worst, value)
    targets.append(Target("every graph == eager on the same padded step (max |diff|)", worst, 0.0))
    return targets


def plot(data: dict[str, Any], plan: Plan, path: Path) -> None:
    panels = []
    dec = data.get("decode", {})
    ro = data.get("reduce_overhead", {}).get("latency_ms", {}).get("reduce_overhead", {})
    for context in plan.contexts:
        cases = [decode_case(b, context) for b in plan.decode_batches]
        series = {n: [per.get(c) for c in cases] for n, per in dec.get("latency_ms", {}).items()}
        if ro:
            series["reduce-overhead (own process)"] = [ro.get(c) for c in cases]
        panels.append(
            Panel(
                f"decode, {context}-token contexts",
                [str(b) for b in plan.decode_batches],
                series,
                xlabel="batch",
                reference={"bandwidth floor": [dec.get("floor_ms", {}).get(c) for c in cases]},
            )
        )
    for phase, xlabel in (
        ("prefill", "requests x tokens"),
        ("verify", f"batch (1 + {plan.draft_tokens} tokens)"),
    ):
        section = data.get(phase, {})
        cases = list(section.get("floor_ms", {}))
        series = {n: [per.get(c) for c in cases] for n, per in section.get("latency_ms", {}).items()}
        panels.append(
            Panel(
                phase,
                cases,
                series,
                xlabel=xlabel,
                bars=True,
                reference={"bandwidth floor": [section.get("floor_ms", {}).get(c) for c in cases]},
            )
        )
    meta = data.get("meta", {})
    plot_panels(path, panels, f"devgraph, {plan.preset} on {meta.get('device')} (torch {meta.get('torch')})")


def summary(data: dict[str, Any]) -> str:
    lines = []
    for phase in ("decode", "prefill", "verify"):
        lat = data.get(phase, {}).get("latency_ms", {})
        if not lat:
            continue
        cases = list(data[phase].get("floor_ms", {}))
        lines.append(f"{phase} median ms: {'  '.join(cases)}")
        for name, per in lat.items():
            lines.append(f"  {name:<20}" + "".join(f"{per.get(c, float('nan')):>10.3f}" for c in cases))
        floors = data[phase].get("floor_ms", {})
        lines.append(
            f"  {'bandwidth floor':<20}" + "".join(f"{floors.get(c, float('nan')):>10.3f}" for c in cases)
        )
    ro = data.get("reduce_overhead", {}).get("latency_ms", {})
    if ro:
        cases = list(next(iter(ro.values()), {}))
        lines.append("decode in the reduce-overhead process: " + "  ".join(cases))
        for name, per in ro.items():
            lines.append(f"  {name:<20}" + "".join(f"{per.get(c, float('nan')):>10.3f}" for c in cases))
    if data.get("errors"):
        lines.append("errors:")
        lines += [f"  {e.splitlines()[0][:200]}" for e in data["errors"]]
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (simulated graphs)")
    parser.add_argument(
        "--out", help="JSON path (default $OUT/decode.json, else benchmarks/results/h100-decode.json)"
    )
    parser.add_argument("--time-budget", type=float, help="seconds; optional sections are skipped past it")
    parser.add_argument("--no-ro", action="store_true", help="skip the reduce-overhead process")
    parser.add_argument("--no-probes", action="store_true", help="skip the fresh-process warm-up probes")
    parser.add_argument(
        "--keep-caches",
        action="store_true",
        help="use the inductor/Triton caches already set (default: fresh empty ones)",
    )
    parser.add_argument("--child", choices=("ro", "probe"), help=argparse.SUPPRESS)
    parser.add_argument("--warmup-iters", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = SMOKE if args.smoke else GPU
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU here; use --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.child:
        with torch.no_grad():
            result = (ro_child if args.child == "ro" else probe_child)(args, plan)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        return 0
    budget = Budget(args.time_budget or plan.budget_s)
    path = output_path("decode.json", "benchmarks/results/h100-decode.json", args.out, args.smoke)
    device = Device("cpu" if args.smoke else "cuda")
    report = Report(path, environment(device))
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as cache_root:
        root = Path(cache_root)
        if not args.keep_caches:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "main" / "inductor")
            os.environ["TRITON_CACHE_DIR"] = str(root / "main" / "triton")
        report.data["meta"]["compile_caches"] = "kept" if args.keep_caches else "fresh empty per process"
        run_children(args, plan, report, budget, root)
        bench = Bench(args, plan, report, budget)
        with torch.no_grad():
            bench.run()
    targets = compute_targets(report.data, plan)
    report.data["targets"] = [t.as_dict() for t in targets]
    report.data["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
    report.save()
    try:
        plot(report.data, plan, path.with_suffix(".png"))
    except Exception as exc:
        report.error("plot", exc)
        report.save()
    print(summary(report.data))
    if args.smoke:
        print("\n--smoke: the CPU simulator replays by re-running ops; its timings say nothing about a GPU")
    print(f"\nwrote {path} and {path.with_suffix('.png')} in {budget.elapsed():.0f}s\n")
    print(targets_table(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
