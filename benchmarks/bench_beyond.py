"""Beyond the peers (issue 22): tuned capture sizes, the address guard, the fallback graph set, shared pools.

    python benchmarks/bench_beyond.py                    # GPU, about 4 min on an H100: $OUT/beyond.json, .png
    python benchmarks/bench_beyond.py --time-budget 300    # stop starting sections past 300 s
    python benchmarks/bench_beyond.py --smoke              # the script on the CPU simulator (tiny model)

Model: the reference model at Qwen3-0.6B's shape (28 layers, bf16, random weights, paged attention), KV cache
filled with random values; a 2-layer draft of the same width and vocabulary for the pool section. Sections,
each in this process, each saved as it ends (benchmarks/README.md, "bench_beyond.py"):

* ``tuning``: a skewed trace of decode steps (batch sizes clustered just above the default sizes) through a
  runner with the default sizes up to its largest step, recording it; ``tune_phase`` on the recording (as many
  sizes: equal graph count); the trace again through both, interleaved. Padded tokens, tokens/s, graph bytes.
* ``guard``: host microseconds of ``run()`` (decode batch 1, ``full``) with and without the address guard, and
  of one check; the three cases it must catch (a weight replaced, a KV cache re-created, a buffer freed).
* ``fallback``: ``{"decode": {"backend": "full", "fallback": "breakable"}}`` with a primary that declines the
  steps asked to: those steps replay the ``breakable`` graphs; latency against the same steps eager, for the
  ``paged`` attention (one segment per key) and the ``sdpa`` break op (eager attention between segments).
* ``pool``: graph memory of a draft and a target runner in one ``GraphPool`` against each in its own pool,
  both sampling greedily in the graph (``tokens``) and both returning logits (``logits``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from beyond import sections
from harness.device import Budget, Device, MiB, start
from harness.plots import Panel, plot_panels
from harness.report import Report, environment, output_path
from harness.targets import Target, targets_table

log = logging.getLogger("bench_beyond")


def _targets(data: dict[str, Any]) -> list[Target]:
    tuning, guard, fallback, pool = (data.get(k) or {} for k in ("tuning", "guard", "fallback", "pool"))
    cut = tuning.get("padded_cut")
    ratios = [c["eager_over_fallback"] for c in (fallback.get("cases") or {}).values()]
    return [
        Target(
            "tuned sizes: padded tokens cut vs default", cut * 100 if cut is not None else None, 50, "%", True
        ),
        Target("tuned sizes: graph memory vs default", tuning.get("graph_bytes_ratio"), 1.05, "x"),
        Target("tuned sizes: tokens/s vs default", tuning.get("tokens_per_s_ratio"), 1.0, "x", True),
        # What run() adds for the guard is one check; the difference of two runners' run() medians is
        # reported beside it (run_cost_us) but lies within their noise.
        Target("address guard: host cost per run() (one check, in place)", guard.get("check_us"), 2.0, " us"),
        Target(
            "address guard: cases caught",
            sum((guard.get("caught") or {}).values()) if guard else None,
            3,
            "",
            True,
        ),
        Target(
            "fallback graphs vs the same steps eager (worst case)",
            min(ratios) if ratios else None,
            3.0,
            "x",
            True,
        ),
        Target(
            "shared pool / two pools (greedy draft + target)",
            (pool.get("tokens") or {}).get("ratio"),
            0.6,
            "x",
        ),
    ]


def _plot(path: Path, data: dict[str, Any]) -> None:
    panels = []
    tuning = data.get("tuning")
    if tuning:
        panels.append(
            Panel(
                "skewed decode trace: padded tokens and tokens/s",
                ["padded tokens", "tokens/s", "graph MiB"],
                {
                    name: [
                        tuning[name]["padded_tokens"],
                        tuning[name]["tokens_per_s"],
                        tuning[name]["graph_bytes"] / MiB,
                    ]
                    for name in ("default", "tuned")
                },
                ylabel="value (log)",
                bars=True,
            )
        )
    guard = data.get("guard")
    if guard:
        panels.append(
            Panel(
                "address guard: host us per run() (decode b1)",
                ["run()", "one check"],
                {
                    "guarded": [guard["run_host_us"]["guarded"], guard["check_us"]],
                    "unguarded": [guard["run_host_us"]["unguarded"], None],
                },
                ylabel="us (median)",
                bars=True,
            )
        )
    fallback = data.get("fallback")
    if fallback:
        cases = list(fallback["cases"])
        panels.append(
            Panel(
                "declined steps: fallback (breakable) graphs vs eager",
                cases,
                {
                    k: [fallback["cases"][c].get(f"{k}_ms") for c in cases]
                    for k in ("fallback", "primary", "eager")
                },
            )
        )
    pool = data.get("pool")
    if pool:
        kinds = list(pool)
        panels.append(
            Panel(
                "graph memory: draft + target",
                kinds,
                {
                    "two pools": [sum(pool[k]["separate_bytes"].values()) / MiB for k in kinds],
                    "one shared pool": [pool[k]["shared_bytes"] / MiB for k in kinds],
                },
                ylabel="MiB",
                bars=True,
            )
        )
    if panels:
        plot_panels(
            path, panels, "devgraph beyond the peers: tuned sizes, address guard, fallback set, pools"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="run on the CPU simulator with the tiny model")
    parser.add_argument(
        "--time-budget", type=float, default=420.0, help="seconds; later sections are skipped"
    )
    parser.add_argument("--out", default=None, help="JSON path (the PNG goes beside it)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps in the skewed trace")
    parser.add_argument("--sections", default=None, help="comma-separated: tuning,guard,fallback,pool (all)")
    args = parser.parse_args()
    if not start(args.smoke):
        return 1
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    dev = Device(device)
    budget = Budget(args.time_budget)
    path = output_path("beyond.json", "benchmarks/results/h100-beyond.json", args.out, smoke)
    report = Report(path, {**environment(dev), "smoke": smoke, "time_budget_s": args.time_budget})
    seq_len = 64 if smoke else 256
    target, draft = sections.models(smoke, device, max_requests=160, seq_len=seq_len)
    steps = args.steps or (60 if smoke else 600)
    plan = [
        ("tuning", 120, lambda: sections.tuning(target, dev, steps, seq_len - 8)),
        ("guard", 40, lambda: sections.guard(target, dev, 50 if smoke else 400, seq_len - 8)),
        (
            "fallback",
            90,
            lambda: sections.fallback(
                {"paged": target, "sdpa": sections.sdpa_twin(target)},
                dev,
                [1, 8] if smoke else [1, 8, 32, 64],
                seq_len - 8,
                3 if smoke else 30,
            ),
        ),
        (
            "pool",
            60,
            lambda: sections.pool(target, draft, dev, [1, 2, 4, 8] if smoke else [1, 2, 4, 8, 16, 32, 64]),
        ),
    ]
    wanted = set(args.sections.split(",")) if args.sections else {name for name, _, _ in plan}
    for name, estimate, run in plan:
        if name not in wanted:
            continue
        if not budget.allows(0 if smoke else estimate):
            report.data.setdefault("skipped", []).append(
                f"{name}: {budget.left():.0f} s left, needs about {estimate}"
            )
            continue
        log.info("section %s (%.0f s left)", name, budget.left())
        try:
            report.data[name] = run()
        except Exception as exc:  # one section's failure keeps the others
            report.error(name, exc)
        report.data["targets"] = [t.as_dict() for t in _targets(report.data)]
        report.data["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
        report.save()
    targets = _targets(report.data)
    print(targets_table(targets))
    try:
        _plot(path.with_suffix(".png"), report.data)
    except ImportError as exc:  # matplotlib is on the GPU machines; a bare CPU venv may lack it
        log.warning("no plot: %s", exc)
    print(f"wrote {path} (and the PNG beside it)", file=sys.stderr)
    return 0 if not report.data["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
