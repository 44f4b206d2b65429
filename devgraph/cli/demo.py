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

from devgraph.contract.context import forward_context
from devgraph.contract.platform import GraphPlatform
from devgraph.flag.config import DeviceGraphConfig
from devgraph.flag.factory import resolve_platform
from devgraph.runner.graph_runner import GraphRunner

__all__ = ["run_demo", "DemoRow"]

DEFAULT_DECODE_SIZES = [1, 2, 4, 8, 16]
DEFAULT_PREFILL_SIZES = [16, 32, 64, 128]


@dataclass
class DemoRow:
    phase: str
    batch: str
    key: str | None
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


def _prefill_cases(sizes: list[int], max_seq_len: int) -> list[list[int]]:
    top = min(max(sizes), max_seq_len)
    cases = [[min(s, max_seq_len)] for s in sizes]
    cases.append([max(1, top // 4), max(1, top // 4) + 3])  # two requests, padded
    cases.append([max(1, top // 8)] * 4)  # four requests packed
    cases.append([min(top // 2 + 1, max_seq_len), min(top // 2 + 7, max_seq_len)])  # past the largest: eager
    return cases


def _measure(runner: GraphRunner, label: str, batch: dict[str, Any], context: Any, iters: int) -> DemoRow:
    platform = runner.platform
    result = runner.verify(context=context, **batch)

    def eager() -> Any:
        with forward_context(context), torch.no_grad():
            return runner.forward(**batch)

    eager_ms = _median_ms(eager, platform, iters)
    graph_ms = _median_ms(lambda: runner.run(context=context, **batch), platform, iters)
    return DemoRow(
        runner.phase,
        label,
        str(result.key) if result.replayed else None,
        eager_ms,
        graph_ms,
        result.max_abs_diff,
        result.max_abs_diff_unpadded,
    )


def _print_table(title: str, rows: list[DemoRow]) -> None:
    print(f"\n{title}")
    header = (
        f"  {'batch':>14} {'graph key':>26} {'eager ms':>9} {'graph ms':>9} {'speedup':>8} "
        f"{'max|graph-eager|':>17} {'vs eager(n)':>12}"
    )
    print(header)
    print("  " + "-" * (len(header) - 2))
    for r in rows:
        print(
            f"  {r.batch:>14} {r.key or 'eager':>26} {r.eager_ms:>9.3f} {r.graph_ms:>9.3f} "
            f"{r.speedup:>7.2f}x {r.max_abs_diff:>17.3g} {r.max_abs_diff_unpadded:>12.3g}"
        )


def run_demo(args: argparse.Namespace) -> int:
    from devgraph.reference import (
        ReferenceConfig,
        ReferenceModel,
        batch_context,
        decode_runner,
        make_decode_batch,
        make_prefill_batch,
        prefill_runner,
    )

    config = DeviceGraphConfig.parse(args.device_graph_mode)
    platform = resolve_platform(args.device)
    device = torch.device(args.device) if args.device else platform.default_device()
    on_cpu = device.type == "cpu"
    preset = args.preset or ("tiny" if on_cpu else "qwen3-0.6b")
    iters = args.iters or (10 if on_cpu else 20)
    overrides: dict[str, Any] = {}
    if getattr(args, "attention", None):
        overrides["attention"] = args.attention
    model_config = ReferenceConfig.preset(preset, **overrides)
    print(
        f"devgraph demo: reference model '{preset}' ({model_config.dtype}, "
        f"{model_config.attention} attention) on {platform.describe()} [{device}]"
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
        "attention": model_config.attention,
        "phases": {},
    }
    seq = model_config.max_seq_len
    decode_batches = [
        (f"{n} req", make_decode_batch(model, n, seq_lens=min(seq, 48 + 7 * n), seed=args.seed + n))
        for n in _decode_cases(decode_sizes, model_config.max_requests)
    ]
    prefill_batches = [
        ("+".join(map(str, lens)), make_prefill_batch(model, lens, seed=args.seed))
        for lens in _prefill_cases(prefill_sizes, seq)
        if len(lens) <= model_config.max_requests
    ]
    phases = (
        ("decode", decode_runner, decode_sizes, decode_batches),
        ("prefill", prefill_runner, prefill_sizes, prefill_batches),
    )
    for phase, build, sizes, batches in phases:
        with build(model, config=config, sizes=sizes) as runner:
            report = runner.capture()
            print(f"\n{report.table()}")
            rows = [_measure(runner, label, batch, batch_context(batch), iters) for label, batch in batches]
            _print_table(f"{phase} ({runner.backend.name}): median over {iters} runs", rows)
            stats = runner.stats()
            print(
                f"  steps {stats['steps']}: {stats['replays']} replayed, {stats['eager']} eager "
                f"({', '.join(f'{k} {v}' for k, v in stats['eager_by_reason'].items() if v) or 'none'}); "
                f"padding waste {stats['padding_waste']:.1%}"
            )
            results["phases"][phase] = {
                "backend": runner.backend.name,
                "capture": {
                    "seconds": report.seconds,
                    "bytes": report.bytes,
                    "keys": [str(k.key) for k in report.keys],
                },
                "rows": [asdict(r) for r in rows],
                "stats": stats,
            }
    worst = max(r["max_abs_diff"] for p in results["phases"].values() for r in p["rows"])
    print(f"\nmax |graph - eager| over every size, same padded batch: {worst:.3g}")
    if on_cpu:
        print(
            "note: on the CPU, graphs are simulated (replay re-runs the recorded ops), so they check "
            "correctness, not speed."
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    return 0
