"""The zoo on an NVIDIA GPU: every zoo model (tests/zoo) at a Qwen3-0.6B-like shape, bf16, decode batch
1/8/32/64: eager, a hand-written ``torch.cuda.CUDAGraph`` of the eager forward, devgraph ``full`` (plain),
devgraph ``full`` + inductor (compiled) and ``torch.compile(mode="reduce-overhead")``.

    python benchmarks/bench_zoo.py --models plain,gptfast,paged --time-budget 450   # $OUT/zoo-plain-etc.json
    python benchmarks/bench_zoo.py --smoke      # the whole script on the CPU, tiny shape (simulated graphs)

Shape: Qwen3-0.6B's widths (hidden 1024, 16 query / 8 key-value heads of 128, MLP 3072, vocab 151936) with
``--layers`` layers (default 8, so that three models fit a ten-minute call; 28 is the real depth), a static
cache of 1024 positions per row (every model reads all of them each step, as static caches do), random
weights. Hugging Face models write every row at position 256 (the write position is put back before each
step, outside the timed region); the others at seeded per-row positions.

Per model: warm-up seconds (compile + warm-ups + capture of every batch size; reduce-overhead: until every
size has recorded its graph), median latency over interleaved steps (CUDA events), the bandwidth floor (all
weights + the KV read + the logits written, at the bandwidth of a large copy measured in the same run) and
the ratio to it, and each variant's output against eager on the same step. reduce-overhead runs in a child
process (CUDA graph trees free cuBLAS workspaces that earlier graphs use); eager is timed there again and
the drift between the processes reported. Each process compiles into empty inductor/Triton caches.

The JSON has the targets (compiled full <= 0.9x reduce-overhead latency, warm-up <= 0.3x; plain full <=
1.02x hand) and ``decision``: the numbers for making compiled ``full`` the ``auto`` decode mode on CUDA,
read against the rule in docs/performance.md.
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
from harness.children import child_env, run_child, script_command
from harness.device import Budget, Device, start
from harness.floor import copy_bandwidth
from harness.report import Report, environment, output_path
from harness.targets import targets_table
from zoo_bench.results import decision, plot, summary, targets
from zoo_bench.sections import model_section, ro_section
from zoo_bench.setup import DECODERS, plan_for

#: The reduce-overhead process's seconds per model, as a share of this process's (measured on an H200: about
#: 0.6 with margin).
RO_SHARE = 0.6


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (simulated graphs)")
    parser.add_argument(
        "--models", help=f"comma-separated zoo models (default: {','.join(DECODERS)}; also hf_bert)"
    )
    parser.add_argument("--layers", type=int, help="layers of the GPU shape (default 8)")
    parser.add_argument("--batches", help="comma-separated batch sizes (default 1,8,32,64)")
    parser.add_argument("--out", help="JSON path (default $OUT/zoo-<first model>.json)")
    parser.add_argument("--time-budget", type=float, help="seconds for the whole run (default 450)")
    parser.add_argument("--no-ro", action="store_true", help="skip the reduce-overhead process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not start(args.smoke):
        return 2
    batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    plan = plan_for(args.smoke, args.layers, batches)
    models = args.models.split(",") if args.models else DECODERS
    dev = Device(plan.device)
    budget = Budget(args.time_budget or plan.budget_s)
    if args.child:
        report = Report(Path(args.out), environment(dev))
        with torch.no_grad():
            for name in models:
                report.data[name] = ro_section(name, plan, dev, report)
                report.save()
        return 0
    name = (
        "zoo-"
        + ("all" if not args.models else models[0] if len(models) == 1 else f"{models[0]}-etc")
        + ".json"
    )
    path = output_path(name, f"benchmarks/results/h100-{name}", args.out, args.smoke)
    report = Report(path, {**environment(dev), "shape": f"{plan.shape}", "dtype": str(plan.dtype)})
    report.data["meta"].update(models=models, batches=plan.batches, time_budget_s=budget.seconds)
    report.data["models"] = {}
    with tempfile.TemporaryDirectory(prefix="bench-zoo-") as cache_root:
        root = Path(cache_root)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "main" / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(root / "main" / "triton")
        bandwidth = copy_bandwidth(dev, (1 << 30) if dev.cuda else (1 << 24))
        report.data["meta"]["bandwidth"] = bandwidth
        # A model starts only if its own section and the reduce-overhead process's share of every model so
        # far still fit. Before the first model the plan's estimate stands (half here, half in the
        # reduce-overhead process); after it, the slowest section measured, and reduce-overhead's share at
        # RO_SHARE of it (its process compiles one variant where this one compiles two, and times fewer).
        section_s = plan.per_model_s / 2
        ro_share = 0.0 if args.no_ro else RO_SHARE
        done: list[str] = []
        spent: list[float] = []
        with torch.no_grad():
            for model in models:
                if spent:
                    section_s = max(spent)
                if done and budget.left() < section_s + ro_share * section_s * (len(done) + 1):
                    report.data["meta"].setdefault("skipped_for_time", []).append(model)
                    continue
                began = budget.elapsed()
                try:
                    report.data["models"][model] = model_section(model, plan, dev, report, bandwidth["GBps"])
                    done.append(model)
                except Exception as exc:
                    report.error(model, exc)
                spent.append(budget.elapsed() - began)
                report.save()
        report.data["meta"]["section_seconds"] = [round(s, 1) for s in spent]
        if done and not args.no_ro:
            _ro_child(args, root, budget, done, report)
    report.data["targets"] = [t.as_dict() for t in targets(report.data)]
    report.data["decision"] = decision(report.data)
    report.data["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
    report.save()
    try:
        plot(report.data, path.with_suffix(".png"))
    except Exception as exc:
        report.error("plot", exc)
        report.save()
    print(summary(report.data))
    if report.data["meta"].get("skipped_for_time"):
        print(f"skipped for time: {', '.join(report.data['meta']['skipped_for_time'])}")
    print(targets_table(targets(report.data)))
    print(
        json.dumps(report.data["decision"]["geomean_speedup"]),
        report.data["decision"]["compiled_full_for_auto"],
    )
    if args.smoke:
        print("\n--smoke: the CPU simulator replays by re-running ops; its timings say nothing about a GPU")
    print(f"\nwrote {path} and {path.with_suffix('.png')} in {budget.elapsed():.0f}s")
    return 0


def _ro_child(
    args: argparse.Namespace, root: Path, budget: Budget, models: list[str], report: Report
) -> None:
    out = root / "ro.json"
    command = script_command(__file__, "--child", "--models", ",".join(models), "--out", str(out))
    for flag, value in (("--layers", args.layers), ("--batches", args.batches)):
        if value:
            command += [flag, str(value)]
    if args.smoke:
        command.append("--smoke")
    try:
        result = run_child(command, out, child_env(root, "ro"), budget, cap=budget.left() - 5)
    except Exception as exc:
        report.error("reduce-overhead process", exc)
        result = json.loads(out.read_text()) if out.exists() else {}
    for model in models:
        child = result.get(model)
        if not child:
            continue
        entry = report.data["models"][model]
        entry["variants"]["reduce_overhead"] = child["variants"].get("reduce_overhead", {})
        entry["drift_eager_child_over_parent"] = {
            case: round(row["ms"] / entry["variants"]["eager"]["cases"][case]["ms"], 3)
            for case, row in child.get("eager_in_child", {}).items()
            if entry["variants"].get("eager", {}).get("cases", {}).get(case)
        }
    report.data["errors"] += result.get("errors", [])


if __name__ == "__main__":
    sys.exit(main())
