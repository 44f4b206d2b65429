"""Token agreement with transformers, the targets of the run, and the PNG beside the JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.targets import Target

__all__ = ["agreement", "plot", "targets"]


def agreement(got: list[list[int] | None], expected: list[list[int]]) -> dict[str, Any]:
    """Per prompt: equal, or the index of the first new token that differs (``None`` for a failed request)."""
    first: list[int | None] = []
    for tokens, reference in zip(got, expected, strict=True):
        if tokens is None:
            first.append(-1)
            continue
        index = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), None)
        if index is None and len(tokens) != len(reference):
            index = min(len(tokens), len(reference))
        first.append(index)
    equal = sum(i is None for i in first)
    return {"equal": equal, "prompts": len(expected), "first_difference": first}


def targets(result: dict[str, Any], low: str, high: str) -> list[Target]:
    """The issue's targets, per server configuration that ran."""
    found: list[Target] = []
    hf = result.get("hf", {})
    per_token = hf.get("compiled_b1", {}).get("per_token_ms")
    hf_tps = next(
        (
            v["output_tokens_per_s"]
            for k, v in hf.items()
            if k.startswith("compiled_b") and k != "compiled_b1"
        ),
        None,
    )
    configs = result.get("servers", {})
    for name in ("deterministic", "deterministic_fp32"):
        for load in ("alone", "loaded"):
            match = configs.get(name, {}).get(f"agreement_{load}")
            if match:
                found.append(
                    Target(
                        f"{name}: greedy = HF eager, every prompt ({load})",
                        match["equal"] / match["prompts"],
                        1.0,
                        higher=True,
                        detail=f"{match['equal']}/{match['prompts']}; first differing token per prompt "
                        f"{match['first_difference']}",
                    )
                )
    for name, record in configs.items():
        scenarios = record.get("scenarios", {})
        if per_token and low in scenarios:
            itl = scenarios[low]["itl_ms"]["p50"]
            found.append(
                Target(
                    f"{name}: ITL p50 {low} / HF compiled per-token b1",
                    itl / per_token,
                    0.8,
                    detail=f"{itl:.3f} ms vs {per_token:.3f} ms",
                )  # fmt: skip
            )
        if hf_tps and high in scenarios:
            tps = scenarios[high]["output_tokens_per_s"]
            found.append(
                Target(
                    f"{name}: output tok/s {high} / HF compiled",
                    tps / hf_tps,
                    3.0,
                    higher=True,
                    detail=f"{tps:.0f} vs {hf_tps:.0f} tokens/s",
                )  # fmt: skip
            )
    return found


def plot(result: dict[str, Any], path: Path, low: str, high: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    configs = result.get("servers", {})
    names = list(configs)
    hf = result.get("hf", {})
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (itl_ax, tps_ax), (start_ax, oracle_ax) = axes
    itl = [
        configs[n].get("scenarios", {}).get(low, {}).get("itl_ms", {}).get("p50", float("nan")) for n in names
    ]
    itl_ax.bar_label(itl_ax.bar(names, itl, color="tab:blue"), fmt="%.2f")
    if "compiled_b1" in hf:
        itl_ax.axhline(
            hf["compiled_b1"]["per_token_ms"], color="black", linestyle="--", label="HF compiled b1"
        )
        itl_ax.axhline(
            0.8 * hf["compiled_b1"]["per_token_ms"], color="red", linestyle=":", label="target 0.8x"
        )
        itl_ax.legend(fontsize=8)
    itl_ax.set_title(f"inter-token latency p50 at {low} (ms)")
    tps = [
        configs[n].get("scenarios", {}).get(high, {}).get("output_tokens_per_s", float("nan")) for n in names
    ]
    tps_ax.bar_label(tps_ax.bar(names, tps, color="tab:green"), fmt="%.0f")
    big = [v for k, v in hf.items() if k.startswith("compiled_b") and k != "compiled_b1"]
    if big:
        tps_ax.axhline(big[0]["output_tokens_per_s"], color="black", linestyle="--", label="HF compiled")
        tps_ax.axhline(3 * big[0]["output_tokens_per_s"], color="red", linestyle=":", label="target 3x")
        tps_ax.legend(fontsize=8)
    tps_ax.set_title(f"output tokens/s at {high}")
    stages = ("model_read_s", "weights_s", "graphs_s", "warm_up_s")
    bottom = [0.0] * len(names)
    for stage in stages:
        values = [configs[n].get("startup", {}).get("server_stages", {}).get(stage, 0.0) for n in names]
        start_ax.bar(names, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    first = [configs[n].get("startup", {}).get("first_response_s", float("nan")) for n in names]
    start_ax.plot(names, first, "k^", label="first response (from spawn)")
    start_ax.set_title("start-up seconds")
    start_ax.legend(fontsize=8)
    for n in names:
        match = configs[n].get("agreement_alone")
        if match:
            xs = range(len(match["first_difference"]))
            ys = [result["new_tokens"] if d is None else d for d in match["first_difference"]]
            oracle_ax.plot(xs, ys, "o-", label=f"{n} ({match['equal']}/{match['prompts']} equal)")
    oracle_ax.set_title(f"first token differing from HF eager (= {result.get('new_tokens')}: all equal)")
    oracle_ax.set_xlabel("prompt")
    oracle_ax.set_ylim(-0.5, result.get("new_tokens", 1) + 1)
    oracle_ax.legend(fontsize=8)
    for ax in (itl_ax, tps_ax, start_ax):
        ax.tick_params(axis="x", rotation=15)
    fig.suptitle(f"devgraph serve --model (Qwen3-0.6B-shaped checkpoint) on {result['meta']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
