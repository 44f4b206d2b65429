"""``devgraph demo``: the reference model's decode and prefill, eager vs graphs, on the best device here."""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from devgraph import DeviceGraphConfig, GraphPlatform, GraphRunner, forward_context, resolve_platform

__all__ = ["run_demo", "DemoRow"]

DEFAULT_DECODE_SIZES = [1, 2, 4, 8, 16]
DEFAULT_PREFILL_SIZES = [16, 32, 64, 128]


@dataclass
class DemoRow:
    """One batch: graph output against eager output, and on a real device the median times of both
    (``None`` on the simulated CPU platform, which measures no speed)."""

    phase: str
    batch: str
    key: str | None
    max_abs_diff: float
    max_abs_diff_unpadded: float
    matches: bool
    eager_ms: float | None = None
    graph_ms: float | None = None

    @property
    def speedup(self) -> float | None:
        """Eager time over graph time (> 1: the graph is faster); ``None`` where nothing was timed."""
        if self.eager_ms is None or not self.graph_ms:
            return None
        return self.eager_ms / self.graph_ms


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


def _measure(
    runner: GraphRunner, label: str, batch: dict[str, Any], context: Any, iters: int | None
) -> DemoRow:
    """Verify graph against eager on ``batch``; time both (``iters`` runs, median) unless ``iters`` is
    ``None`` (the simulated CPU platform: its replay re-runs the recorded ops, so a time means nothing)."""
    platform = runner.platform
    result = runner.verify(context=context, **batch)
    row = DemoRow(
        runner.phase,
        label,
        str(result.key) if result.replayed else None,
        result.max_abs_diff,
        result.max_abs_diff_unpadded,
        result.ok,
    )
    if iters is not None:

        def eager() -> Any:
            with forward_context(context), torch.no_grad():
                return runner.forward(**batch)

        row.eager_ms = _median_ms(eager, platform, iters)
        row.graph_ms = _median_ms(lambda: runner.run(context=context, **batch), platform, iters)
    else:
        runner.run(context=context, **batch)  # one real step: dispatch, padding and cut-back are counted
    return row


def _print_table(title: str, rows: list[DemoRow]) -> None:
    """The rows; the time columns only where the rows were timed (a real device)."""
    timed = any(r.speedup is not None for r in rows)
    print(f"\n{title}")
    header = f"  {'batch':>14} {'graph key':>26} {'diff padded':>12} {'diff n rows':>12} {'ok':>3}"
    if timed:
        header += f" {'eager ms':>9} {'graph ms':>9} {'eager/graph':>12}"
    print(header)
    print("  " + "-" * (len(header) - 2))
    for r in rows:
        line = (
            f"  {r.batch:>14} {r.key or 'eager':>26} {r.max_abs_diff:>12.3g} "
            f"{r.max_abs_diff_unpadded:>12.3g} {'yes' if r.matches else 'NO':>3}"
        )
        if r.speedup is not None:
            line += f" {r.eager_ms:>9.3f} {r.graph_ms:>9.3f} {r.speedup:>11.2f}x"
        print(line)


#: What the columns mean, printed once under the tables.
LEGEND = (
    "diff padded: max |graph - eager| on the same padded batch (same kernels, same shapes: 0 expected)",
    "diff n rows: max |graph - eager| on the batch's real rows alone (kernels picked for another shape may "
    "round differently)",
    "ok: both diffs within the verify tolerance; graph key 'eager': past the largest key, run eagerly",
)
TIMING_LEGEND = (
    "eager ms, graph ms: median time of one step over --iters runs (eager forward; graph replay with its "
    "input staging and output cut-back)",
    "eager/graph: eager time over graph time (2.00x: the graph step takes half the time)",
)


def cpu_proof(worst: float, padded_rows: int, eager_steps: int) -> str:
    """What a passing run on the simulated CPU platform shows, and that it measures no speed."""
    equal = "bit for bit" if worst == 0 else f"within tolerance (max |graph - eager| {worst:.3g})"
    lines = [
        "What this CPU run shows (graphs are simulated: replay re-runs the recorded ops on the same tensors,",
        "so it checks behaviour, not speed):",
        f"  - graph output equals eager {equal} on the same padded batch, at every captured key;",
        "  - every capture held to the device rules (a host sync such as .item(), a data-dependent shape or",
        "    a nested capture fails a capture here as it does on a GPU);",
        f"  - padding is harmless: {padded_rows} padding rows filled batches up to captured keys, and the",
        "    real rows match eager run on those rows alone (diff n rows);",
        f"  - steps no graph holds ran eagerly, each counted with its reason ({eager_steps} here).",
        "No times are shown: on the CPU they would measure the simulator. Run the demo on a GPU for timings.",
    ]
    return "\n".join(lines)


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
    from devgraph.reference.kernels.backends import auto_fallback_note

    if isinstance(sys.stdout, io.TextIOWrapper):  # piped (`| tee`): each line as printed, not at the end
        sys.stdout.reconfigure(line_buffering=True)
    config = DeviceGraphConfig.parse(args.device_graph_mode)
    platform = resolve_platform(args.device)
    device = torch.device(args.device) if args.device else platform.default_device()
    on_cpu = device.type == "cpu"
    preset = args.preset or ("tiny" if on_cpu else "qwen3-0.6b")
    # Simulated graphs replay by re-running the recorded ops: their times say nothing, so none are taken.
    iters = None if on_cpu else (args.iters or 20)
    overrides: dict[str, Any] = {}
    if getattr(args, "attention", None):
        overrides["attention"] = args.attention
    model_config = ReferenceConfig.preset(preset, **overrides)
    print(
        f"devgraph demo: reference model '{preset}' ({model_config.dtype}, "
        f"{model_config.attention} attention) on {platform.describe()} [{device}]"
    )
    print(f"--device-graph-mode {config.source}")
    if on_cpu and args.iters:
        print("--iters is ignored on the CPU: simulated graphs are not timed")
    note = auto_fallback_note(model_config.kernels, device)
    if note:
        print(f"note: {note}")
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
            _print_table(_table_title(phase, runner.backend.name, iters), rows)
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
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    return _conclude(results["phases"], on_cpu)


def _table_title(phase: str, backend: str, iters: int | None, suffix: str = "") -> str:
    timing = f": median over {iters} runs" if iters is not None else ": graph vs eager (not timed)"
    return f"{phase} ({backend}{suffix}){timing}"


def _conclude(phases: dict[str, Any], on_cpu: bool) -> int:
    """The legend, the verdict and, on the CPU, what the run shows; 1 when a graph disagreed with eager."""
    rows = [r for p in phases.values() for r in p["rows"]]
    print("")
    for line in LEGEND if on_cpu else LEGEND + TIMING_LEGEND:
        print(line)
    worst = max(r["max_abs_diff"] for r in rows)
    print(f"\nmax |graph - eager| over every size, same padded batch: {worst:.3g}")
    failed = [f"{r['phase']} {r['batch']}" for r in rows if not r["matches"]]
    if failed:
        print(f"FAILED: graph output differs from eager beyond the tolerance for {', '.join(failed)}")
        return 1
    if on_cpu:
        stats = [p["stats"] for p in phases.values() if "stats" in p]
        print(cpu_proof(worst, sum(s["padded_rows"] for s in stats), sum(s["eager"] for s in stats)))
    return 0
