"""One model's section of the zoo benchmark (in this process: eager, hand-written graphs, plain and
compiled ``full``) and the reduce-overhead section (run in a child process: CUDA graph trees free the
cuBLAS workspaces that graphs captured earlier in the process use: benchmarks/cublas_workspace_hazard.py)."""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch
from harness.device import Device
from harness.floor import floor_ms
from harness.report import Report

from zoo_bench.setup import Plan, build, release
from zoo_bench.timing import check, time_variants
from zoo_bench.variants import VARIANTS, build_variant, ro_variant

__all__ = ["model_section", "ro_section"]

log = logging.getLogger("bench")


def _reference(built: Any) -> dict[str, torch.Tensor]:
    from zoo_bench.timing import _first_tensor

    out = {}
    for case, step in built.cases.items():
        built.reset()
        out[case] = _first_tensor(built.model.forward(**step)).detach().clone()
    return out


def model_section(name: str, plan: Plan, dev: Device, report: Report, bandwidth: float) -> dict[str, Any]:
    """Eager, hand, plain ``full`` and compiled ``full`` of one model: warm-up, latency, correctness."""
    built = build(name, plan)
    entry: dict[str, Any] = {
        "phase": built.model.phase,
        "cases": list(built.cases),
        "notes": list(built.model.notes),
        "variants": {},
    }
    entry["floor_bytes"] = {case: built.bytes_floor(int(case[2:])) for case in built.cases}
    entry["floor_ms"] = {case: round(floor_ms(b, bandwidth), 4) for case, b in entry["floor_bytes"].items()}
    variants = []
    for variant_name in VARIANTS:
        try:
            variant = build_variant(variant_name, built, plan, dev)
        except Exception as exc:  # a refusal: its message is the result
            report.error(f"{name} {variant_name}", exc)
            entry["variants"][variant_name] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
            continue
        variants.append(variant)
        entry["variants"][variant_name] = dict(variant.info)
    # The reference after every capture: warm-ups write where a case's step reads (position 0 of each row),
    # so eager computed before them would not be the step the graphs replay.
    reference = _reference(built)
    for variant in variants:
        entry["variants"][variant.name]["diff"] = check(variant, list(built.cases), reference, built.reset)
    timed = time_variants(name, variants, built, plan, dev, report)
    for variant in variants:
        entry["variants"][variant.name]["cases"] = timed.get(variant.name, {})
        for case, row in entry["variants"][variant.name]["cases"].items():
            row["floor_ratio"] = (
                round(row["ms"] / entry["floor_ms"][case], 3) if entry["floor_ms"][case] else None
            )
        variant.close()
    del variants, built
    gc.collect()
    release(None)
    return entry


def ro_section(name: str, plan: Plan, dev: Device, report: Report) -> dict[str, Any]:
    """In the child: eager again (the drift between processes) and reduce-overhead."""
    built = build(name, plan)
    reference = _reference(built)
    entry: dict[str, Any] = {"variants": {}}
    variants = [build_variant("eager", built, plan, dev)]
    try:
        ro = ro_variant(built, plan, dev)
        variants.append(ro)
        entry["variants"]["reduce_overhead"] = {
            **ro.info,
            "diff": check(ro, list(built.cases), reference, built.reset),
        }
    except Exception as exc:
        report.error(f"{name} reduce_overhead", exc)
        entry["variants"]["reduce_overhead"] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
    timed = time_variants(name, variants, built, plan, dev, report)
    entry["eager_in_child"] = timed.get("eager", {})
    if "reduce_overhead" in timed:
        entry["variants"]["reduce_overhead"]["cases"] = timed["reduce_overhead"]
    del variants, built
    torch._dynamo.reset()
    gc.collect()
    release(None)
    return entry
