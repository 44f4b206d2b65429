"""The ways a zoo model's step runs, each over the same cases: eager, a hand-written ``torch.cuda.CUDAGraph``
of the eager forward, devgraph ``full`` (plain), devgraph ``full`` + inductor (compiled), and
``torch.compile(mode="reduce-overhead")`` (in a process of its own: ``child.py``); the compiled ``full``
variants keep, per key, the faster of the compiled and the plain graph (their choice is in the JSON), one
compiling the whole forward, the other the repeated block only (``regions``). Warm-up seconds are what a
variant costs before its first timed step: compile, warm-ups and capture of every batch size."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from harness.device import Batch, Device
from harness.hand import HandGraphs
from harness.timing import Variant, measure_build

from devgraph import GraphRunner, create_backend
from zoo_bench.setup import Built, Plan

__all__ = ["VARIANTS", "build_variant", "ro_variant"]

#: Variant name -> the devgraph config of its phase (None: not a devgraph runner).
VARIANTS: dict[str, dict[str, Any] | None] = {
    "eager": None,
    "hand": None,
    "full": {"backend": "full"},
    # Per key the faster of the compiled graph and the plain one (what a user gets).
    "full_compiled": {"backend": "full", "compiler": "inductor"},
    # The repeated block compiled once (regional compilation), per key the faster graph too.
    "full_compiled_regions": {"backend": "full", "compiler": "inductor", "regions": True},
}


class ZooHand(HandGraphs):
    """Hand-written graphs keyed by rows (every zoo input follows the rows of the step)."""

    def key_for(self, batch: Batch) -> tuple[int, int] | None:
        rows = self._rows(batch)
        return next((key for key in self.keys if key[0] >= rows), None)

    def _rows(self, batch: Batch) -> int:
        return int(next(iter(batch.values())).shape[0])


def _eager(built: Built) -> Variant:
    forward = built.model.forward
    return Variant("eager", lambda case: forward(**built.cases[case]))


def _hand(built: Built, plan: Plan, dev: Device) -> Variant:
    def make() -> ZooHand:
        hand = ZooHand(built.model.forward, built.model.inputs, [(b, b) for b in plan.batches], dev.device)
        built.reset()
        hand.capture()
        return hand

    hand, seconds, nbytes = measure_build(dev, make)
    info = {"warmup_s": round(seconds, 3), "graph_bytes": nbytes}
    return Variant("hand", lambda case: hand.run(built.cases[case]), info, hand.close)


def _runner(built: Built, plan: Plan, dev: Device, name: str, config: Mapping[str, Any]) -> Variant:
    options = {k: v for k, v in config.items() if k != "backend"}

    def make() -> GraphRunner:
        backend = create_backend(dev.device, built.model.phase, config["backend"], options=options)
        runner = GraphRunner(
            built.model.forward,
            device=dev.device,
            sizes=plan.batches,
            backend=backend,
            progress=False,
            **built.model.runner_kwargs(),
        )
        runner.capture()
        return runner

    runner, seconds, nbytes = measure_build(dev, make)
    built.reset()
    report = runner.report
    info = {
        "warmup_s": round(seconds, 3),
        "graph_bytes": nbytes,
        "notes": list(report.notes) if report is not None else [],
        "compile": {
            k: v
            for k, v in runner.inspect().items()
            if k in ("compile", "compiles", "fallback_kind", "writes_kept_in_place", "regions")
        },
        # Per key: the compiled and the plain graph's replay times at capture, and which one was kept.
        "compiled_or_plain": runner.inspect().get("compiled_or_plain"),
    }
    step: Callable[[str], Any] = lambda case: runner.run(**built.cases[case])  # noqa: E731
    return Variant(name, step, info, runner.close, runner)


def build_variant(name: str, built: Built, plan: Plan, dev: Device) -> Variant:
    if name == "eager":
        return _eager(built)
    if name == "hand":
        return _hand(built, plan, dev)
    config = VARIANTS[name]
    assert config is not None
    return _runner(built, plan, dev, name, config)


def ro_variant(built: Built, plan: Plan, dev: Device) -> Variant:
    """``torch.compile(forward, mode="reduce-overhead")``: warm-up is every size run until its CUDA graph is
    recorded (three calls each: warm-up, record, replay)."""
    torch._dynamo.reset()
    compiled = torch.compile(built.model.forward, mode="reduce-overhead")

    def warm() -> None:
        for case in built.cases:
            for _ in range(3):
                built.reset()
                compiled(**built.cases[case])

    from torch._dynamo.utils import counters

    skips = sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))
    t0 = time.perf_counter()
    warm()
    dev.sync()
    seconds = time.perf_counter() - t0
    # CUDA graph trees skip a graph where the forward mutates its inputs (a cache written in place): then
    # reduce-overhead runs the compiled code without graphs, and the latency targets against it do not apply.
    skips = sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",)) - skips

    def step(case: str) -> Any:
        if dev.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(**built.cases[case])

    return Variant("reduce_overhead", step, {"warmup_s": round(seconds, 3), "cudagraph_skips": skips})
