"""``devgraph tune``: capture sizes tuned to recorded traffic, printed and written as the flag's JSON.

    devgraph tune steps.json [--graphs N | --graph-bytes B] [--max-size N] [--axis requests=N]
                             [--phase decode] [--out tuned.json] [--report report.json]

``steps.json`` is a trace (``devgraph.write_trace``) or a runner's ``stats()`` export recorded with
``record_steps=True``. For each phase the table compares the rows the recorded steps padded under the sizes
they ran with (or the phase's defaults) and under the tuned ones, at the same number of graphs unless a
budget is given. ``--out`` holds ``{"decode": {"sizes": [...]}, ...}``: pass it to ``--device-graph-mode``
as it is, or to ``devgraph serve --tuned``. See docs/user-guide.md, "Tuned sizes".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from devgraph import PHASES, REQUESTS, ConfigError, Phase, load_steps, tune_phase
from devgraph.flag.sizes import MAX_SIZE_COUNT
from devgraph.flag.tuning import PhaseTuning, tuned_flag
from devgraph.messages import shorten

__all__ = ["add_tune_command", "run_tune"]


def _positive(limit: int) -> Any:
    def parse(text: str) -> int:
        value = text.strip()
        if not value.isdigit() or len(value) > 20 or not 1 <= int(value) <= limit:
            raise argparse.ArgumentTypeError(f"{shorten(text)} is not an integer from 1 to {limit}")
        return int(value)

    return parse


def _axis(text: str) -> tuple[str, int]:
    name, _, count = text.partition("=")
    if not name.isidentifier() or not count.isdigit() or not 1 <= int(count) <= MAX_SIZE_COUNT:
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not AXIS=N (e.g. requests=4)")
    return name, int(count)


def add_tune_command(sub: Any) -> None:
    """Add ``devgraph tune`` to the command's subparsers."""
    tune = sub.add_parser("tune", help="capture sizes tuned to recorded steps, as --device-graph-mode JSON")
    tune.set_defaults(command_parser=tune, run=run_tune)
    tune.add_argument("steps", metavar="STEPS", help="a trace file or a runner's stats() JSON (record_steps)")
    budget = tune.add_mutually_exclusive_group()
    budget.add_argument(
        "--graphs",
        type=_positive(MAX_SIZE_COUNT),
        default=None,
        help="token sizes per phase (default: as many as the recorded steps ran with: equal graph memory)",
    )
    budget.add_argument(
        "--graph-bytes",
        type=_positive((1 << 63) - 1),
        default=None,
        metavar="BYTES",
        help="graph-memory budget per phase, from the per-key bytes the trace recorded",
    )
    tune.add_argument(
        "--size-sum",
        type=_positive(1 << 40),
        default=None,
        metavar="N",
        help="also bound the sum of the sizes (graph memory that grows with each graph's size)",
    )
    tune.add_argument(
        "--max-size",
        type=_positive(1 << 20),
        default=None,
        help="the largest size to keep (>= the largest step)",
    )
    tune.add_argument(
        "--axis",
        type=_axis,
        action="append",
        default=[],
        metavar="AXIS=N",
        help="also tune the buckets of another axis (prefill: requests=4)",
    )
    tune.add_argument("--phase", choices=PHASES, action="append", default=None, help="only these phases")
    tune.add_argument(
        "--out", default=None, metavar="PATH", help="write the tuned sizes (the flag's JSON) here"
    )
    tune.add_argument("--report", default=None, metavar="PATH", help="write the comparison as JSON here")


def _table(tunings: list[PhaseTuning]) -> str:
    lines = [
        f"{'phase':<8} {'axis':<9} {'steps':>8} {'graphs':>6} {'padded before':>14} {'padded after':>13} "
        f"{'cut':>6}  sizes"
    ]
    for tuning in tunings:
        for axis in tuning.axes:
            past = f" ({axis.baseline_past} steps ran eagerly before)" if axis.baseline_past else ""
            lines.append(
                f"{tuning.phase:<8} {axis.axis:<9} {tuning.steps:>8} {len(axis.sizes):>6} "
                f"{axis.baseline_padded:>14} {axis.padded:>13} {axis.cut:>6.1%}  {list(axis.sizes)}{past}"
            )
    return "\n".join(lines)


def run_tune(args: argparse.Namespace) -> int:
    recorded = load_steps(args.steps)
    if not recorded:  # an empty list or trace: tuning it would print an empty flag as if it were one
        raise ConfigError(
            f"{args.steps} holds no recorded steps; record traffic first (devgraph serve --record-steps "
            "PATH, or a runner built with record_steps=True)"
        )
    phases = args.phase or sorted(recorded)
    missing = [p for p in phases if p not in recorded]
    if missing:
        raise ConfigError(
            f"{args.steps} holds no recorded {', '.join(missing)} steps (it has {sorted(recorded)})"
        )
    axis_graphs = dict(args.axis)
    recorded_axes = sorted({a for p in phases for a in recorded[p].axes} - {"tokens"})
    unknown = sorted(set(axis_graphs) - set(recorded_axes))
    if unknown:
        raise ConfigError(
            f"--axis {unknown[0]}: the recorded {', '.join(phases)} steps have no such axis (their other "
            f"axes: {', '.join(recorded_axes) or 'none'})"
        )
    tunings = []
    for phase in phases:
        uniform = Phase.parse(phase).uniform  # requests follow from tokens there
        axes = {
            a: n
            for a, n in axis_graphs.items()
            if a in recorded[phase].axes and not (uniform and a == REQUESTS)
        }
        tunings.append(
            tune_phase(
                recorded[phase],
                graphs=args.graphs,
                graph_bytes=args.graph_bytes,
                size_sum=args.size_sum,
                top=args.max_size,
                axis_graphs=axes,
            )
        )
    flag = tuned_flag(tunings)
    print(_table(tunings), file=sys.stderr)
    text = json.dumps(flag)
    print(text)
    if args.out:
        _write("--out", args.out, text)
    if args.report:
        report = {
            "steps_file": str(args.steps),
            "flag": flag,
            "phases": {t.phase: {"steps": t.steps, "axes": [a.as_dict() for a in t.axes]} for t in tunings},
        }
        _write("--report", args.report, json.dumps(report, indent=1))
    return 0


def _write(argument: str, path: str, text: str) -> None:
    try:
        Path(path).write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{argument} {shorten(path)}: cannot write it ({exc.strerror or exc})") from None
