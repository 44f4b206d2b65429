"""``devgraph demo``: the reference model's decode and prefill, eager vs graphs, on the best device here."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from devgraph.config import DeviceGraphConfig
from devgraph.context import forward_context
from devgraph.factory import resolve_platform
from devgraph.platform import GraphPlatform
from devgraph.runner import GraphRunner

__all__ = ["run_demo", "DemoRow"]

DEFAULT_DECODE_SIZES = [1, 2, 4, 8, 16]
DEFAULT_PREFILL_SIZES = [16, 32, 64, 128]


@dataclass
class DemoRow:
    phase: str
    n: int
    size: int | None
    eager_ms: float
    graph_ms: float
    max_abs_diff: float
    max_abs_diff_unpadded: float

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.graph_ms if self.graph_ms else float("nan")


def _median_ms(fn: Callable[[], Any], platform: GraphPlatform, iters: int) -> float:
    fn()
    platform.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        platform.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _decode_cases(sizes: list[int], max_requests: int) -> list[int]:
    top = max(sizes)
    cases = set(sizes) | {s - 1 for s in sizes if s > 2} | {top + 3}
    return sorted(n for n in cases if 1 <= n <= max_requests)


def _prefill_cases(sizes: list[int]) -> list[list[int]]:
    top = max(sizes)
    cases = [[s] for s in sizes]
    cases.append([max(1, top // 4), max(1, top // 4) + 3])  # two requests, padded
    cases.append([top // 2 + 1, top // 2 + 7])  # past the largest size: eager fallback
    return cases


def _measure(runner: GraphRunner, batch: dict[str, torch.Tensor], context: Any, iters: int) -> DemoRow:
    n = next(iter(batch.values())).shape[0]
    platform = runner.platform
    result = runner.verify(n, context, **batch)

    def eager() -> Any:
        with forward_context(context):
            return runner.forward(**batch)

    eager_ms = _median_ms(eager, platform, iters)
    graph_ms = _median_ms(lambda: runner.run(n, context, **batch), platform, iters)
    return DemoRow(
        runner.phase,
        n,
        result.size if result.replayed else None,
        eager_ms,
        graph_ms,
        result.max_abs_diff,
        result.max_abs_diff_unpadded,
    )


def _print_table(title: str, rows: list[DemoRow]) -> None:
    print(f"\n{title}")
    header = (
        f"  {'n':>6} {'graph size':>10} {'eager ms':>10} {'graph ms':>10} {'speedup':>8} "
        f"{'max|graph-eager|':>17} {'vs eager(n)':>12}"
    )
    print(header)
    print("  " + "-" * (len(header) - 2))
    for r in rows:
        size = str(r.size) if r.size is not None else "eager"
        print(
            f"  {r.n:>6} {size:>10} {r.eager_ms:>10.3f} {r.graph_ms:>10.3f} {r.speedup:>7.2f}x "
            f"{r.max_abs_diff:>17.3g} {r.max_abs_diff_unpadded:>12.3g}"
        )


def run_demo(args: argparse.Namespace) -> int:
    from devgraph.reference import (
        ReferenceConfig,
        ReferenceModel,
        decode_context,
        decode_runner,
        make_decode_batch,
        make_prefill_batch,
        prefill_context,
        prefill_runner,
    )

    config = DeviceGraphConfig.parse(args.device_graph_mode)
    platform = resolve_platform(args.device)
    device = torch.device(args.device) if args.device else platform.default_device()
    on_cpu = device.type == "cpu"
    preset = args.preset or ("tiny" if on_cpu else "qwen3-0.6b")
    iters = args.iters or (10 if on_cpu else 20)
    model_config = ReferenceConfig.preset(preset)
    print(
        f"devgraph demo: reference model '{preset}' ({model_config.dtype}) "
        f"on {platform.describe()} [{device}]"
    )
    print(f"--device-graph-mode {config.source}")
    model = ReferenceModel(model_config, device=device, seed=args.seed)
    model.randomize_cache(seed=args.seed)

    decode_sizes = args.decode_sizes or DEFAULT_DECODE_SIZES
    prefill_sizes = args.prefill_sizes or DEFAULT_PREFILL_SIZES
    results: dict[str, Any] = {
        "preset": preset,
        "device": str(device),
        "platform": platform.describe(),
        "mode": config.source,
        "phases": {},
    }
    phases = (
        (
            "decode",
            decode_runner,
            decode_sizes,
            [
                (make_decode_batch(model, n, seed=args.seed + n), None)
                for n in _decode_cases(decode_sizes, model_config.max_requests)
            ],
            decode_context,
        ),
        (
            "prefill",
            prefill_runner,
            prefill_sizes,
            [
                (make_prefill_batch(model, lens, seed=args.seed), lens)
                for lens in _prefill_cases(prefill_sizes)
            ],
            None,
        ),
    )
    for phase, build, sizes, batches, decode_ctx in phases:
        with build(model, config=config, sizes=sizes) as runner:
            report = runner.capture()
            print(f"\n{report.table()}")
            rows = []
            for batch, lens in batches:
                context = decode_ctx(batch) if decode_ctx else prefill_context(lens)
                rows.append(_measure(runner, batch, context, iters))
            _print_table(f"{phase} ({runner.backend.name}): median over {iters} runs", rows)
            results["phases"][phase] = {
                "backend": runner.backend.name,
                "capture": asdict(report),
                "rows": [asdict(r) for r in rows],
            }
    worst = max(r["max_abs_diff"] for p in results["phases"].values() for r in p["rows"])
    print(f"\nmax |graph - eager| over every size, same padded batch: {worst:.3g}")
    if worst:
        print(
            "  non-zero where a graph attends over the whole KV-cache window while eager steps trim it to "
            "the "
            "forward context's max_seq_len (float32 sums round differently; see docs/user-guide.md, "
            "'Checking a runner')"
        )
    if on_cpu:
        print(
            "note: on the CPU, graphs are simulated (replay re-runs the recorded ops), so they check "
            "correctness, not speed."
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    return 0
