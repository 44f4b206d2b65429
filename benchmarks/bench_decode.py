"""devgraph on an NVIDIA GPU: decode, packed prefill and speculative verify on the paged reference model,
against eager, hand-written CUDA graphs, torch.compile(mode="reduce-overhead") and the bandwidth floor.

    python benchmarks/bench_decode.py          # GPU: $OUT/decode.json + .png (else benchmarks/results/)
    python benchmarks/bench_decode.py --smoke  # the whole script on the CPU, tiny preset, under a minute

Model: ``devgraph.reference`` preset ``qwen3-0.6b`` (28 layers, bf16, random weights), paged KV cache of
16-token blocks filled with random values; ``paged`` attention (Triton kernels over device metadata) and a
twin sharing its weights and cache with ``sdpa`` attention (a break op fed host lengths). Every batch reads
read-only context blocks and writes private blocks (``harness.cases.KVPlan``), so each step's output is a
pure function of its inputs and one eager output per case is the reference for every variant.

Sections, in this order (one process unless said; each asks the ``--time-budget`` first, so what the budget
cuts is at the end; each variant's failure is recorded and the run goes on):

1. decode, batch 1/8/32/64 x context 512/2048 (captured sizes 1, 8, 32, 64): eager (paged, sdpa), hand-written
   ``torch.cuda.CUDAGraph``, devgraph ``full``, then ``full`` + inductor (the compiled mode, with its warm-up
   seconds: compile + capture of the four sizes), then ``breakable`` and ``tc_piecewise`` with each attention
   (these leave the reduce-overhead process its share of the budget).
2. host time: ``run()`` at batch 1 against the same runner built with ``single_thread=True`` (no lock) and the
   hand-written step, and per break op (``breakable`` with N trivial breaks against one ``full`` graph).
3. ``torch.compile(model.decode_step, mode="reduce-overhead")`` in a process of its own (CUDA graph trees free
   the cuBLAS workspaces graphs captured earlier use: ``benchmarks/README.md``), timed there with eager, hand
   and ``full`` again; its warm-up seconds.
4. packed prefill 1x32, 1x128, 1x512, 4x128 (captured 32, 128, 512 tokens): eager, hand, ``full``,
   ``breakable`` and ``tc_piecewise`` (paged and sdpa); graph memory per mode.
5. verify (speculative decoding, k = 3, context 512) at batch 1/8/32: eager, hand, ``verify_runner``.
6. warm-ups: ``full`` / ``breakable`` / ``tc_piecewise`` / hand captured with 0, 1 and 2 warm-ups per size
   (capture time and correctness); then the very first capture of fresh processes (own processes, 4 layers).

Latency: CUDA events around each step (from the host starting it to its last kernel), median over steps, the
variants interleaved in rounds; ``host_ms`` is the time until the step returns. Each process compiles into
its own empty inductor and Triton cache (a cold start). The floor of a step: weights read once + KV read +
activations, at the bandwidth of a large device-to-device copy measured in the same run.

The parts live in ``decode_bench/`` (plan, setup, variants, host, children, sections, targets, plots) and
``harness/`` (what every benchmark shares).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from decode_bench.children import probe_child, ro_child
from decode_bench.plan import GPU, SMOKE
from decode_bench.plots import plot, summary
from decode_bench.sections import Bench
from decode_bench.targets import compute_targets
from harness.device import Budget, Device, start
from harness.report import Report, environment, output_path
from harness.targets import targets_table


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (simulated graphs)")
    parser.add_argument(
        "--out", help="JSON path (default $OUT/decode.json, else benchmarks/results/h100-decode.json)"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        help="seconds for the whole run; sections past it are skipped, not started",
    )
    parser.add_argument("--no-ro", action="store_true", help="skip the reduce-overhead process")
    parser.add_argument("--no-probes", action="store_true", help="skip the fresh-process warm-up probes")
    parser.add_argument(
        "--keep-caches",
        action="store_true",
        help="use the inductor/Triton caches already set (default: fresh empty ones)",
    )
    parser.add_argument("--child", choices=("ro", "probe"), help=argparse.SUPPRESS)
    parser.add_argument("--warmup-iters", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.script = __file__  # children run this script again
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = SMOKE if args.smoke else GPU
    if not start(args.smoke):
        return 2
    if args.child:
        with torch.no_grad():
            result = (ro_child if args.child == "ro" else probe_child)(args, plan)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        return 0
    budget = Budget(args.time_budget or plan.budget_s)
    path = output_path("decode.json", "benchmarks/results/h100-decode.json", args.out, args.smoke)
    report = Report(path, environment(Device("cpu" if args.smoke else "cuda")))
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as cache_root:
        root = Path(cache_root)
        if not args.keep_caches:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "main" / "inductor")
            os.environ["TRITON_CACHE_DIR"] = str(root / "main" / "triton")
        report.data["meta"]["compile_caches"] = "kept" if args.keep_caches else "fresh empty per process"
        report.data["meta"]["time_budget_s"] = budget.seconds
        with torch.no_grad():
            Bench(args, plan, report, budget, root).run()
    targets = compute_targets(report.data, plan)
    report.data["targets"] = [t.as_dict() for t in targets]
    report.data["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
    report.save()
    try:
        plot(report.data, plan, path.with_suffix(".png"))
    except Exception as exc:
        report.error("plot", exc)
        report.save()
    print(summary(report.data))
    if args.smoke:
        print("\n--smoke: the CPU simulator replays by re-running ops; its timings say nothing about a GPU")
    print(f"\nwrote {path} and {path.with_suffix('.png')} in {budget.elapsed():.0f}s\n")
    print(targets_table(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
