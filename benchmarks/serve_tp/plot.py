"""The picture beside the JSON: ITL at c=1, tokens/s under load, and the host's share of a step and the
device's idle share, per server (one device and ``--tp 2``, each checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot"]


def plot(data: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    servers = [name for name, entry in data["servers"].items() if "loads" in entry]
    if not servers:
        return
    loads = {name: data["servers"][name]["loads"] for name in servers}
    timelines = {name: data["servers"][name].get("timeline", {}) for name in servers}
    timelines = {name: t if isinstance(t, dict) else {} for name, t in timelines.items()}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    itl = [loads[n].get("c1", {}).get("tpot_ms", {}).get("p50", 0) for n in servers]
    step = [timelines[n].get("c1", {}).get("decode_device_ms", {}).get("p50", 0) for n in servers]
    x = range(len(servers))
    axes[0].bar([i - 0.2 for i in x], itl, 0.4, label="ITL: TPOT p50 (client)")
    axes[0].bar([i + 0.2 for i in x], step, 0.4, label="decode step on the device")
    floor = data.get("floor", {}).get("floor_ms_spec_bandwidth")
    if floor:
        axes[0].axhline(floor, color="k", linestyle=":", label="8b bandwidth floor, 1 GPU")
    axes[0].set_title("c=1: ms per token")
    axes[0].legend(fontsize=7)
    heaviest = {n: max(loads[n], key=lambda k: loads[n][k].get("concurrency", 0)) for n in servers}
    axes[1].bar(x, [loads[n][heaviest[n]].get("output_tokens_per_s", 0) for n in servers])
    axes[1].set_title("output tokens/s at the highest concurrency")
    for i, n in enumerate(servers):
        axes[1].annotate(heaviest[n], (i, 0), ha="center", va="bottom", fontsize=7)
    idle = [100 * (timelines[n].get("c32", {}).get("idle_share") or 0) for n in servers]
    host = [100 * (1 - s / i) if i and s else 0 for i, s in zip(itl, step, strict=True)]
    axes[2].bar([i - 0.2 for i in x], host, 0.4, label="host share of a step at c=1")
    axes[2].bar([i + 0.2 for i in x], idle, 0.4, label="device idle between steps at c=32")
    axes[2].set_title("%")
    axes[2].legend(fontsize=7)
    for axis in axes:
        axis.set_xticks(list(x))
        axis.set_xticklabels(servers, rotation=20, fontsize=7)
    fig.suptitle(
        f"devgraph serve, one device vs --tp 2 ({data.get('device')}, torch {data.get('torch')})", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
