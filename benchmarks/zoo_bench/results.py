"""What the zoo benchmark concludes: floors and their ratios, the targets per model, the numbers the
``auto``-mode decision reads, the text summary and the plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harness.plots import Panel, plot_panels
from harness.targets import Target

__all__ = ["decision", "plot", "summary", "targets"]

#: The decision rule for ``auto`` on CUDA decode (docs/performance.md states it in words).
DECISION_RULE = (
    "compiled full becomes auto's decode mode on CUDA when, over the zoo's decoders: it captures wherever "
    "plain full does; it is never slower than plain full (worst model, every batch, within 2%); its "
    "geometric-mean speedup over plain full is at least 1.10x at batch 1 or 8; and its cold warm-up is at "
    "most 0.3x reduce-overhead's on every model"
)


def _ms(data: dict[str, Any], model: str, variant: str, case: str) -> float | None:
    entry = data["models"].get(model, {}).get("variants", {}).get(variant, {})
    return entry.get("cases", {}).get(case, {}).get("ms")


def _warm(data: dict[str, Any], model: str, variant: str) -> float | None:
    return data["models"].get(model, {}).get("variants", {}).get(variant, {}).get("warmup_s")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(data: dict[str, Any]) -> list[Target]:
    out = []
    for model, entry in data["models"].items():
        cases = list(entry.get("cases", []))
        ro_info = entry.get("variants", {}).get("reduce_overhead", {})
        # Where reduce-overhead skipped its CUDA graphs (mutated inputs), it is no graph baseline.
        ro_keeps_graphs = not ro_info.get("cudagraph_skips")
        for variant in ("full_compiled", "full_compiled_regions"):
            if variant not in entry.get("variants", {}):
                continue
            plain = [_ratio(_ms(data, model, variant, c), _ms(data, model, "full", c)) for c in cases]
            worst_plain = max((r for r in plain if r is not None), default=None)
            out.append(
                Target(f"{model}: {variant} / plain full latency (worst batch)", worst_plain, 1.0, "x")
            )
            if ro_keeps_graphs:
                ro = [
                    _ratio(_ms(data, model, variant, c), _ms(data, model, "reduce_overhead", c))
                    for c in cases
                ]
                worst_ro = max((r for r in ro if r is not None), default=None)
                out.append(
                    Target(f"{model}: {variant} / reduce-overhead latency (worst batch)", worst_ro, 0.9, "x")
                )
            warm = _ratio(_warm(data, model, variant), _warm(data, model, "reduce_overhead"))
            out.append(Target(f"{model}: {variant} / reduce-overhead warm-up", warm, 0.3, "x"))
        hand = [_ratio(_ms(data, model, "full", c), _ms(data, model, "hand", c)) for c in cases]
        worst_hand = max((r for r in hand if r is not None), default=None)
        out.append(
            Target(f"{model}: plain full / hand-written graph latency (worst batch)", worst_hand, 1.02, "x")
        )
    return out


def decision(data: dict[str, Any]) -> dict[str, Any]:
    """Per model and batch: compiled full's speedup over plain full, both warm-ups, and the rule's verdict."""
    rows = []
    speedups: dict[str, list[float]] = {}
    verdict = True
    reasons = []
    for model, entry in data["models"].items():
        if entry.get("phase", "decode") != "decode":
            continue
        full_ok = "full" in entry.get("variants", {}) and "error" not in entry["variants"]["full"]
        compiled = entry.get("variants", {}).get("full_compiled", {})
        if full_ok and ("error" in compiled or not compiled):
            verdict = False
            reasons.append(f"{model}: compiled full did not capture where plain full did")
        warm = _ratio(_warm(data, model, "full_compiled"), _warm(data, model, "reduce_overhead"))
        if warm is None or warm > 0.3:
            verdict = False
            reasons.append(f"{model}: warm-up ratio to reduce-overhead {warm}")
        for case in entry.get("cases", []):
            speedup = _ratio(_ms(data, model, "full", case), _ms(data, model, "full_compiled", case))
            rows.append({"model": model, "case": case, "speedup_over_plain_full": speedup})
            if speedup is not None:
                speedups.setdefault(case, []).append(speedup)
                if speedup < 1 / 1.02:
                    verdict = False
                    reasons.append(f"{model} {case}: compiled full {1 / speedup:.2f}x plain full's latency")
    geomean = {c: math.exp(sum(map(math.log, v)) / len(v)) for c, v in speedups.items() if v}
    small = [geomean.get(c) for c in ("bs1", "bs8") if geomean.get(c) is not None]
    if not small or max(small) < 1.10:
        verdict = False
        reasons.append(f"geometric-mean speedup at batch 1/8: {small}")
    return {
        "rule": DECISION_RULE,
        "rows": rows,
        "geomean_speedup": {c: round(v, 3) for c, v in geomean.items()},
        "compiled_full_for_auto": verdict if rows else None,
        "reasons_against": reasons,
    }


def summary(data: dict[str, Any]) -> str:
    lines = []
    for model, entry in data["models"].items():
        lines.append(f"{model}:")
        for name, variant in entry.get("variants", {}).items():
            if "error" in variant:
                lines.append(f"  {name:<16} refused/failed: {variant['error'][:150]}")
                continue
            cells = "  ".join(
                f"{case} {v['ms']:.3f}ms"
                for case, v in variant.get("cases", {}).items()
                if v.get("ms") is not None
            )
            warm = variant.get("warmup_s")
            lines.append(f"  {name:<16} warm-up {warm if warm is not None else '-':>7}s  {cells}")
        floors = "  ".join(f"{c} {v:.3f}ms" for c, v in entry.get("floor_ms", {}).items())
        lines.append(f"  {'floor':<16} {floors}")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    panels = []
    for model, entry in data["models"].items():
        cases = list(entry.get("cases", []))
        if not cases:
            continue
        series = {
            name: [variant.get("cases", {}).get(c, {}).get("ms") for c in cases]
            for name, variant in entry.get("variants", {}).items()
            if "error" not in variant
        }
        floor = {"bandwidth floor": [entry.get("floor_ms", {}).get(c) for c in cases]}
        panels.append(Panel(model, cases, series, reference=floor, xlabel="decode batch"))
    if panels:
        meta = data["meta"]
        plot_panels(
            path, panels, f"zoo on {meta.get('device')} ({meta.get('shape')}), torch {meta.get('torch')}"
        )
