"""The decode benchmark's PNG (latency per case against the floor) and its printed summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.plots import Panel, plot_panels

from decode_bench.plan import Plan, decode_case

__all__ = ["plot", "summary"]


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
