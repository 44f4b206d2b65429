"""The decode benchmark's child processes: ``torch.compile(mode="reduce-overhead")`` in a process of its own
(its CUDA graph trees free the cuBLAS workspaces graphs captured earlier use; benchmarks/README.md), and
the first capture of a fresh process with 0, 1 or 2 warm-ups."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from harness.report import diff, environment
from harness.timing import Variant, time_cases

from decode_bench.plan import Plan, decode_case
from decode_bench.setup import build_setup
from decode_bench.variants import check_variant, eager_variant, hand_variant, runner_variant

__all__ = ["probe_child", "ro_child"]


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
