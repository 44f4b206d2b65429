"""Graph memory before the KV cache, and release/restore: the estimate made before capture against the bytes
measured after it, the bytes ``release()`` hands back to the driver, ``restore()`` seconds against capture
seconds, and the tokens before and after.

    python benchmarks/bench_memory.py --out $OUT/memory.json     # GPU, <= 4 min
    python benchmarks/bench_memory.py --smoke                     # the script on the CPU

The reference model at the Qwen3-0.6B shape (bf16, paged attention, seeded weights) in a serving
:class:`~devgraph.serve.engine.Engine` (``--graphs``, default ``full``: graphs without compile; 64 running
requests, 2048-token budget) with 9 decode sizes and 9 prefill sizes. Per phase: ``estimate_graph_memory()``
(4 probe keys into a throw-away pool, released) and the free memory before and after it; ``capture()``
timed and its exact per-key bytes (``graph_memory()``, the pool's growth per key) with the free-memory drop
across it; greedy tokens of 16 prompts; ``release()`` with ``torch.cuda.mem_get_info`` before and after
(bytes back / graph bytes); ``restore()`` timed; the same prompts again. Targets: estimate within 10 % of
the measured bytes, >= 95 % back, restore <= 1.5x capture, tokens equal.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from harness.device import Budget, Device, start
from harness.plots import Panel, plot_panels
from harness.report import Report, environment, output_path
from harness.targets import Target, targets_table

from devgraph.platforms.sim.device_memory import reserved_bytes
from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.engine import Engine, EngineConfig, SamplingParams

log = logging.getLogger("bench_memory")

MiB = 1 << 20
DECODE = [1, 2, 4, 8, 16, 24, 32, 48, 64]
PREFILL = [64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
SMOKE_DECODE = [1, 2, 3, 4, 5, 6, 7, 8]
SMOKE_PREFILL = [8, 16, 24, 32, 40, 48, 56, 64]


def free_bytes(dev: Device) -> int:
    """The driver's free bytes (CUDA); on the CPU, minus the simulator's pool bytes (so a release shows)."""
    if dev.cuda:
        dev.sync()
        return int(torch.cuda.mem_get_info()[0])
    return -reserved_bytes()


def build(smoke: bool, device: torch.device, graphs: str) -> Engine:
    if smoke:
        config = ReferenceConfig.preset("tiny", num_layers=1, max_requests=8)
        engine_config, decode, prefill = EngineConfig(8, 64), SMOKE_DECODE, SMOKE_PREFILL
    else:
        config = ReferenceConfig.preset("qwen3-0.6b", max_requests=64, max_seq_len=1024)
        engine_config, decode, prefill = EngineConfig(64, 2048), DECODE, PREFILL
    model = ReferenceModel(config, device=device, seed=0)
    flag = json.dumps(
        {"decode": {"backend": graphs, "sizes": decode}, "prefill": {"backend": graphs, "sizes": prefill}}
    )
    return Engine(model, engine_config, device_graph_mode=flag, progress=False, capture=False)


def prompts(engine: Engine) -> list[list[int]]:
    rng = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    lengths = torch.randint(4, 200 if engine.model_config.max_seq_len > 256 else 40, (16,), generator=rng)
    return [torch.randint(0, vocab, (int(n),), generator=rng).tolist() for n in lengths]


def phase(runner: Any, dev: Device) -> dict[str, Any]:
    """Estimate, capture, and what the estimate and capture cost in free memory."""
    dev.settle()
    free0 = free_bytes(dev)
    fitted = runner.estimate_graph_memory(probes=4)  # the quick form, for comparison
    dev.settle()
    estimate = runner.estimate_graph_memory()  # the default: every key captured once, then released
    dev.settle()
    free1 = free_bytes(dev)
    start_s = time.perf_counter()
    report = runner.capture()
    dev.sync()
    capture_s = time.perf_counter() - start_s
    free2 = free_bytes(dev)
    measured = runner.graph_memory()
    error = (
        (estimate.total_bytes - measured.total_bytes) / measured.total_bytes if measured.total_bytes else None
    )
    return {
        "keys": len(report.keys),
        "sizes": sorted({k.key.tokens for k in report.keys}),
        "estimate": estimate.as_dict(),
        "estimate_from_4_probes": fitted.as_dict(),
        "estimate_from_4_probes_error": (
            round((fitted.total_bytes - measured.total_bytes) / measured.total_bytes, 4)
            if measured.total_bytes
            else None
        ),
        "estimate_free_bytes_not_back": free0 - free1,
        "measured": measured.as_dict(),
        "capture_free_bytes_drop": free1 - free2,
        "estimate_error": None if error is None else round(error, 4),
        "capture_s": round(capture_s, 4),
        "capture_report_s": round(report.seconds, 4),
    }


def release_restore(runner: Any, dev: Device, capture_s: float) -> dict[str, Any]:
    held = runner.graph_memory().total_bytes
    dev.settle()
    before = free_bytes(dev)
    released = runner.release()
    after = free_bytes(dev)
    start_s = time.perf_counter()
    report = runner.restore()
    dev.sync()
    restore_s = time.perf_counter() - start_s
    back = after - before
    return {
        "graph_bytes": held,
        "released_keys": len(released.keys),
        "bytes_back": back,
        "back_share": round(back / held, 4) if held else None,
        "restore_s": round(restore_s, 4),
        "restore_over_capture": round(restore_s / capture_s, 4) if capture_s else None,
        "restored_keys": len(report.keys),
        "graph_bytes_after_restore": runner.graph_memory().total_bytes,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--out", help="JSON path (default $OUT/memory.json); the PNG beside it")
    parser.add_argument("--graphs", default="full", help="graph mode of both phases (default full)")
    parser.add_argument("--time-budget", type=float, default=240.0, help="seconds (default 240)")
    args = parser.parse_args(argv)
    if not start(args.smoke):
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        torch.set_num_threads(1)
    budget = Budget(args.time_budget)
    dev = Device(device)
    path = output_path("memory.json", "benchmarks/results/memory.json", args.out, args.smoke)
    report = Report(path, environment(dev))
    data = report.data
    engine = build(args.smoke, device, args.graphs)
    data["model"] = "tiny" if args.smoke else "qwen3-0.6b"
    data["graphs"] = args.graphs
    warm = engine.generate([[1] * 16], SamplingParams(max_tokens=2))  # eager first-use costs, untimed
    del warm
    runners = {"decode": engine.decode_runner, "prefill": engine.prefill_runner}
    phases: dict[str, dict[str, Any]] = {}
    for name, runner in runners.items():
        try:
            phases[name] = phase(runner, dev)
            log.info(
                "%s: %s", name, {k: v for k, v in phases[name].items() if k not in ("estimate", "measured")}
            )
        except Exception as exc:
            report.error(f"{name} estimate and capture", exc)
        data["phases"] = phases
        report.save()
    params = SamplingParams(max_tokens=16)
    work = prompts(engine)
    before = engine.generate(work, params)
    for name, runner in runners.items():
        if name not in phases:
            continue
        if not budget.allows(3 * phases[name]["capture_s"]):
            log.warning("time budget: no release/restore of %s", name)
            continue
        try:
            phases[name]["release_restore"] = release_restore(runner, dev, phases[name]["capture_s"])
            log.info("%s: %s", name, phases[name]["release_restore"])
        except Exception as exc:
            report.error(f"{name} release and restore", exc)
        report.save()
    after = engine.generate(work, params)
    same = sum(a == b for a, b in zip(before, after, strict=True))
    replays = {n: r.stats()["replays"] for n, r in runners.items()}
    data["tokens"] = {"prompts": len(work), "prompts_equal": same, "all_equal": same == len(work)}
    data["replays"] = replays
    engine.close()
    total_est = sum(p["estimate"]["total_bytes"] for p in phases.values())
    total_measured = sum(p["measured"]["total_bytes"] for p in phases.values())
    rr = [p["release_restore"] for p in phases.values() if "release_restore" in p]
    worst_error = max(
        (abs(p["estimate_error"]) for p in phases.values() if p["estimate_error"] is not None), default=None
    )
    worst_back = min((r["back_share"] for r in rr if r["back_share"] is not None), default=None)
    worst_restore = max(
        (r["restore_over_capture"] for r in rr if r["restore_over_capture"] is not None), default=None
    )
    data["summary"] = {
        "estimate_bytes": total_est,
        "measured_bytes": total_measured,
        "worst_estimate_error": worst_error,
        "worst_back_share": worst_back,
        "worst_restore_over_capture": worst_restore,
        "seconds": round(budget.elapsed(), 2),
    }
    targets = [
        Target("estimate error, worst phase (|est/measured - 1|)", worst_error, 0.10),
        Target("bytes back from release / graph bytes, worst phase", worst_back, 0.95, higher=True),
        Target("restore / capture seconds, worst phase", worst_restore, 1.5, "x"),
        Target("tokens equal before and after (1 = yes)", float(same == len(work)), 1.0, higher=True),
    ]
    data["targets"] = [t.as_dict() for t in targets]
    report.save()
    names = list(phases)
    panels = [
        Panel(
            "graph memory per phase",
            names,
            {
                "estimate (before capture)": [phases[n]["estimate"]["total_bytes"] / MiB for n in names],
                "measured (after capture)": [phases[n]["measured"]["total_bytes"] / MiB for n in names],
                "back from release": [
                    phases[n]["release_restore"]["bytes_back"] / MiB
                    if "release_restore" in phases[n]
                    else None
                    for n in names
                ],
            },
            ylabel="MiB",
            bars=True,
        ),
        Panel(
            "capture vs restore",
            names,
            {
                "capture": [phases[n]["capture_s"] for n in names],
                "restore": [phases[n].get("release_restore", {}).get("restore_s") for n in names],
            },
            ylabel="seconds",
            bars=True,
        ),
    ]
    if importlib.util.find_spec("matplotlib") is None:
        log.warning("matplotlib is not installed: no PNG")
    else:
        plot_panels(
            path.with_suffix(".png"), panels, f"graph memory: estimate, release, restore ({dev.name()})"
        )
    print(f"summary: {data['summary']}\ntokens: {data['tokens']}\nwrote {path}\n")
    print(targets_table(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
