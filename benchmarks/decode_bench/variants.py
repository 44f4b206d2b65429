"""The variants a phase is timed with: eager, the hand-written graph and devgraph runners, each with what
building it cost; and each variant's output checked against eager."""

from __future__ import annotations

from typing import Any

from harness.hand import HandGraphs
from harness.report import diff
from harness.timing import Variant, measure_build

from decode_bench.plan import Plan
from decode_bench.setup import Setup
from devgraph import GraphRunner
from devgraph.contract.keys import TOKENS
from devgraph.reference import decode_runner, prefill_runner, reference_inputs, verify_runner

__all__ = ["check_variant", "eager_variant", "hand_variant", "make_runner", "runner_variant"]


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
