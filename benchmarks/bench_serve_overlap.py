"""The overlapped scheduler against the serial one: ``devgraph serve --scheduler serial|overlap``, same trace.

``--gpu`` (the recorded run, about 2 minutes on one H100): the Qwen3-0.6B-shaped preset the serving
benchmark uses (random weights, bf16, 32 running requests, a 2048-token step budget), one server process
per scheduler with its step timeline on (``DEVGRAPH_STEP_TIMELINE``: CUDA events around every runner run
and around the engine's whole device work of every forward). Each takes a warm-up, then 16 requests at
concurrency 1 and 64 at concurrency 32 (prompts of 32-256 random ids, 64-128 output tokens, greedy,
streamed over HTTP), then SIGTERM (it must exit 0). Per scheduler it records:

- ITL p50 at c=1 (the client's) against the decode graph's replay time alone at batch 1 (the median of
  the timeline's decode runs in that phase): the host's share of a step (target: ITL <= 1.03x replay);
- the device's idle time at c=32: the gaps between one forward's device work and the next (the host late
  with the next step), as a share of the phase's device time (target <= 5%);
- output tokens/s at c=32, against the previous round's figure for the same preset and GPU in
  ``benchmarks/results/h100-serve.json`` (target >= 2x);
- greedy equality: every request's tokens, serial vs overlap (at c=1 each step has the same shape under
  both schedulers, so every request must be identical; at c=32 the overlapped scheduler admits a request
  a step later, so batches differ and a near-tie may flip, as docs/serving.md "Determinism" explains).

Writes ``$OUT/serve-overlap.json`` and ``.png`` (``benchmarks/results/`` when ``OUT`` is unset).
``--smoke`` runs the same script on the CPU with the tiny preset (the host clock stands in for events).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_serve import ROOT, Server, _meta, _trace, compare

from devgraph.serve.bench.loadgen import run_load
from devgraph.serve.bench.report import summary_table

SCHEDULERS = ("serial", "overlap")
#: Each server this benchmark can run: its flags. ``--both-deliveries`` adds the overlapped scheduler with
#: ``--output-delivery next-issue`` to ``overlap`` (the default delivery, at-once) for an A/B in one run.
VARIANTS: dict[str, list[str]] = {
    "serial": ["--scheduler", "serial"],
    "overlap": ["--scheduler", "overlap"],
    "overlap_next_issue": ["--scheduler", "overlap", "--output-delivery", "next-issue"],
}
GPU: dict[str, Any] = {
    "server": [
        "--preset", "qwen3-0.6b", "--dtype", "bf16", "--device", "cuda",
        "--max-running-requests", "32", "--token-budget", "2048",
    ],
    "scenarios": {"c1": (1, 16, 1), "c32": (32, 64, 0)},  # name: (concurrency, requests, trace seed)
    "prompt_len": (32, 256),
    "output_len": (64, 128),
    "warmup": 12,
    "start_timeout": 600.0,
    "previous": "benchmarks/results/h100-serve.json",  # the previous round's server, same preset
}  # fmt: skip
SMOKE: dict[str, Any] = {
    "server": ["--preset", "tiny", "--device", "cpu", "--cpu-threads", "1", "--max-running-requests", "8"],
    "scenarios": {"c1": (1, 3, 1), "c8": (8, 10, 0)},
    "prompt_len": (8, 40),
    "output_len": (4, 12),
    "warmup": 2,
    "start_timeout": 300.0,
    "previous": None,
}
TARGETS = {"itl_over_replay": 1.03, "idle_share": 0.05, "tokens_per_s_over_previous": 2.0}


def run_scheduler(settings: dict[str, Any], scheduler: str, out: Path) -> dict[str, Any]:
    args = [*settings["server"], *VARIANTS[scheduler]]
    timeline = out / f"serve-overlap-timeline-{scheduler}.json"
    record: dict[str, Any] = {
        "server_command": f"DEVGRAPH_STEP_TIMELINE={timeline} "
        + shlex.join(["python", "-m", "devgraph.serve", *args])
    }
    env = {"DEVGRAPH_STEP_TIMELINE": str(timeline)}
    with Server(args, out / f"serve-overlap-{scheduler}.log", settings["start_timeout"], env) as server:
        record["startup_seconds"] = server.startup_seconds
        record["graphs_ready_seconds"] = server.wait_graphs()
        card = server.get("/v1/models")["data"][0]
        warm = _trace(settings, card, settings["warmup"], 99)
        asyncio.run(run_load(server.url, warm, concurrency=len(warm), progress=False, model=card["id"]))
        record["scenarios"], record["outputs"], record["windows"] = {}, {}, {}
        for name, (concurrency, count, seed) in settings["scenarios"].items():
            begin = time.monotonic()  # the server's timeline uses the same clock
            run = asyncio.run(
                run_load(
                    server.url, _trace(settings, card, count, seed), concurrency=concurrency, model=card["id"]
                )
            )
            record["windows"][name] = (begin, time.monotonic())
            print(f"[{scheduler}] {name}:\n{summary_table(run['summary'])}", flush=True)
            record["scenarios"][name] = run["summary"]
            record["outputs"][name] = [
                " ".join(map(str, r["token_ids"])) if r["ok"] else None for r in run["results"]
            ]
            record.setdefault("errors", []).extend(r["error"] for r in run["results"] if r["error"])
        record["engine_stats"] = server.get("/v1/engine/stats")
        record["exit_code"] = server.stop()
    record["timeline"] = analyse(json.loads(timeline.read_text()), record["windows"])
    return record


def _within(entries: list[dict[str, Any]], window: tuple[float, float]) -> list[dict[str, Any]]:
    begin, end = window
    return sorted((e for e in entries if begin <= e["host_s"] <= end), key=lambda e: e["device_start_ms"])


def idle(spans: list[dict[str, Any]]) -> dict[str, float]:
    """The device's idle time between the engine's forwards: the sum of the gaps between one span's end
    and the next one's start, over the phase's device time (first start to last end)."""
    if len(spans) < 2:
        return {"idle_ms": 0.0, "device_ms": 0.0, "idle_share": 0.0, "forwards": len(spans)}
    gaps = [
        max(0.0, b["device_start_ms"] - a["device_end_ms"]) for a, b in zip(spans, spans[1:], strict=False)
    ]
    total = spans[-1]["device_end_ms"] - spans[0]["device_start_ms"]
    return {
        "idle_ms": sum(gaps),
        "device_ms": total,
        "idle_share": sum(gaps) / total if total > 0 else 0.0,
        "gap_ms_p50": statistics.median(gaps),
        "gap_ms_max": max(gaps),
        "forwards": len(spans),
    }


def analyse(timeline: dict[str, Any], windows: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Per load phase: the decode runs' replay time at batch 1, the forwards' device time, the idle share."""
    report: dict[str, Any] = {}
    for name, window in windows.items():
        runs = _within(timeline["steps"], window)
        spans = _within(timeline.get("spans", []), window)
        single = [e["device_end_ms"] - e["device_start_ms"] for e in runs if e["phase"] == "decode"]
        single_1 = [
            e["device_end_ms"] - e["device_start_ms"]
            for e in runs
            if e["phase"] == "decode" and e["requests"] == 1
        ]
        report[name] = {
            "runs": len(runs),
            "decode_replay_ms_p50": statistics.median(single) if single else None,
            "decode_replay_ms_p50_batch1": statistics.median(single_1) if single_1 else None,
            "decode_span_ms_p50": statistics.median(
                [e["device_end_ms"] - e["device_start_ms"] for e in spans if e["phase"] == "decode"] or [0.0]
            ),
            **idle(spans),
            # A few consecutive spans, for the picture.
            "sample": [
                (e["phase"], e["device_start_ms"], e["device_end_ms"]) for e in spans[len(spans) // 2 :][:24]
            ],
        }
    return report


def targets(records: dict[str, dict[str, Any]], settings: dict[str, Any], identity: dict[str, Any]) -> dict:
    low, high = (min(settings["scenarios"], key=_concurrency), max(settings["scenarios"], key=_concurrency))
    previous = _previous(settings)
    result: dict[str, Any] = {}
    for scheduler, record in records.items():
        itl = record["scenarios"][low]["itl_ms"]["p50"]
        replay = record["timeline"][low]["decode_replay_ms_p50_batch1"]
        share = record["timeline"][high]["idle_share"]
        tps = record["scenarios"][high]["output_tokens_per_s"]
        entry: dict[str, Any] = {
            f"itl_p50_{low}_ms": itl,
            f"decode_replay_{low}_ms": replay,
            "itl_over_replay": None if not replay else itl / replay,
            f"device_idle_share_{high}": share,
            f"output_tokens_per_s_{high}": tps,
        }
        entry["itl_met"] = (
            entry["itl_over_replay"] is not None and entry["itl_over_replay"] <= TARGETS["itl_over_replay"]
        )
        entry["idle_met"] = share <= TARGETS["idle_share"]
        if previous is not None:
            entry["tokens_per_s_over_previous"] = tps / previous
            entry["tokens_per_s_met"] = tps / previous >= TARGETS["tokens_per_s_over_previous"]
        result[scheduler] = entry
    result["previous_output_tokens_per_s"] = previous
    result["greedy_identical"] = {k: f"{v['identical']}/{v['requests']}" for k, v in identity.items()}
    result["greedy_identical_at_c1"] = identity[low]["identical"] == identity[low]["requests"]
    return result


def _previous(settings: dict[str, Any]) -> float | None:
    path = settings.get("previous")
    if not path or not (ROOT / path).exists():
        return None
    data = json.loads((ROOT / path).read_text())
    return float(data["groups"]["default"]["modes"]["auto"]["scenarios"]["c32"]["output_tokens_per_s"])


def _concurrency(name: str) -> int:
    return int("".join(c for c in name if c.isdigit()))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, targets_ = result["schedulers"], result["targets"]
    names = list(records)
    low, high = (
        min(result["settings"]["scenarios"], key=_concurrency),
        max(result["settings"]["scenarios"], key=_concurrency),
    )
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    itl = [targets_[n][f"itl_p50_{low}_ms"] for n in names]
    replay = [targets_[n][f"decode_replay_{low}_ms"] or 0.0 for n in names]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], itl, 0.4, label=f"ITL p50 at {low} (client)")
    ax.bar([x + 0.2 for x in xs], replay, 0.4, label="decode graph replay, batch 1")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("ms")
    ax.set_title(f"ITL vs replay at {low} (target ITL <= {TARGETS['itl_over_replay']}x replay)")
    ax.legend()
    ax = axes[0][1]
    ax.bar(names, [100 * targets_[n][f"device_idle_share_{high}"] for n in names])
    ax.axhline(100 * TARGETS["idle_share"], color="red", linestyle="--", label="target")
    ax.set_ylabel("% of device time")
    ax.set_title(f"device idle between forwards at {high}")
    ax.legend()
    ax = axes[1][0]
    tps = [targets_[n][f"output_tokens_per_s_{high}"] for n in names]
    ax.bar(names, tps)
    if targets_.get("previous_output_tokens_per_s"):
        previous = targets_["previous_output_tokens_per_s"]
        ax.axhline(previous, color="gray", linestyle=":", label="previous round")
        ax.axhline(2 * previous, color="red", linestyle="--", label="target (2x)")
        ax.legend()
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput at {high}")
    ax = axes[1][1]
    for row, name in enumerate(names):
        sample = records[name]["timeline"][high]["sample"]
        if not sample:
            continue
        origin = sample[0][1]
        for phase, start, end in sample:
            ax.barh(
                row, end - start, left=start - origin, color="tab:blue" if phase == "decode" else "tab:orange"
            )
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("ms (blue: decode, orange: prefill/mixed; white: the device idle)")
    ax.set_title(f"consecutive forwards on the device at {high}")
    fig.suptitle(f"devgraph serve --scheduler serial vs overlap, {result['meta']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--gpu", action="store_true", help="the recorded H100 run")
    which.add_argument("--smoke", action="store_true", help="the same script on the CPU, tiny preset")
    parser.add_argument("--out", default=None, help="output folder (default: $OUT, else benchmarks/results)")
    parser.add_argument(
        "--both-deliveries",
        action="store_true",
        help="a third server: overlapped with --output-delivery next-issue (overlap: the default, at-once)",
    )
    args = parser.parse_args(argv)
    settings = GPU if args.gpu else SMOKE
    out = Path(args.out or os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    name = "serve-overlap" if args.gpu else "serve-overlap-smoke"
    start = time.perf_counter()
    names = [*SCHEDULERS, *(["overlap_next_issue"] if args.both_deliveries else [])]
    records = {name: run_scheduler(settings, name, out) for name in names}
    identity = compare(records["serial"], records["overlap"])
    result: dict[str, Any] = {
        "meta": _meta([sys.argv[0], *sys.argv[1:]]),
        "settings": settings,
        "schedulers": records,
        "identity": identity,
    }
    result["targets"] = targets(records, settings, identity)
    result["exit_codes_zero"] = all(r["exit_code"] == 0 for r in records.values())
    result["seconds"] = time.perf_counter() - start
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, out / f"{name}.png")
    except Exception as exc:  # the JSON is the record; a missing matplotlib only costs the picture
        print(f"no plot: {exc}", file=sys.stderr)
    print(json.dumps(result["targets"], indent=1))
    print(f"wrote {out / (name + '.json')} in {result['seconds']:.0f} s")
    ok = result["exit_codes_zero"] and result["targets"]["greedy_identical_at_c1"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
