"""How ``bench_hf.py`` measures and reports: a per-step clock inside ``generate()``, where tokens first
differ from the reference, its targets, the PNG beside the JSON and the printed table."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["first_difference", "plot", "step_clock", "sync", "table", "targets"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_clock(device: torch.device) -> Any:
    """A logits processor that marks each decode step (a CUDA event on a GPU, the host clock on the CPU)."""
    import transformers as tf

    class StepClock(tf.LogitsProcessor):
        def __init__(self) -> None:
            self.marks: list[Any] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if device.type == "cuda":
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.marks.append(event)
            else:
                self.marks.append(time.perf_counter())
            return scores

        def step_ms(self) -> list[float]:
            if device.type == "cuda":
                torch.cuda.synchronize()
                return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
            return [1000 * (b - a) for a, b in zip(self.marks, self.marks[1:], strict=False)]

    return StepClock()


def first_difference(tokens: torch.Tensor, reference: torch.Tensor) -> bool | str:
    if tokens.shape == reference.shape and torch.equal(tokens, reference):
        return True
    if tokens.shape != reference.shape:
        return f"shape {tuple(tokens.shape)} vs {tuple(reference.shape)}"
    rows, columns = (tokens != reference).nonzero(as_tuple=True)
    differing = sorted(set(rows.tolist()))
    return f"first differs at column {int(columns.min())} of {reference.shape[1]}, rows {differing}"


def targets(out: dict[str, Any], batches: list[int]) -> dict[str, Any]:
    """Issue 8's targets: per-token <= HF compiled at each batch; warm-up <= 1/10 of HF compiled's."""
    per_token, warm = out["per_token_ms"], out["warmup_s"]
    hf = per_token.get("hf_compiled", {})
    hf_warm = warm.get("hf_compiled", {})
    result: dict[str, Any] = {}
    for name in ("devgraph_exact", "devgraph_fast", "devgraph_fast_windows"):
        mine = per_token.get(name, {})
        if not mine or not hf:
            continue
        ratios = {b: round(mine[b] / hf[b], 3) for b in map(str, batches) if b in mine and b in hf}
        entry: dict[str, Any] = {"per_token_over_hf_compiled": ratios}
        entry["per_token_met"] = bool(ratios) and all(r <= 1.0 for r in ratios.values())
        if name in warm and hf_warm:
            hf_total = sum(hf_warm.values())
            entry["warmup_over_hf_compiled_total"] = round(warm[name]["total"] / hf_total, 3)
            entry["warmup_over_hf_compiled_batch_1"] = round(
                warm[name]["total"] / hf_warm.get("1", hf_total), 3
            )
            entry["warmup_met"] = entry["warmup_over_hf_compiled_total"] <= 0.1
        result[name] = entry
    exact = out["tokens_equal_hf_eager"].get("devgraph_exact", {})
    result["devgraph_exact_tokens_identical"] = bool(exact) and all(v is True for v in exact.values())
    return result


def plot(out: dict[str, Any], path: Path, batches: list[int]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    names = list(out["per_token_ms"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(batches))
    for i, b in enumerate(batches):
        values = [out["per_token_ms"][n].get(str(b), 0) for n in names]
        left.bar([x + i * width for x in range(len(names))], values, width, label=f"batch {b}")
    left.set_xticks([x + width * (len(batches) - 1) / 2 for x in range(len(names))], names, rotation=20)
    left.set_ylabel("ms per token (median decode step)")
    left.set_yscale("log")
    left.legend()
    warm = out["warmup_s"]
    labels = [n for n in names if n in warm]
    totals = [sum(warm[n].values()) if n == "hf_compiled" else warm[n]["total"] for n in labels]
    bars = right.bar(labels, totals, color="tab:gray")
    right.bar_label(bars, fmt="%.1f")
    right.set_ylabel("warm-up seconds (all batch sizes)")
    right.set_yscale("log")
    right.tick_params(axis="x", rotation=20)
    fig.suptitle(f"{out['meta']['model']} on {out['meta']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def table(out: dict[str, Any], batches: list[int]) -> str:
    lines = [
        f"{'variant':<24}"
        + "".join(f"{'ms/tok b' + str(b):>12}" for b in batches)
        + f"{'warm-up s':>12}  tokens"
    ]
    for name, values in out["per_token_ms"].items():
        warm = out["warmup_s"].get(name)
        total = "" if warm is None else (sum(warm.values()) if name == "hf_compiled" else warm["total"])
        same = out["tokens_equal_hf_eager"].get(name, {})
        tokens = (
            "reference" if name == "hf_eager" else ", ".join(f"{k}: {v is True}" for k, v in same.items())
        )
        cells = "".join(f"{values.get(str(b), float('nan')):>12.3f}" for b in batches)
        lines.append(f"{name:<24}{cells}{total!s:>12}  {tokens}")
    lines.append(f"targets: {json.dumps(out['targets'])}")
    return "\n".join(lines)
